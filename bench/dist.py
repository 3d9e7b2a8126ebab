"""Distributed checkpoints: ckptstore's DCP writer and reader beside DCP's FileSystemWriter.

    .venv/bin/python bench/dist.py [--quick] [--out bench/out_dist] [--s3]

One fine-tune-like training run (bench/models.py's BERT-like encoder with a tokenizer-sized
vocabulary: pretrained, unmeasured, in a child process; then fine-tuned with a fresh AdamW
at lr 5e-5, so the weights change slowly, as in real fine-tuning) is repeated with N = 1, 2
and 4 ranks (forked processes, gloo on CPU, one torch thread each; FSDP2 ``fully_shard`` on
each block and the root when N > 1, a plain module when N = 1). Every rank takes its slice
of the same global batch, so all world sizes train the same run (up to the order of float
sums). Every ``--every`` optimizer steps the loop stops, takes its sharded state
(``get_state_dict``: model + AdamW state, plus the LR scheduler's state as a non-tensor item)
and saves that same state, one store after the other, each once with ``dcp.save`` and once
with ``dcp.async_save`` (thread executor, on a gloo group of its own, its future waited for
before the next save, so no two saves overlap):

ckptstore, 1 replica
    ``CkptStoreWriter`` to one service (a child process: SQLite + a local blob folder,
    default settings).
ckptstore, 2 replicas
    two service processes sharing one fresh PostgreSQL database and one blob folder
    (``--s3``: a moto S3 server instead); rank r talks to replica r % 2; rank 0 commits.
FileSystemWriter+zstd
    DCP's ``FileSystemWriter(folder, _extensions=[ZStandard()])`` (its defaults otherwise:
    one file per rank, one writer thread, fsync), a fresh folder per checkpoint.
ckptstore save_async (N = 1 only)
    ``CheckpointClient.save_async`` of the same state to the 1-replica service: ckptstore's
    own non-blocking save (staging into reused buffers), not DCP.

Measured per save, on every rank, between two barriers: ``dcp.save``'s wall time (all of
it stalls training) and ``dcp.async_save``'s time until it returns (the stall; the staging
copy is in it) and until its future is done. The figure kept is the slowest rank's, the
one the next training step waits for. Baseline, at each checkpoint: the full state gathered
on rank 0 (unmeasured), then ``torch.save`` into memory + one-thread zstd level 3 of it,
timed (best of 2) while the other ranks wait at a barrier.

Stored bytes per checkpoint: ckptstore's listing (``stored_bytes``, summed over the parts;
the blob folder is checked against it); FileSystemWriter: the bytes of the checkpoint's
folder on disk (``.metadata`` included).

Loads: after the saves, M ranks (M != N: 4 -> 2, 2 -> 1, 1 -> 4) build a fresh model and
optimizer, overwrite every tensor of their state with NaN, and ``dcp.load`` the latest
checkpoint of the N-rank run (ckptstore: ``CkptStoreReader(..., "latest")`` through each
replica setup; FileSystemReader: the last checkpoint's folder), timed between barriers
(slowest rank; ``--repeats`` rounds over all stores, the best of each kept). After the
last round's load the gathered full state is compared bit for bit with the one gathered
when it was saved. Both stores read warm files: the blob folder and the checkpoint
folders were just written (page cache).

Figures: medians over the checkpoints after the first (the first is ckptstore's keyframe
and the first time staging buffers are allocated); stored bytes as the mean over all
checkpoints, keyframe included. Targets (issue 19), PASS/FAIL with figures:
(1) the stall of ``dcp.async_save`` with ``CkptStoreWriter`` <= 0.1x the synchronous
torch.save + zstd-3 time of the same (full) state; (2) ckptstore's bytes per checkpoint at
least 1.3x fewer than FileSystemWriter+zstd's; (3) a resharded load of ``latest`` at least
as fast as FileSystemReader's of the same checkpoint.

Output: the tables, the targets, bench/out_dist/results.json (every figure per checkpoint
and per rank, machine info, load averages). Never fails on a missed target (exit status 0).
About 5-7 minutes on two loaded cores; ``--quick`` (a smaller model, 3 checkpoints, loads
4 -> 2 and 2 -> 1) about 1.5-2 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import zstandard  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter  # noqa: E402
from torch.distributed.checkpoint._extension import ZStandard  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import (  # noqa: E402
    AsyncCheckpointerType,
    AsyncSaveResponse,
)
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import models  # noqa: E402
from bench import dir_bytes, machine_info, mismatch, proc_cpu_s  # noqa: E402
from ckptstore import CheckpointClient  # noqa: E402
from ckptstore.dcp import CkptStoreReader, CkptStoreWriter  # noqa: E402
from support.serviceproc import Service, free_port  # noqa: E402

MB = 1e6
CKPT1 = "ckptstore, 1 replica"
CKPT2 = "ckptstore, 2 replicas"
FSW = "FileSystemWriter+zstd"
STORES = [CKPT1, CKPT2, FSW]
STORE_KEYS = {CKPT1: "ckpt1", CKPT2: "ckpt2", FSW: "fsw"}
CLIENT = "ckptstore save_async"  # CheckpointClient.save_async, one process (N = 1)
CLIENT_KEY = "client-async"
CLIENT_OPTIONS = {"timeout": 600}

_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


@dataclass(frozen=True)
class Config:
    """What every rank of a phase needs (plain values: forked ranks get a copy)."""

    scratch: str
    size: dict[str, Any]
    checkpoints: int
    every: int
    repeats: int
    urls: dict[str, list[str]]  # store -> replica URLs (ckptstore stores only)
    loads: list[tuple[int, int]]  # (saved with N, loaded by M)


# -- the training run ---------------------------------------------------------------------


class FineTune(models.Transformer):
    """bench/models.py's encoder with its classification forward (mean-pooled trunk -> head)
    as ``forward``, so FSDP2's root hooks see the whole step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(x).mean(1))


