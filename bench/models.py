"""The benchmark's training runs: small transformers trained for real on synthetic data.

Each ``run_*`` function trains deterministically (fixed seeds, fixed data) and returns the
checkpoints it took, one every ``every`` optimizer steps, as independent deep copies of
``{"model", "optimizer", "scheduler", "rng", "step"}`` (plus ``"master"`` for bf16), so every
storage method later sees exactly the same states. Nothing here is timed.

Data: a fixed random Markov chain over the vocabulary (each token has a handful of likely
successors), so the models have structure to learn and their weights move the way a real
training run's do, not the way random noise does.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ckptstore.state import param_names

__all__ = ["Size", "SIZES", "run_gpt_fp32", "run_gpt_bf16", "run_finetune"]

State = dict[str, Any]


@dataclass(frozen=True)
class Size:
    vocab: int  # GPT runs
    dim: int
    layers: int
    heads: int
    seq: int
    batch: int
    pretrain_steps: int  # fine-tune run only: unmeasured pretraining before it
    encoder_vocab: int  # fine-tune run: a tokenizer-sized vocabulary


SIZES = {
    # GPT ~5.8M parameters, about 0.2 s per step on 2 cores; the encoder ~9.9M, 43% of them
    # token embeddings (a 22M MiniLM-style encoder with a 30k vocabulary has 51%)
    "full": Size(
        vocab=512,
        dim=256,
        layers=7,
        heads=4,
        seq=64,
        batch=8,
        pretrain_steps=200,
        encoder_vocab=16384,
    ),
    # small enough for a smoke run of the whole pipeline in a couple of minutes
    "quick": Size(
        vocab=256,
        dim=128,
        layers=2,
        heads=4,
        seq=32,
        batch=8,
        pretrain_steps=50,
        encoder_vocab=2048,
    ),
}


# -- data ---------------------------------------------------------------------------------


def markov_chain(
    vocab: int, seed: int, successors: int = 8, favour: tuple[int, int] | None = None
) -> torch.Tensor:
    """A row-stochastic transition matrix: each token has ``successors`` likely next tokens
    (drawn from the token range ``favour`` when given, so a class shows in its token mix)."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.full((vocab, vocab), 1e-3 / vocab)
    lo, hi = favour or (0, vocab)
    nxt = torch.randint(lo, hi, (vocab, successors), generator=g)
    weights = torch.rand(vocab, successors, generator=g) ** 2 + 0.05
    probs.scatter_add_(1, nxt, weights)
    return probs / probs.sum(1, keepdim=True)


def sample_chain(probs: torch.Tensor, n: int, length: int, seed: int) -> torch.Tensor:
    """``n`` sequences of ``length`` tokens drawn from the chain (vectorised over sequences)."""
    g = torch.Generator().manual_seed(seed)
    cum = probs.cumsum(1)
    cum[:, -1] = 1.0
    out = torch.empty(n, length, dtype=torch.long)
    out[:, 0] = torch.randint(0, probs.shape[0], (n,), generator=g)
    for t in range(1, length):
        u = torch.rand(n, 1, generator=g)
        out[:, t] = (
            torch.searchsorted(cum[out[:, t - 1]], u).squeeze(1).clamp_(max=probs.shape[0] - 1)
        )
    return out


def zipf_chain(
    tokens: torch.Tensor, seed: int, successors: int = 8, restart: float = 0.1
) -> Callable[[int, int, int], torch.Tensor]:
    """A sparse Markov chain over ``tokens`` with Zipfian token frequencies, the way text
    over a real tokenizer's vocabulary looks: each token has ``successors`` likely next
    tokens, and with probability ``restart`` the next token is drawn afresh from the Zipf
    distribution (rank 1 = ``tokens[0]``). Returns ``sample(n, length, seed)``, which draws
    ``n`` sequences of token ids. Scales to vocabularies a dense matrix cannot hold."""
    g = torch.Generator().manual_seed(seed)
    m = len(tokens)
    zipf = 1.0 / torch.arange(1, m + 1, dtype=torch.float64) ** 1.1
    zipf_cum = (zipf / zipf.sum()).cumsum(0).float()
    zipf_cum[-1] = 1.0
    succ = torch.multinomial(zipf.float(), m * successors, replacement=True, generator=g)
    succ = succ.view(m, successors)
    weights = torch.rand(m, successors, generator=g) ** 2 + 0.05
    cum = (weights / weights.sum(1, keepdim=True)).cumsum(1)
    cum[:, -1] = 1.0

    def draw(cdf: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
        u = torch.rand(n, 1, generator=gen)
        return torch.searchsorted(cdf, u).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)

    def sample(n: int, length: int, sample_seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(sample_seed)
        idx = torch.empty(n, length, dtype=torch.long)
        idx[:, 0] = draw(zipf_cum.expand(n, m), n, gen)
        for t in range(1, length):
            prev = idx[:, t - 1]
            nxt = succ[prev, draw(cum[prev], n, gen)]
            jump = torch.rand(n, generator=gen) < restart
            idx[:, t] = torch.where(jump, draw(zipf_cum.expand(n, m), n, gen), nxt)
        return tokens[idx]

    return sample


# -- models -------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, causal: bool, dropout: float) -> None:
        super().__init__()
        self.heads, self.causal, self.dropout = heads, causal, dropout
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=self.causal,
            dropout_p=self.dropout if self.training else 0.0,
        )
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, s, d)))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class Transformer(nn.Module):
    """Decoder-only (``causal=True``, GPT) or encoder (BERT-like) trunk with a linear head."""

    def __init__(self, size: Size, causal: bool, out: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.tok = nn.Embedding(size.vocab, size.dim)
        self.pos = nn.Embedding(size.seq, size.dim)
        self.blocks = nn.ModuleList(
            Block(size.dim, size.heads, causal, dropout) for _ in range(size.layers)
        )
        self.ln_f = nn.LayerNorm(size.dim)
        self.head = nn.Linear(size.dim, out)
        self.apply(_init)

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        for block in self.blocks:
            h = block(h)
        return self.ln_f(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x))


