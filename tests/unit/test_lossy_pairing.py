"""Pairing fp32 weights with their Adam moments (issue 30, docs/lossy.md#which-weights-pair):
one test per state layout, each asserting the exact pairs, and that what the state does not
prove (shuffled groups, same shapes, two mappings holding the names) is left exact, never
paired by chance.

The model: two same-shape hidden layers (order is no proof for them), a LayerNorm whose
parameters share their shape with the biases, BatchNorm statistics of that shape too, and
a frozen layer."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptstore.state import dtype_to_wire, flatten, param_names
from ckptstore_core.errors import InvalidRequest
from ckptstore_core.lossy import Pair, Pairing, ParamNames, pairing


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.h1 = nn.Linear(16, 16)
        self.h2 = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)
        self.norm = nn.LayerNorm(16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.bn(self.h2(self.h1(self.inp(x)).relu()).relu()))
        return self.out(self.frozen(x))


TRAINED = [n for n in dict(_Net().named_parameters()) if not n.startswith("frozen.")]
FROZEN = ["frozen.weight", "frozen.bias"]
UNIQUE = ["inp.weight", "out.weight", "out.bias"]  # the only weights of their shapes


def _model() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()


def _two_groups(model: nn.Module, named: bool = False) -> list[dict[str, Any]]:
    """Hugging Face's Trainer / nanoGPT: no-decay for biases and norms, decay for matrices;
    the no-decay group first, so the ids follow neither the model's order nor its shapes."""
    decay = [(n, p) for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [(n, p) for n, p in model.named_parameters() if p.dim() < 2]
    if not named:
        decay = [p for _, p in decay]  # type: ignore[misc]
        no_decay = [p for _, p in no_decay]  # type: ignore[misc]
    return [
        {"params": no_decay, "weight_decay": 0.0},
        {"params": decay, "weight_decay": 0.1},
    ]


def _pairing(state: object, names: str | None = None) -> Pairing:
    flat = flatten(state)
    table = [(n, dtype_to_wire(t.dtype), tuple(t.shape)) for n, t in flat.tensors]
    return pairing(table, json.loads(flat.skeleton), names)


def _ids(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """The integer id ``opt.state_dict()`` gives each parameter in it (by name), by
    identity."""
    order = [id(p) for g in opt.param_groups for p in g["params"]]
    return {n: order.index(id(p)) for n, p in model.named_parameters() if id(p) in order}


def _expected(
    wprefix: str, key: Any, with_moments: Sequence[str], without: Sequence[str] = ()
) -> list[Pair]:
    """The pairs, in the state's order of the weights (``key(name)``: the optimizer's state
    path of the parameter ``name``)."""
    out = []
    for name in dict(_Net().named_parameters()):
        if name in with_moments:
            k = key(name)
            out.append(Pair(f"{wprefix}{name}", f"{k}/exp_avg", f"{k}/exp_avg_sq"))
        elif name in without:
            out.append(Pair(f"{wprefix}{name}", None, None))
    return out


def _check(p: Pairing, expected: list[Pair], wprefix: str) -> None:
    assert sorted(p.pairs, key=str) == sorted(expected, key=str)  # the HF files sort keys
    weights = [f"{wprefix}{n}" for n in dict(_Net().named_parameters())]
    # every weight is paired or left exact; buffers are neither
    assert sorted([x.weight for x in p.pairs] + p.exact) == sorted(weights)
    s = p.summary()
    assert s["with_moments"] == sum(x.exp_avg is not None for x in expected)
    assert s["without_moments"] == sum(x.exp_avg is None for x in expected)
    assert s["exact"] == len(weights) - len(expected)


# -- plain state dicts, integer ids ----------------------------------------------------


def test_one_group_pairs_unique_shapes_or_what_the_caller_names() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    ids = _ids(model, opt)

    def key(n: str) -> str:
        return f"optimizer/state/{ids[n]}"

    # alone, order is no proof: the same-shape layers and vectors stay exact
    p = _pairing(state)
    _check(p, _expected("model/", key, UNIQUE), "model/")
    assert "integer ids without param_names, 1 param group" in p.layout
    # the caller's names: every weight, frozen ones without moments
    p = _pairing(state, param_names(model, opt))
    _check(p, _expected("model/", key, TRAINED, FROZEN), "model/")
    assert "named by the caller" in p.layout


def test_two_groups_decay_no_decay() -> None:
    """The issue's layout: pairing by order failed its shape check and fell back."""
    model = _model()
    opt = torch.optim.AdamW(_two_groups(model), lr=1e-3)
    _train(model, opt)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    ids = _ids(model, opt)
    assert ids["inp.bias"] == 0 and ids["inp.weight"] > ids["out.bias"]  # not model order

    def key(n: str) -> str:
        return f"optimizer/state/{ids[n]}"

    _check(_pairing(state), _expected("model/", key, UNIQUE), "model/")
    p = _pairing(state, param_names(model, opt))
    _check(p, _expected("model/", key, TRAINED, FROZEN), "model/")
    assert p.pairs[0] == Pair(
        "model/inp.weight", key("inp.weight") + "/exp_avg", key("inp.weight") + "/exp_avg_sq"
    )


def test_param_names_recorded_by_torch() -> None:
    """An optimizer built from ``named_parameters()``: torch records ``param_names`` in
    ``param_groups``; the state alone then proves every pair, frozen ones included (they are
    in a group, without state)."""
    model = _model()
    opt = torch.optim.AdamW(_two_groups(model, named=True), lr=1e-3)
    _train(model, opt)
    assert "param_names" in opt.state_dict()["param_groups"][0]
    ids = _ids(model, opt)
    p = _pairing({"model": model.state_dict(), "optimizer": opt.state_dict()})

    def key(n: str) -> str:
        return f"optimizer/state/{ids[n]}"

    _check(p, _expected("model/", key, TRAINED, FROZEN), "model/")
    assert "integer ids with param_names, 2 param groups" in p.layout


def test_groups_per_layer_in_reverse_and_frozen_left_out() -> None:
    """One group per layer, the last layer first (layer-wise learning rates), the frozen
    layer in no group at all: the same-shape layers swap ids."""
    model = _model()
    layers = [model.out, model.norm, model.bn, model.h2, model.h1, model.inp]
    opt = torch.optim.Adam([{"params": list(m.parameters())} for m in layers])
    _train(model, opt)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    ids = _ids(model, opt)
    assert not any(n.startswith("frozen.") for n in ids)

    def key(n: str) -> str:
        return f"optimizer/state/{ids[n]}"

    _check(_pairing(state), _expected("model/", key, UNIQUE), "model/")
    p = _pairing(state, param_names(model, opt))
    _check(p, _expected("model/", key, TRAINED, FROZEN), "model/")
    h1 = {x.weight: x for x in p.pairs}["model/h1.weight"]
    assert h1.exp_avg == f"optimizer/state/{ids['h1.weight']}/exp_avg"
    assert ids["h1.weight"] > ids["h2.weight"]  # the swap order alone would have missed


def test_shuffled_same_shapes_pair_nothing_unproven() -> None:
    """A single group in reverse: every same-shape weight would pair with another layer's
    moments by order. Unique shapes alone pair, whatever the order."""
    model = _model()
    opt = torch.optim.AdamW(list(reversed(list(model.parameters()))))
    _train(model, opt)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    ids = _ids(model, opt)
    p = _pairing(state)
    _check(p, _expected("model/", lambda n: f"optimizer/state/{ids[n]}", UNIQUE), "model/")
    assert "model/h1.weight" in p.exact and "model/h2.weight" in p.exact


def test_ambiguous_caller_names_and_states_pair_nothing_unproven() -> None:
    model = _model()
    opt = torch.optim.AdamW(_two_groups(model, named=True), lr=1e-3)
    _train(model, opt)
    osd = opt.state_dict()
    # an EMA copy holds the same names: which one the moments belong to is not proven
    ema = {k: v.clone() for k, v in model.state_dict().items()}
    p = _pairing({"model": model.state_dict(), "ema": ema, "optimizer": osd})
    assert p.pairs == []
    assert len(p.exact) == 2 * len(dict(model.named_parameters()))
    assert p.paired_nothing
    # two optimizers whose groups both fit the caller's names: applied to neither
    plain = torch.optim.AdamW(_two_groups(model))
    _train(model, plain)
    twice = {"model": model.state_dict(), "a": plain.state_dict(), "b": plain.state_dict()}
    p = _pairing(twice, param_names(model, plain))
    assert not any(x.exp_avg is not None for x in p.pairs)  # claimed twice, or unnamed
    # a name map that lies (two matrices of other shapes swapped): never paired
    told = ParamNames.from_json(param_names(model, plain) or "")
    groups = [list(g) for g in told.optimizers[0]]
    decay = groups[1]
    i, j = decay.index("inp.weight"), decay.index("out.weight")
    decay[i], decay[j] = decay[j], decay[i]
    lying = ParamNames((tuple(tuple(g) for g in groups),), told.params)
    state = {"model": model.state_dict(), "optimizer": plain.state_dict()}
    p = _pairing(state, json.dumps(lying.to_json()))
    assert {"model/inp.weight", "model/out.weight"} <= set(p.exact)
    assert len([x for x in p.pairs if x.exp_avg is not None]) == len(TRAINED) - 2


def test_param_names_json_is_checked() -> None:
    for bad in ("[]", "{", '{"optimizers": [[["a", 1]]]}', '{"params": "a"}', '{"x": []}'):
        with pytest.raises(InvalidRequest):
            ParamNames.from_json(bad)
    names = ParamNames(((("a", None), ("b",)),), ("a", "b"))
    assert ParamNames.from_json(json.dumps(names.to_json())) == names


# -- other layouts -----------------------------------------------------------------------


def test_fqn_keyed_dcp_state() -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _model()
    opt = torch.optim.AdamW(_two_groups(model), lr=1e-3)
    _train(model, opt)
    msd, osd = get_state_dict(model, opt)
    p = _pairing({"model": msd, "optim": osd})
    # frozen parameters are in no group here (DCP lists those with state and those in groups)
    groups = {n for g in osd["param_groups"] for n in g["params"]}
    without = [n for n in FROZEN if n in groups]
    _check(p, _expected("model/", lambda n: f"optim/state/{n}", TRAINED, without), "model/")
    assert "FQN keys, 2 param groups" in p.layout


def test_lightning_checkpoint() -> None:
    """``state_dict`` + ``optimizer_states`` (Lightning's keys), the optimizer built from
    ``named_parameters()`` (``param_names``), or named by the caller."""
    model = _model()
    for named in (True, False):
        opt = torch.optim.AdamW(_two_groups(model, named=named), lr=1e-3)
        _train(model, opt)
        ckpt = {
            "epoch": 0,
            "global_step": 2,
            "state_dict": model.state_dict(),
            "optimizer_states": [opt.state_dict()],
            "lr_schedulers": [],
        }
        ids = _ids(model, opt)
        names = None if named else param_names(model, opt)
        p = _pairing(ckpt, names)

        def key(n: str, ids: dict[str, int] = ids) -> str:
            return f"optimizer_states/0/state/{ids[n]}"

        _check(p, _expected("state_dict/", key, TRAINED, FROZEN), "state_dict/")
        if not named:
            _check(_pairing(ckpt), _expected("state_dict/", key, UNIQUE), "state_dict/")


def test_hf_callback_checkpoint(tmp_path: Path) -> None:
    """The Hugging Face callback's state: the folder's ``model.safetensors`` and
    ``optimizer.pt`` read as the callback reads them; the Trainer's two groups, named by the
    callback from the live model and optimizer."""
    from safetensors.torch import save_file

    from ckptstore.integrations.transformers import read_checkpoint_folder

    model = _model()
    opt = torch.optim.AdamW(_two_groups(model), lr=1e-3)
    _train(model, opt)
    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    save_file(model.state_dict(), str(folder / "model.safetensors"))
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    state = read_checkpoint_folder(folder, 2)
    ids = _ids(model, opt)

    def key(n: str) -> str:
        return f"files/optimizer.pt/state/state/{ids[n]}"

    prefix = "files/model.safetensors/tensors/"
    _check(
        _pairing(state, param_names(model, opt)), _expected(prefix, key, TRAINED, FROZEN), prefix
    )
    _check(_pairing(state), _expected(prefix, key, UNIQUE), prefix)


def _local(x: object) -> object:
    """A rank's own shards of a sharded state (DTensors to their local tensors)."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        return x.to_local()
    if isinstance(x, dict):
        return {k: _local(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_local(v) for v in x]
    return x


@pytest.fixture
def process_group(tmp_path: Path) -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("process_group")
def test_fsdp2_shards() -> None:
    """A rank's shards of an FSDP2 model and its optimizer: FQN-keyed
    (``get_state_dict``) they pair by name; integer-keyed, by what the caller names."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model)
    opt = torch.optim.AdamW(_two_groups(model), lr=1e-3)
    _train(model, opt)
    msd, osd = get_state_dict(model, opt)
    p = _pairing(_local({"model": msd, "optim": osd}))
    groups = {n for g in osd["param_groups"] for n in g["params"]}
    without = [n for n in FROZEN if n in groups]
    _check(p, _expected("model/", lambda n: f"optim/state/{n}", TRAINED, without), "model/")
    ids = _ids(model, opt)
    state = _local({"model": model.state_dict(), "optimizer": opt.state_dict()})
    p = _pairing(state, param_names(model, opt))
    _check(p, _expected("model/", lambda n: f"optimizer/state/{ids[n]}", TRAINED, FROZEN), "model/")


def test_without_optimizer_weights_only() -> None:
    model = _model()
    p = _pairing({"model": model.state_dict(), "half": torch.ones(3, dtype=torch.float16)})
    assert p.pairs == [Pair(f"model/{n}", None, None) for n in dict(model.named_parameters())]
    assert p.exact == [] and not p.paired_nothing
    assert p.layout == "no optimizer (weights only)"


def test_the_callers_live_parameters_settle_an_ema_copy() -> None:
    """Two mappings hold the model's names (the model and its EMA copy): the caller's live
    parameters, which ``model.state_dict()`` views, say which one is the model."""
    model = _model()
    opt = torch.optim.AdamW(_two_groups(model), lr=1e-3)
    _train(model, opt)
    ema = {k: v.clone() for k, v in model.state_dict().items()}
    state = {"ema": ema, "model": model.state_dict(), "optimizer": opt.state_dict()}
    flat = flatten(state)
    table = [(n, dtype_to_wire(t.dtype), tuple(t.shape)) for n, t in flat.tensors]
    names = param_names(model, opt, flat)
    told = ParamNames.from_json(names or "")
    assert dict(told.tensors)["h1.weight"] == "model/h1.weight"
    p = pairing(table, json.loads(flat.skeleton), names)
    ids = _ids(model, opt)
    expected = _expected("model/", lambda n: f"optimizer/state/{ids[n]}", TRAINED, FROZEN)
    assert sorted(p.pairs, key=str) == sorted(expected, key=str)
    assert sorted(p.exact) == sorted(f"ema/{n}" for n in dict(model.named_parameters()))
    # a copy of the state is no live parameter: the names alone are ambiguous again
    copied = flatten(copy.deepcopy(state))
    names = param_names(model, opt, copied)
    assert ParamNames.from_json(names or "").tensors == ()
    p = pairing(table, json.loads(copied.skeleton), names)
    assert not any(x.exp_avg is not None for x in p.pairs)