def finetune_data(size: models.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """The fine-tuning task of models.run_finetune (4 classes of Zipfian chains over bands
    of the domain's tokens), built the same way from the same seeds."""
    vocab = size.encoder_vocab
    ranks = torch.randperm(vocab, generator=torch.Generator().manual_seed(20))
    domain = ranks[: vocab // 3]
    classes, per = 4, 1024
    band = len(domain) // classes
    seqs = [
        models.zipf_chain(domain[c * band : (c + 2) * band], 31 + c)(per, size.seq, 41 + c)
        for c in range(classes)
    ]
    return torch.cat(seqs), torch.arange(classes).repeat_interleave(per)


def pretrain(rank: int, world: int, port: int, cfg: Config) -> None:
    """In a child process (the parent stays free of OpenMP threads before it forks ranks):
    models.run_finetune's pretraining plus one fine-tuning step, then the fine-tuning data;
    both to scratch/pretrained.pt (bench scratch only)."""
    # one thread: on a loaded 2-core host OpenMP's spinning threads made it 4x slower
    torch.set_num_threads(1)
    size = models.Size(**cfg.size)
    res = models.run_finetune(size, 1, 1, lambda m: log("  " + m.strip()))
    xs, ys = finetune_data(size)
    torch.save(
        {"model": res.checkpoints[0][1]["model"], "xs": xs, "ys": ys, "params": res.params},
        Path(cfg.scratch) / "pretrained.pt",
    )


def init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.pop("OMP_NUM_THREADS", None)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )


def build(cfg: Config, world: int, total_steps: int, weights: dict[str, Any] | None) -> Any:
    """The encoder (pretrained weights, or left random for a load's target), sharded with
    FSDP2 when ``world > 1``, AdamW (lr 5e-5, BERT's fine-tuning rate) and warmup + cosine."""
    size = models.Size(**cfg.size)
    model = FineTune(replace(size, vocab=size.encoder_vocab), causal=False, out=4, dropout=0.1)
    if weights is not None:
        model.load_state_dict(weights)
    if world > 1:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, models.warmup_cosine(cfg.every, max(total_steps, 1))
    )
    return model, opt, sched


def train_step(
    model: Any, opt: Any, sched: Any, data: tuple[torch.Tensor, torch.Tensor], g: torch.Generator
) -> float:
    """One step on this rank's slice of the global batch (the same on every world size)."""
    xs, ys = data
    batch = int(os.environ["DIST_BENCH_BATCH"])
    world, rank = dist.get_world_size(), dist.get_rank()
    idx = torch.randint(0, xs.shape[0], (batch,), generator=g)
    mine = idx[rank * batch // world : (rank + 1) * batch // world]
    loss = F.cross_entropy(model(xs[mine]), ys[mine])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return float(loss.item())


def sharded(model: Any, opt: Any, sched: Any) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "sched": sched.state_dict()}


def gathered(model: Any, opt: Any, sched: Any) -> dict[str, Any]:
    """The full state, complete on rank 0 (a copy: training goes on in place)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=options)
    full = {"model": msd, "optim": osd, "sched": sched.state_dict()}
    return copy.deepcopy(full) if dist.get_rank() == 0 else {}


def local_bytes(state: Any) -> int:
    """Tensor bytes this rank holds in ``state`` (its shards, and replicated tensors)."""
    if isinstance(state, DTensor):
        local = state.to_local()
        return local.numel() * local.element_size()
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(local_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(local_bytes(v) for v in state)
    return 0


def poison(state: Any) -> None:
    """Every tensor of ``state`` (local shards of DTensors too) filled with NaN, integer
    tensors with -1: a load must overwrite all of it."""
    if isinstance(state, DTensor):
        poison(state.to_local())
    elif isinstance(state, torch.Tensor):
        with torch.no_grad():
            state.fill_(float("nan") if state.is_floating_point() else -1)
    elif isinstance(state, dict):
        for v in state.values():
            poison(v)
    elif isinstance(state, list | tuple):
        for v in state:
            poison(v)


def slowest(value: float) -> list[float]:
    """Every rank's ``value``, in rank order."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def torch_save_zstd3(state: Any, repeats: int = 2) -> tuple[float, int]:
    """The best wall time of ``repeats`` torch.save into memory + one-thread zstd-3 of
    ``state`` (other work on a shared host makes single timings scatter), and its size."""
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf = io.BytesIO()
        torch.save(state, buf)
        size = len(zstandard.ZstdCompressor(level=3).compress(buf.getbuffer()))
        best = min(best, time.perf_counter() - t0)
        del buf
    return best, size


# -- the ranks ----------------------------------------------------------------------------


def run_name(n: int, mode: str) -> str:
    return f"n{n}-{mode}"


def fsw_folder(cfg: Config, n: int, mode: str, step: int) -> Path:
    return Path(cfg.scratch) / "fsw" / f"n{n}-{mode}" / f"step-{step}"