def _init(m: nn.Module) -> None:
    if isinstance(m, nn.Linear | nn.Embedding):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / total)))

    return f


def _batch(data: torch.Tensor, batch: int, g: torch.Generator) -> torch.Tensor:
    return data[torch.randint(0, data.shape[0], (batch,), generator=g)]


def _step(model: nn.Module, opt: Any, sched: Any, loss: torch.Tensor) -> float:
    """One optimizer step (gradient clipping at 1.0, then the LR schedule); the loss."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return float(loss.item())


def _snapshot(state: State) -> State:
    return copy.deepcopy(state)


# -- runs ---------------------------------------------------------------------------------


@dataclass
class RunResult:
    name: str
    params: int
    checkpoints: list[tuple[int, State]]
    losses: list[float]
    # for bench/lossy.py (fp32 GPT and fine-tune runs): the batch generator's state at each
    # checkpoint, the held-out loss of a state, and training resumed from a checkpoint's
    # state (with its generator state) to the end of the run, returning the final state
    gens: list[torch.Tensor] = field(default_factory=list)
    evaluate: Callable[[State], float] | None = None
    resume: Callable[[State, torch.Tensor], State] | None = None
    # which optimizer id is which parameter (``ckptstore.param_names``, as a save with
    # ``model=`` and ``optimizer=`` sends it): lossy pairing by name, whatever the groups
    names: str | None = None


def adamw(model: nn.Module, groups: bool, weight_decay: float, **kw: Any) -> Any:
    """AdamW over ``model``'s parameters: one group, or (``groups``) two, as real training
    scripts build it (the Hugging Face Trainer, nanoGPT's ``configure_optimizers``): weight
    decay for the matrices, none for biases, norms and other vectors, the no-decay group
    first. The optimizer's integer ids then follow the groups, not the model."""
    if not groups:
        return torch.optim.AdamW(model.parameters(), weight_decay=weight_decay, **kw)
    params = list(model.parameters())
    no_decay = [p for p in params if p.dim() < 2]
    decay = [p for p in params if p.dim() >= 2]
    groups_ = [
        {"params": no_decay, "weight_decay": 0.0},
        {"params": decay, "weight_decay": weight_decay},
    ]
    return torch.optim.AdamW(groups_, **kw)


def _held_out_loss(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean cross entropy over fixed held-out batches (eval mode: no dropout), in float64."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in batches:
            logits = model(x) if y.dim() > 1 else model.head(model.trunk(x).mean(1))
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
            )
            total += float(loss.double())
            count += y.numel()
    model.train()
    return total / count


def _load(model: nn.Module, opt: Any, sched: Any, state: State) -> None:
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])


def run_gpt_fp32(
    size: Size, n_ckpt: int, every: int, log: Callable[[str], None], groups: bool = False
) -> RunResult:
    """GPT trained from scratch in fp32 with AdamW (``groups``: two param groups,
    :func:`adamw`) and warmup + cosine LR."""
    torch.manual_seed(1)
    chain = markov_chain(size.vocab, 11)
    data = sample_chain(chain, 4096, size.seq + 1, 12)
    g = torch.Generator().manual_seed(13)
    total = n_ckpt * every

    def make() -> tuple[nn.Module, Any, Any]:
        model = Transformer(size, causal=True, out=size.vocab, dropout=0.1)
        opt = adamw(model, groups, 0.1, lr=1e-3, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(every, total))
        return model, opt, sched

    def train(
        model: nn.Module, opt: Any, sched: Any, g: torch.Generator, first: int, res: RunResult
    ) -> None:
        model.train()
        for step in range(first, total + 1):
            xy = _batch(data, size.batch, g)
            logits = model(xy[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, size.vocab), xy[:, 1:].reshape(-1))
            res.losses.append(_step(model, opt, sched, loss))
            if step % every == 0:
                res.checkpoints.append((step, _snapshot(_state(model, opt, sched, step))))
                res.gens.append(g.get_state())
                log(f"    step {step:4d} loss {sum(res.losses[-every:]) / every:.3f}")

    model, opt, sched = make()
    res = RunResult("gpt-scratch-fp32" + "-2g" * groups, n_params(model), [], [])
    res.names = param_names(model, opt)
    train(model, opt, sched, g, 1, res)
    held: list[tuple[torch.Tensor, torch.Tensor]] = []

    def evaluate(state: State) -> float:
        if not held:
            xy = sample_chain(chain, 256, size.seq + 1, 99)
            held.extend((b[:, :-1], b[:, 1:]) for b in xy.split(64))
        model = make()[0]
        model.load_state_dict(state["model"])
        return _held_out_loss(model, held)

    def resume(state: State, gen: torch.Tensor) -> State:
        model, opt, sched = make()
        _load(model, opt, sched, state)
        g = torch.Generator()
        g.set_state(gen)
        out = RunResult(res.name, res.params, [], [])
        train(model, opt, sched, g, state["step"] + 1, out)
        return _state(model, opt, sched, total)

    res.evaluate, res.resume = evaluate, resume
    return res