def save_ranks(rank: int, world: int, port: int, cfg: Config) -> None:
    """Train ``cfg.checkpoints`` x ``cfg.every`` steps; at each checkpoint, the baseline and
    every store's dcp.save and dcp.async_save of the same state; figures to
    scratch/save-{world}-{rank}.json, rank 0's full state of the last checkpoint to
    scratch/full-{world}.pt."""
    init(rank, world, port)
    scratch = Path(cfg.scratch)
    pre = torch.load(scratch / "pretrained.pt", weights_only=True)
    torch.manual_seed(100 + rank)  # dropout
    total = cfg.checkpoints * cfg.every
    model, opt, sched = build(cfg, world, total, pre["model"])
    data = (pre["xs"], pre["ys"])
    g = torch.Generator().manual_seed(23)
    group = dist.new_group(backend="gloo")  # async saves' collectives, apart from training's
    # the async saves stage in the writer's thread (async_staging): async_save returns at
    # once and the copy runs beside the next step's forward and backward passes
    writers = {
        (store, mode): CkptStoreWriter(
            urls[rank % len(urls)],
            run_name(world, mode),
            async_staging=mode == "async",
            **CLIENT_OPTIONS,
        )
        for store, urls in cfg.urls.items()
        for mode in ("sync", "async")
    }
    # one process: ckptstore's own non-blocking save of the same state, beside DCP's
    client = (
        CheckpointClient(cfg.urls[CKPT1][0], **CLIENT_OPTIONS)
        if world == 1 and CKPT1 in cfg.urls
        else None
    )
    out: dict[str, Any] = {"rank": rank, "checkpoints": [], "errors": {}, "train_s": 0.0}
    losses: list[float] = []
    for k in range(1, cfg.checkpoints + 1):
        t0 = time.perf_counter()
        for _ in range(cfg.every):
            losses.append(train_step(model, opt, sched, data, g))
        out["train_s"] += time.perf_counter() - t0
        step = k * cfg.every
        state = sharded(model, opt, sched)
        full = gathered(model, opt, sched)
        row: dict[str, Any] = {"step": step, "local_bytes": local_bytes(state)}
        dist.barrier()
        if rank == 0:
            row["torch_save_zstd3_s"], row["torch_save_zstd3_bytes"] = torch_save_zstd3(full)
            row["full_bytes"] = local_bytes(full)
            if k == cfg.checkpoints:
                torch.save(full, scratch / f"full-{world}.pt")
        del full
        dist.barrier()
        for store in STORES:
            if store != FSW and store not in cfg.urls:
                continue
            for mode in ("sync", "async"):
                key = f"{STORE_KEYS[store]}-{mode}"
                if key in out["errors"]:
                    continue
                if store == FSW:
                    folder = fsw_folder(cfg, world, mode, step)
                    writer = FileSystemWriter(folder, _extensions=[ZStandard()])
                    checkpoint_id: Any = folder
                else:
                    writer, checkpoint_id = writers[store, mode], step
                dist.barrier()
                try:
                    t0 = time.perf_counter()
                    if mode == "sync":
                        dcp.save(state, storage_writer=writer, checkpoint_id=checkpoint_id)
                        row[key] = {"stall_s": time.perf_counter() - t0}
                        row[key]["done_s"] = row[key]["stall_s"]
                    else:
                        future = dcp.async_save(
                            state,
                            storage_writer=writer,
                            checkpoint_id=checkpoint_id,
                            process_group=group,
                            async_checkpointer_type=AsyncCheckpointerType.THREAD,
                        )
                        row[key] = {"stall_s": time.perf_counter() - t0}
                        if isinstance(future, AsyncSaveResponse):  # staged in a thread
                            future.staging_completion.result()
                            row[key]["staged_s"] = time.perf_counter() - t0
                            future = future.upload_completion
                        future.result()
                        row[key]["done_s"] = time.perf_counter() - t0
                except Exception:
                    out["errors"][key] = traceback.format_exc(limit=6)
                    log(f"rank {rank}: {store} {mode} failed at step {step}:\n{out['errors'][key]}")
        if client is not None and CLIENT_KEY not in out["errors"]:
            try:
                t0 = time.perf_counter()
                pending = client.save_async(run_name(world, "client"), step, state)
                row[CLIENT_KEY] = {"stall_s": time.perf_counter() - t0}
                pending.result()
                row[CLIENT_KEY]["done_s"] = time.perf_counter() - t0
            except Exception:
                out["errors"][CLIENT_KEY] = traceback.format_exc(limit=6)
                log(f"save_async failed at step {step}:\n{out['errors'][CLIENT_KEY]}")
        out["checkpoints"].append(row)
        if rank == 0:
            loss = statistics.mean(losses[-cfg.every :])
            log(f"  N={world}: checkpoint {k} (step {step}) loss {loss:.4f}")
    out["losses"] = losses
    if client is not None:
        client.close()
    Path(scratch, f"save-{world}-{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def load_ranks(rank: int, world: int, port: int, cfg: Config, sources: list[int]) -> None:
    """For each N in ``sources`` and each store: dcp.load the latest checkpoint of the
    N-rank sync run into ``world`` ranks, timed, ``cfg.repeats`` rounds over all of them
    (so a busy spell on the host hits every store); after the last round's load, the
    gathered state is compared with the one saved (rank 0). Figures to
    scratch/load-{world}-{rank}.json."""
    init(rank, world, port)
    scratch = Path(cfg.scratch)
    torch.manual_seed(1234)
    model, opt, sched = build(cfg, world, cfg.checkpoints * cfg.every, None)
    last = cfg.checkpoints * cfg.every
    stores = [store for store in STORES if store == FSW or store in cfg.urls]
    expected = {
        n: torch.load(scratch / f"full-{n}.pt", weights_only=False) if rank == 0 else None
        for n in sources
    }
    entries = {
        (n, store): {"n": n, "m": world, "store": store, "times": []}
        for n in sources
        for store in stores
    }
    for round_ in range(cfg.repeats):
        for (n, store), entry in entries.items():
            if "error" in entry:
                continue
            try:
                state = sharded(model, opt, sched)
                poison(state)
                if store == FSW:
                    reader: Any = FileSystemReader(fsw_folder(cfg, n, "sync", last))
                else:
                    urls = cfg.urls[store]
                    reader = CkptStoreReader(
                        urls[rank % len(urls)], run_name(n, "sync"), "latest", **CLIENT_OPTIONS
                    )
                dist.barrier()
                t0 = time.perf_counter()
                dcp.load(state, storage_reader=reader)
                dist.barrier()
                entry["times"].append(time.perf_counter() - t0)
                if isinstance(reader, CkptStoreReader):
                    entry["bytes_read"] = reader.bytes_read
                    entry["served_step"] = reader.served_step
                if round_ < cfg.repeats - 1:
                    continue
                set_state_dict(
                    model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
                )
                sched.load_state_dict(state["sched"])
                full = gathered(model, opt, sched)
                if rank == 0:
                    entry["verified"] = mismatch(expected[n], full) or "bit-exact"
                    entry["raw_bytes"] = local_bytes(full)
                del full
                entry["local_bytes"] = local_bytes(state)
                if rank == 0:
                    log(
                        f"  load {n} -> {world} ranks, {store}: best {min(entry['times']):.3f} s,"
                        f" {entry['verified']}"
                    )
            except Exception:
                entry["error"] = traceback.format_exc(limit=6)
                log(f"rank {rank}: load {n} -> {world} {store} failed:\n{entry['error']}")
    out = {"rank": rank, "loads": list(entries.values())}
    Path(scratch, f"load-{world}-{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def spawn(fn: Any, world: int, *args: Any) -> Any:
    """Fork ``world`` ranks of ``fn(rank, world, port, *args)``; their process context."""
    port = free_port()
    return mp.start_processes(
        fn, args=(world, port, *args), nprocs=world, start_method="fork", join=False
    )


def finish(ctx: Any, timeout: float = 900) -> str | None:
    """Wait for the ranks of ``ctx``: None, or why they failed (a rank's error, or the
    deadline: then every rank is killed)."""
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                kill(ctx)
                return f"timed out after {timeout:.0f} s"
    except Exception as exc:  # a rank raised or died: join stopped the others
        return f"{type(exc).__name__}: {exc}"
    return None


def kill(ctx: Any) -> None:
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
            p.join()


def launch(fn: Any, world: int, *args: Any, timeout: float = 900) -> str | None:
    return finish(spawn(fn, world, *args), timeout)


# -- services -----------------------------------------------------------------------------


class Stores(contextlib.ExitStack):
    """The service processes: one replica (SQLite + folder), two replicas (PostgreSQL + a
    shared folder, or moto S3 with ``s3``)."""

    def __init__(self, scratch: Path, s3: bool) -> None:
        super().__init__()
        self.scratch, self.s3 = scratch, s3
        self.services: dict[str, list[Service]] = {}
        self.notes: dict[str, str] = {}

    def start(self) -> Stores:
        """Start every service at once (each imports the app for seconds on a loaded host)."""
        one = Service(self.scratch / "svc1")
        self.services[CKPT1] = [one]
        self.notes[CKPT1] = "SQLite + local blob folder"
        try:
            from support.pg import pg_database

            url = self.enter_context(pg_database())
        except BaseException as exc:  # pytest.skip's Skipped is a BaseException
            if isinstance(exc, KeyboardInterrupt):
                raise
            self.notes[CKPT2] = f"skipped: no PostgreSQL ({exc})"
            log(f"2 replicas {self.notes[CKPT2]}")
            url = None
        if url is not None:
            env = {"CKPTSTORE_DATABASE_URL": url}
            if self.s3:
                from support.s3server import fake_aws_credentials, start_moto

                self.enter_context(fake_aws_credentials())
                endpoint, stop = start_moto()
                self.callback(stop)
                env |= {
                    "CKPTSTORE_BLOB_URL": "s3://ckpt-dist-bench/blobs",
                    "CKPTSTORE_S3_ENDPOINT_URL": endpoint,
                    "CKPTSTORE_S3_PATH_STYLE": "true",
                    "CKPTSTORE_S3_CREATE_BUCKET": "true",
                    "CKPTSTORE_S3_REGION": "us-east-1",
                }
                self.notes[CKPT2] = "PostgreSQL + moto S3"
            else:
                env["CKPTSTORE_BLOB_URL"] = (self.scratch / "blobs2").resolve().as_uri()
                self.notes[CKPT2] = "PostgreSQL + one shared blob folder"
            self.services[CKPT2] = [Service(self.scratch / n, env) for n in ("svc2a", "svc2b")]
        every = [svc for svcs in self.services.values() for svc in svcs]
        for svc in every:
            self.callback(svc.stop)
        with ThreadPoolExecutor(len(every)) as pool:
            list(pool.map(lambda svc: svc.start(60), every))
        return self

    def urls(self) -> dict[str, list[str]]:
        return {store: [s.url for s in svcs] for store, svcs in self.services.items()}

    def cpu_s(self) -> dict[str, float]:
        return {
            store: sum(proc_cpu_s(s.pid) for s in svcs) for store, svcs in self.services.items()
        }


# -- the parent: phases, figures, report --------------------------------------------------


def median_after_first(values: list[float]) -> float:
    return statistics.median(values[1:] or values)


def collect_saves(
    cfg: Config, n: int, stores: Stores, cpu_before: dict[str, float]
) -> dict[str, Any]:
    """The figures of the N-rank saves: per store and mode, the slowest rank's stall and
    done time per checkpoint, stored bytes per checkpoint; the baseline."""
    scratch = Path(cfg.scratch)
    ranks = [json.loads((scratch / f"save-{n}-{r}.json").read_text()) for r in range(n)]
    rows0 = ranks[0]["checkpoints"]
    steps = [r["step"] for r in rows0]
    res: dict[str, Any] = {
        "steps": steps,
        "losses_rank0": ranks[0]["losses"],
        "train_s_rank0": ranks[0]["train_s"],
        "full_bytes": rows0[-1]["full_bytes"],
        "local_bytes_per_rank": [r["checkpoints"][-1]["local_bytes"] for r in ranks],
        "baseline": {
            "torch_save_zstd3_s": [r["torch_save_zstd3_s"] for r in rows0],
            "torch_save_zstd3_bytes": [r["torch_save_zstd3_bytes"] for r in rows0],
        },
        "errors": {k: v for r in ranks for k, v in r["errors"].items()},
        "service_cpu_s": {store: cpu - cpu_before[store] for store, cpu in stores.cpu_s().items()},
        "stores": {},
    }
    res["baseline"]["median_s"] = median_after_first(res["baseline"]["torch_save_zstd3_s"])
    for store in STORES:
        if store != FSW and store not in cfg.urls:
            continue
        entry: dict[str, Any] = {}
        for mode in ("sync", "async"):
            key = f"{STORE_KEYS[store]}-{mode}"
            if key in res["errors"] or any(
                key not in row for r in ranks for row in r["checkpoints"]
            ):
                entry[mode] = {"error": res["errors"].get(key, "missing figures")}
                continue
            per_rank = [[row[key] for row in r["checkpoints"]] for r in ranks]
            stall = [max(pr[i]["stall_s"] for pr in per_rank) for i in range(len(steps))]
            done = [max(pr[i]["done_s"] for pr in per_rank) for i in range(len(steps))]
            m: dict[str, Any] = {
                "stall_s": stall,
                "done_s": done,
                "staged_median_s": median_after_first(
                    [max(pr[i].get("staged_s", 0.0) for pr in per_rank) for i in range(len(steps))]
                ),
                "stall_s_by_rank": [[x["stall_s"] for x in pr] for pr in per_rank],
                "stall_median_s": median_after_first(stall),
                "done_median_s": median_after_first(done),
            }
            if store == FSW:
                m["stored_per_ckpt"] = [dir_bytes(fsw_folder(cfg, n, mode, step)) for step in steps]
            else:
                with CheckpointClient(cfg.urls[store][0], **CLIENT_OPTIONS) as client:
                    listing = client.list(run_name(n, mode))
                m["stored_per_ckpt"] = [c.stored_bytes for c in listing]
                m["raw_per_ckpt"] = [c.raw_bytes for c in listing]
                m["parts"] = [c.parts for c in listing]
                m["keyframes"] = [c.keyframe for c in listing]
                m["listed_steps"] = [c.step for c in listing]
            m["stored_mean"] = statistics.mean(m["stored_per_ckpt"])
            m["stored_mean_after_first"] = statistics.mean(
                m["stored_per_ckpt"][1:] or m["stored_per_ckpt"]
            )
            entry[mode] = m
        res["stores"][store] = entry
    if any(CLIENT_KEY in row for row in rows0) and CLIENT_KEY not in res["errors"]:
        with CheckpointClient(cfg.urls[CKPT1][0], **CLIENT_OPTIONS) as client:
            listing = client.list(run_name(n, "client"))
        stall = [row[CLIENT_KEY]["stall_s"] for row in rows0]
        done = [row[CLIENT_KEY]["done_s"] for row in rows0]
        stored = [c.stored_bytes for c in listing]
        res["client_async"] = {
            "stall_s": stall,
            "done_s": done,
            "stall_median_s": median_after_first(stall),
            "done_median_s": median_after_first(done),
            "stored_per_ckpt": stored,
            "stored_mean": statistics.mean(stored),
            "stored_mean_after_first": statistics.mean(stored[1:] or stored),
        }
    elif CLIENT_KEY in res["errors"]:
        res["client_async"] = {"error": res["errors"][CLIENT_KEY]}
    return res


def collect_loads(cfg: Config, m: int) -> list[dict[str, Any]]:
    scratch = Path(cfg.scratch)
    ranks = [json.loads((scratch / f"load-{m}-{r}.json").read_text()) for r in range(m)]
    out = []
    for i, entry in enumerate(ranks[0]["loads"]):
        entry = dict(entry)
        errors = [r["loads"][i].get("error") for r in ranks if r["loads"][i].get("error")]
        if errors:
            entry["error"] = errors[0]
        elif entry["times"]:
            entry["best_s"] = min(entry["times"])
            entry["bytes_read_by_rank"] = [r["loads"][i].get("bytes_read") for r in ranks]
        if entry["store"] in cfg.urls:  # how many deltas a load of latest decodes
            with CheckpointClient(cfg.urls[entry["store"]][0], **CLIENT_OPTIONS) as client:
                latest = client.list(run_name(entry["n"], "sync"))[-1]
            entry["chain_depth"], entry["keyframe"] = latest.chain_depth, latest.keyframe
        out.append(entry)
    return out


def blob_check(stores: Stores, saves: dict[int, Any]) -> dict[str, Any]:
    """Bytes in the blob folder(s) beside the sum of what the listings report."""
    out: dict[str, Any] = {}
    for store, svcs in stores.services.items():
        folder = svcs[0].data_dir / "blobs" if store == CKPT1 else stores.scratch / "blobs2"
        if store == CKPT2 and stores.s3:
            continue
        listed = sum(
            sum(r["stores"][store][mode].get("stored_per_ckpt", []))
            for r in saves.values()
            if store in r["stores"]
            for mode in ("sync", "async")
        )
        if store == CKPT1:  # the save_async run went there too
            listed += sum(
                sum(r.get("client_async", {}).get("stored_per_ckpt", [])) for r in saves.values()
            )
        out[store] = {"blob_dir_bytes": dir_bytes(folder), "listed_stored_bytes": listed}
    return out


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def check(name: str, ok: bool, figures: str) -> None:
        out.append({"target": name, "pass": bool(ok), "figures": figures})

    cfg = results["config"]
    for n, r in results["saves"].items():
        base = r["baseline"]["median_s"]
        step_s = r["train_s_rank0"] / (cfg["checkpoints"] * cfg["every"])
        for store in (CKPT1, CKPT2):
            a = r["stores"].get(store, {}).get("async")
            if not a or "error" in a:
                continue
            check(
                f"N={n}, {store}: dcp.async_save stall <= 0.1x torch.save+zstd3 of the state",
                a["stall_median_s"] <= 0.1 * base,
                f"{a['stall_median_s'] * 1e3:.1f} ms vs 0.1 x {base * 1e3:.0f} ms = "
                f"{0.1 * base * 1e3:.1f} ms ({a['stall_median_s'] / base:.3f}x)",
            )
            # the stall above holds only while the staging copy hides behind the next
            # forward/backward (the loop waits for it before optimizer.step())
            check(
                f"N={n}, {store}: the async save's staging copy ends within a training step",
                a["staged_median_s"] <= step_s,
                f"copied in {a['staged_median_s'] * 1e3:.1f} ms; a step (forward, backward, "
                f"update) takes {step_s * 1e3:.1f} ms on rank 0",
            )
        c = r.get("client_async")
        if c and "error" not in c:
            check(
                f"N={n}, {CLIENT} (CheckpointClient, not DCP): stall <= 0.1x "
                "torch.save+zstd3 of the state",
                c["stall_median_s"] <= 0.1 * base,
                f"{c['stall_median_s'] * 1e3:.1f} ms vs 0.1 x {base * 1e3:.0f} ms = "
                f"{0.1 * base * 1e3:.1f} ms ({c['stall_median_s'] / base:.3f}x)",
            )
    for n, r in results["saves"].items():
        f = r["stores"][FSW]["sync"]
        for store in (CKPT1, CKPT2):
            c = r["stores"].get(store, {}).get("sync")
            if not c or "error" in c or "error" in f:
                continue
            gain = f["stored_mean"] / c["stored_mean"]
            check(
                f"N={n}, {store}: bytes per checkpoint >= 1.3x fewer than FileSystemWriter+zstd",
                gain >= 1.3,
                f"{c['stored_mean'] / MB:.2f} MB vs {f['stored_mean'] / MB:.2f} MB per checkpoint "
                f"({gain:.2f}x fewer; after the first: {c['stored_mean_after_first'] / MB:.2f} vs "
                f"{f['stored_mean_after_first'] / MB:.2f} MB, "
                f"{f['stored_mean_after_first'] / c['stored_mean_after_first']:.2f}x)",
            )
    for entry in results["loads"]:
        if entry["store"] == FSW:
            continue
        fsw = next(
            (
                e
                for e in results["loads"]
                if e["store"] == FSW and e["n"] == entry["n"] and e["m"] == entry["m"]
            ),
            None,
        )
        if fsw is None or "best_s" not in fsw or "best_s" not in entry:
            continue
        exact = entry.get("verified") == "bit-exact"
        check(
            f"load latest {entry['n']} -> {entry['m']} ranks, {entry['store']}: "
            "as fast as FileSystemReader, bit-exact",
            entry["best_s"] <= fsw["best_s"] and exact,
            f"{entry['best_s']:.3f} s vs {fsw['best_s']:.3f} s "
            f"({fsw['best_s'] / entry['best_s']:.2f}x); {entry.get('verified')}",
        )
    return out


def report(results: dict[str, Any]) -> None:
    mi = results["machine"]
    cfg = results["config"]
    print()
    print(
        f"machine: {mi['cores']} cores ({mi['cpu']}), {mi['cores_usable']} usable, python "
        f"{mi['python']}, torch {mi['torch']}, zstandard {mi['zstandard']}; load average "
        f"{mi['loadavg_start'][0]:.1f} at start, {mi['loadavg_end'][0]:.1f} at end; git {mi['git']}"
    )
    if mi.get("pythonpath"):
        print(f"PYTHONPATH={mi['pythonpath']} (the services and ranks import from it first)")
    print(
        f"model: fine-tune encoder, {results['params'] / 1e6:.2f}M parameters, "
        f"{results['saves'][str(cfg['worlds'][0])]['full_bytes'] / MB:.1f} MB per checkpoint "
        f"(model + AdamW + scheduler); {cfg['checkpoints']} checkpoints, {cfg['every']} "
        f"AdamW steps apart, global batch {cfg['size']['batch']}; gloo on CPU, 1 torch thread "
        "per rank; replicas: " + "; ".join(f"{k}: {v}" for k, v in results["store_notes"].items())
    )
    print(
        "figures: slowest rank; times are medians over checkpoints 2..K; stored = mean bytes "
        "per checkpoint over all K (keyframe included); MB = 1e6 bytes"
    )
    head = (
        f"{'N':>2} {'store':<23} {'stored MB/ckpt':>14} {'after 1st':>9} "
        f"{'save s':>7} {'async stall ms':>14} {'staged ms':>9} {'async done s':>12} "
        f"{'stall/zstd3':>11}"
    )
    print()
    print(head)
    print("-" * len(head))
    for n, r in results["saves"].items():
        base = r["baseline"]["median_s"]
        zbytes = statistics.mean(r["baseline"]["torch_save_zstd3_bytes"])
        print(
            f"{n:>2} {'torch.save+zstd3 (full)':<23} {zbytes / MB:14.2f} {'':>9} "
            f"{base:7.3f} {'':>14} {'':>9} {'':>12} {'':>11}"
        )
        for store, e in r["stores"].items():
            s, a = e.get("sync", {}), e.get("async", {})
            if "error" in s or "error" in a:
                why = (s.get("error") or a.get("error")).splitlines()[-1]
                print(f"{n:>2} {store:<23} FAILED: {why}")
                continue
            print(
                f"{n:>2} {store:<23} {s['stored_mean'] / MB:14.2f} "
                f"{s['stored_mean_after_first'] / MB:9.2f} {s['done_median_s']:7.3f} "
                f"{a['stall_median_s'] * 1e3:14.1f} {a.get('staged_median_s', 0) * 1e3:9.1f} "
                f"{a['done_median_s']:12.3f} {a['stall_median_s'] / base:10.3f}x"
            )
        c = r.get("client_async")
        if c and "error" in c:
            print(f"{n:>2} {CLIENT:<23} FAILED: {c['error'].splitlines()[-1]}")
        elif c:
            print(
                f"{n:>2} {CLIENT:<23} {c['stored_mean'] / MB:14.2f} "
                f"{c['stored_mean_after_first'] / MB:9.2f} {'-':>7} "
                f"{c['stall_median_s'] * 1e3:14.1f} {'':>9} {c['done_median_s']:12.3f} "
                f"{c['stall_median_s'] / base:10.3f}x"
            )
    print()
    print("stored MB per checkpoint, in order (sync run; async run in brackets when it differs)")
    for n, r in results["saves"].items():
        for store, e in r["stores"].items():
            s, a = e.get("sync", {}), e.get("async", {})
            if "stored_per_ckpt" not in s:
                continue
            per = " ".join(f"{b / MB:6.2f}" for b in s["stored_per_ckpt"])
            if a.get("stored_per_ckpt") not in (None, s["stored_per_ckpt"]):
                per += "  [" + " ".join(f"{b / MB:.2f}" for b in a["stored_per_ckpt"]) + "]"
            extra = f"  parts {s['parts'][-1]}" if "parts" in s else ""
            print(f"  N={n} {store:<23} {per}{extra}")
        c = r.get("client_async", {})
        if "stored_per_ckpt" in c:
            per = " ".join(f"{b / MB:6.2f}" for b in c["stored_per_ckpt"])
            print(f"  N={n} {CLIENT:<23} {per}")
    print()
    print(
        f"resharded load of latest (dcp.load, slowest rank, best of {cfg['repeats']} rounds "
        "over all stores; chain: the deltas latest sits on, per the listing)"
    )
    lhead = (
        f"{'N->M':>5} {'store':<23} {'load s':>7} {'MB/s':>6} {'MB read/rank':>19} "
        f"{'chain':>5}  verified"
    )
    print(lhead)
    print("-" * len(lhead))
    for e in results["loads"]:
        nm = f"{e['n']}->{e['m']}"
        if "error" in e:
            print(f"{nm:>5} {e['store']:<23} FAILED: {e['error'].splitlines()[-1]}")
            continue
        read = e.get("bytes_read_by_rank") or []
        read_s = "/".join(f"{b / MB:.1f}" for b in read if b is not None) or "-"
        depth = str(e["chain_depth"]) if "chain_depth" in e else "-"
        print(
            f"{nm:>5} {e['store']:<23} {e['best_s']:7.3f} {e['raw_bytes'] / e['best_s'] / MB:6.0f} "
            f"{read_s:>19} {depth:>5}  {e.get('verified')}"
        )
    if results.get("blob_check"):
        print()
        for store, b in results["blob_check"].items():
            print(
                f"{store}: blob folder {b['blob_dir_bytes'] / MB:.2f} MB, listings "
                f"{b['listed_stored_bytes'] / MB:.2f} MB (all runs)"
            )
    for n, r in results["saves"].items():
        cpu = ", ".join(f"{k} {v:.1f} s" for k, v in r["service_cpu_s"].items())
        print(
            f"N={n}: training {r['train_s_rank0']:.1f} s on rank 0, loss "
            f"{statistics.mean(r['losses_rank0'][: cfg['every']]):.4f} -> "
            f"{statistics.mean(r['losses_rank0'][-cfg['every'] :]):.4f}; service CPU over "
            f"all its saves: {cpu}"
        )
    print()
    print("targets")
    for t in results["targets"]:
        print(f"  {'PASS' if t['pass'] else 'FAIL'}  {t['target']}: {t['figures']}")
    passed = sum(t["pass"] for t in results["targets"])
    print(f"  {passed}/{len(results['targets'])} passed")
    for phase, err in results["phase_errors"].items():
        print(f"  phase {phase} failed: {err}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="a smaller model, 3 checkpoints")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out_dist")
    p.add_argument("--s3", action="store_true", help="2 replicas on moto S3, not a folder")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--checkpoints", type=int, default=None, help="default 6; quick 3")
    p.add_argument("--every", type=int, default=None, help="steps apart (default 10; quick 5)")
    p.add_argument("--repeats", type=int, default=None, help="loads, best kept (3; quick 1)")
    args = p.parse_args()

    if args.quick:
        # ~0.66M parameters, ~8 MB per checkpoint
        size = replace(models.SIZES["quick"], pretrain_steps=20)
    else:
        # ~2.9M parameters (54% token embeddings), ~35 MB per checkpoint
        size = models.Size(
            vocab=512, dim=192, layers=3, heads=4, seq=32, batch=8,
            pretrain_steps=60, encoder_vocab=8192,
        )  # fmt: skip
    worlds = sorted(set(args.worlds))
    loads = [(n, m) for n, m in ((4, 2), (2, 1), (1, 4)) if n in worlds]
    if args.quick:
        loads = loads[:2]
    n_ckpt = args.checkpoints or (3 if args.quick else 6)
    every = args.every or (5 if args.quick else 10)
    repeats = args.repeats or (1 if args.quick else 3)
    os.environ["DIST_BENCH_BATCH"] = str(size.batch)
    if any(size.batch % n for n in worlds + [m for _, m in loads]):
        raise SystemExit(f"the global batch {size.batch} must split evenly over the ranks")
    args.out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    # the services import ckptstore_service through it if it is set: say so next to the figures
    machine["pythonpath"] = os.environ.get("PYTHONPATH")
    scratch = Path(tempfile.mkdtemp(prefix="ckptstore-dist-"))
    results: dict[str, Any] = {"machine": machine, "phase_errors": {}}
    try:
        with Stores(scratch, args.s3) as stores:
            cfg = Config(
                scratch=str(scratch),
                size=asdict(size),
                checkpoints=n_ckpt,
                every=every,
                repeats=repeats,
                urls={},
                loads=loads,
            )
            # forked before any thread of this process starts: the services start meanwhile
            log(f"pretraining the encoder ({size.pretrain_steps} steps) in a child process")
            pre = spawn(pretrain, 1, cfg)
            stores.callback(kill, pre)
            stores.start()
            log("services up")
            err = finish(pre)
            if err:
                raise SystemExit(f"pretraining failed: {err}")
            cfg = replace(cfg, urls=stores.urls())
            results["config"] = {
                "quick": args.quick,
                "size": asdict(size),
                "checkpoints": n_ckpt,
                "every": every,
                "repeats": repeats,
                "worlds": worlds,
                "loads": loads,
                "s3": args.s3,
                "mb": MB,
            }
            results["store_notes"] = stores.notes
            results["params"] = torch.load(scratch / "pretrained.pt", weights_only=True)["params"]
            results["saves"] = {}
            for n in worlds:
                log(f"N={n}: training and saving ({n_ckpt} checkpoints)")
                before = stores.cpu_s()
                err = launch(save_ranks, n, cfg)
                if err:
                    results["phase_errors"][f"save N={n}"] = err
                    log(f"N={n} failed: {err}")
                    continue
                results["saves"][str(n)] = collect_saves(cfg, n, stores, before)
            results["loads"] = []
            for m in sorted({m for _, m in loads}, reverse=True):
                sources = [n for n, mm in loads if mm == m and str(n) in results["saves"]]
                if not sources:
                    continue
                log(f"loading into {m} ranks from N={sources}")
                err = launch(load_ranks, m, cfg, sources, timeout=300)
                if err:
                    results["phase_errors"][f"load M={m}"] = err
                    log(f"load into {m} failed: {err}")
                    continue
                results["loads"] += collect_loads(cfg, m)
            results["blob_check"] = blob_check(stores, results["saves"])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    machine["loadavg_end"] = os.getloadavg()
    results["targets"] = targets(results)
    results["wall_s"] = time.perf_counter() - _T0
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    report(results)
    print()
    print(f"wrote {args.out / 'results.json'}")
    print(f"total wall time {results['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