def run_gpt_bf16(size: Size, n_ckpt: int, every: int, log: Callable[[str], None]) -> RunResult:
    """The same GPT with bf16 weights computed from an fp32 master copy the optimizer owns.

    Each step: forward/backward in bf16, grads copied to the fp32 master, AdamW on the master,
    then the bf16 weights are re-derived as round-to-nearest casts of the master.
    """
    torch.manual_seed(1)
    data = sample_chain(markov_chain(size.vocab, 11), 4096, size.seq + 1, 12)
    g = torch.Generator().manual_seed(13)
    model = Transformer(size, causal=True, out=size.vocab, dropout=0.1)
    names = [n for n, _ in model.named_parameters()]
    master = [p.detach().clone().float() for p in model.parameters()]
    for m in master:
        m.requires_grad_(True)
    model.to(torch.bfloat16)
    opt = torch.optim.AdamW(master, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    total = n_ckpt * every
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(every, total))
    ckpts: list[tuple[int, State]] = []
    losses: list[float] = []
    model.train()
    params = list(model.parameters())
    for step in range(1, total + 1):
        xy = _batch(data, size.batch, g)
        logits = model(xy[:, :-1]).float()
        loss = F.cross_entropy(logits.reshape(-1, size.vocab), xy[:, 1:].reshape(-1))
        for p in params:
            p.grad = None
        loss.backward()
        for p, m in zip(params, master, strict=True):
            m.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(master, 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():
            for p, m in zip(params, master, strict=True):
                p.copy_(m)
        losses.append(loss.item())
        if step % every == 0:
            state = _state(model, opt, sched, step)
            state["master"] = {n: m.detach() for n, m in zip(names, master, strict=True)}
            ckpts.append((step, _snapshot(state)))
            log(f"    step {step:4d} loss {sum(losses[-every:]) / every:.3f}")
    return RunResult("gpt-scratch-bf16", n_params(model), ckpts, losses)


def run_finetune(
    size: Size, n_ckpt: int, every: int, log: Callable[[str], None], groups: bool = False
) -> RunResult:
    """A BERT-like encoder with a tokenizer-sized vocabulary, pretrained (unmeasured), then
    fine-tuned with a new head (``groups``: with two param groups, :func:`adamw`).

    Text: Zipfian tokens over ``size.encoder_vocab`` ids (:func:`zipf_chain`), as over a real
    tokenizer. Pretraining covers the whole vocabulary; the fine-tuning task is a domain that
    uses a few thousand of its tokens, so, as in real fine-tuning, most embedding rows get no
    gradient between two checkpoints.

    Pretraining: next-token prediction with the attention masked causally (the UniLM way of
    training an encoder's weights as a language model). Masked-LM pretraining was tried first
    and stays on the unigram plateau for the few hundred steps this benchmark can afford;
    next-token prediction learns within them, so the weights fine-tuning starts from are
    genuinely trained.

    Fine-tuning: bidirectional attention, a new head, the task of telling which of 4 chains
    produced a sequence (mean-pooled classification; each class's chain runs over its own
    overlapping band of the domain's tokens). Fresh AdamW at lr 5e-5 (BERT's usual
    fine-tuning rate), warmup then cosine. Only the fine-tuning checkpoints are returned.
    """
    torch.manual_seed(2)
    vocab = size.encoder_vocab
    big = replace(size, vocab=vocab)
    ranks = torch.randperm(vocab, generator=torch.Generator().manual_seed(20))
    pre = zipf_chain(ranks, 21)(4096, size.seq + 1, 22)
    g = torch.Generator().manual_seed(23)
    lm = Transformer(big, causal=True, out=vocab, dropout=0.1)
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, warmup_cosine(size.pretrain_steps // 10, size.pretrain_steps)
    )
    lm.train()
    pre_losses: list[float] = []
    for step in range(1, size.pretrain_steps + 1):
        xy = _batch(pre, size.batch, g)
        logits = lm(xy[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), xy[:, 1:].reshape(-1))
        pre_losses.append(_step(lm, opt, sched, loss))
        if step % 50 == 0 or step == size.pretrain_steps:
            recent = pre_losses[-50:]
            log(f"    pretrain step {step:4d} loss {sum(recent) / len(recent):.3f}")

    classes = 4
    per = 1024
    # the domain: the language's most common third of the vocabulary, most frequent first,
    # so each class's chain is Zipfian over its band too
    domain = ranks[: vocab // 3]
    band = len(domain) // classes
    seqs = [
        zipf_chain(domain[c * band : (c + 2) * band], 31 + c)(per, size.seq, 41 + c)
        for c in range(classes)
    ]
    xs = torch.cat(seqs)
    ys = torch.arange(classes).repeat_interleave(per)
    model = Transformer(big, causal=False, out=classes, dropout=0.1)
    trunk = {k: v for k, v in lm.state_dict().items() if not k.startswith("head.")}
    missing, unexpected = model.load_state_dict(trunk, strict=False)
    assert not unexpected and all(k.startswith("head.") for k in missing)  # a fresh head
    del lm, opt, sched
    total = n_ckpt * every

    def optimizer(model: nn.Module) -> tuple[Any, Any]:
        opt = adamw(model, groups, 0.01, lr=5e-5)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(every, total))

    def train(
        model: nn.Module, opt: Any, sched: Any, g: torch.Generator, first: int, res: RunResult
    ) -> None:
        model.train()
        for step in range(first, total + 1):
            idx = torch.randint(0, xs.shape[0], (size.batch,), generator=g)
            logits = model.head(model.trunk(xs[idx]).mean(1))
            loss = F.cross_entropy(logits, ys[idx])
            res.losses.append(_step(model, opt, sched, loss))
            if step % every == 0:
                res.checkpoints.append((step, _snapshot(_state(model, opt, sched, step))))
                res.gens.append(g.get_state())
                log(f"    finetune step {step:4d} loss {sum(res.losses[-every:]) / every:.3f}")

    opt, sched = optimizer(model)
    res = RunResult("finetune-fp32" + "-2g" * groups, n_params(model), [], [])
    res.names = param_names(model, opt)
    train(model, opt, sched, g, 1, res)
    held: list[tuple[torch.Tensor, torch.Tensor]] = []

    def fresh() -> nn.Module:
        return Transformer(big, causal=False, out=classes, dropout=0.1)

    def evaluate(state: State) -> float:
        if not held:  # unseen sequences of the same 4 chains
            for c in range(classes):
                x = zipf_chain(domain[c * band : (c + 2) * band], 31 + c)(128, size.seq, 51 + c)
                held.append((x, torch.full((128,), c)))
        model = fresh()
        model.load_state_dict(state["model"])
        return _held_out_loss(model, held)

    def resume(state: State, gen: torch.Tensor) -> State:
        model = fresh()
        opt, sched = optimizer(model)
        _load(model, opt, sched, state)
        g = torch.Generator()
        g.set_state(gen)
        out = RunResult(res.name, res.params, [], [])
        train(model, opt, sched, g, state["step"] + 1, out)
        return _state(model, opt, sched, total)

    res.evaluate, res.resume = evaluate, resume
    return res


def _state(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    step: int,
) -> State:
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": torch.get_rng_state(),
        "step": step,
    }


RUNS: dict[str, Callable[[Size, int, int, Callable[[str], None]], RunResult]] = {
    "gpt-scratch-fp32": run_gpt_fp32,
    "gpt-scratch-bf16": run_gpt_bf16,
    "finetune-fp32": run_finetune,
}
