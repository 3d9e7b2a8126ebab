"""What each rank of the DCP tests runs: a tiny transformer-ish model under FSDP2 (or HSDP)
with AdamW on CPU/gloo, saved and loaded through ``ckptstore.dcp``.

``launch(fn, world, *args)`` forks ``world`` ranks of ``fn(rank, world, port, *args)`` from
the test process (fork: the ranks reuse its imported torch instead of importing it again,
which costs ~5-10 s per rank on a loaded 2-core host) and raises a rank's error. Ranks hand
their results back as files in an output folder (``torch.save``: test scratch only).
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ckptstore.dcp import CkptStoreReader, CkptStoreWriter
from support.serviceproc import free_port

VOCAB, DIM, HIDDEN = 16, 8, 12
GRID = 64  # bytes: cells of 2 rows of embed and l1 weights (8 fp32), 1 row of l2's (12)


class Tiny(nn.Module):
    """Embedding, two Linears and a LayerNorm (~470 parameters), plus a bf16 buffer
    (replicated: not sharded by FSDP)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.l1 = nn.Linear(DIM, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.l2 = nn.Linear(HIDDEN, VOCAB)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 4, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l1(self.embed(x)))
        return self.l2(self.norm(h)) * self.scale.float().mean()


def launch(fn: Any, world: int, *args: Any) -> None:
    context = start(fn, world, *args)
    while not context.join():
        pass


def start(fn: Any, world: int, *args: Any) -> mp.ProcessContext:
    """``world`` ranks of ``fn`` forked and running; the caller joins them (or kills some:
    ``context.processes[rank].pid``)."""
    port = free_port()
    return mp.start_processes(
        fn, args=(world, port, *args), nprocs=world, join=False, start_method="fork"
    )


def replica(url: str | list[str], rank: int) -> str:
    """``url``, or of several replicas' URLs the one of ``rank`` (ranks spread over them)."""
    return url if isinstance(url, str) else url[rank % len(url)]


def init(rank: int, world: int, port: int, timeout_s: float | None = None) -> None:
    """Join the gloo group; ``timeout_s``: how long a collective waits for a peer (default:
    torch's 30 minutes)."""
    torch.set_num_threads(1)
    os.environ.pop("OMP_NUM_THREADS", None)
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timeout,
    )


def build(seed: int = 0, hsdp: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Tiny()
    mesh = None
    if hsdp:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for layer in (model.l1, model.l2):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, opt


def train_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    step: int,
    before_update: Callable[[], None] | None = None,
) -> str:
    """One step on this rank's batch of ``step`` (the same on every run); the loss's bits.
    ``before_update`` runs between the backward pass and the optimizer's step."""
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randint(0, VOCAB, (4, 6), generator=gen)
    y = torch.randint(0, VOCAB, (4, 6), generator=gen)
    loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    loss.backward()
    if before_update is not None:
        before_update()
    opt.step()
    opt.zero_grad()
    return struct.pack("<f", loss.item()).hex()


def sharded(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def gathered(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The full state on rank 0 (empty elsewhere), as evaluation would want it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=options)
    return {"model": msd, "optim": osd}


def local_shard_bytes(state: dict[str, Any]) -> int:
    """Bytes of this rank's DTensor shards in ``state``."""
    total = 0

    def visit(node: Any) -> None:
        nonlocal total
        if isinstance(node, DTensor):
            local = node.to_local()
            total += local.numel() * local.element_size()
        elif isinstance(node, dict):
            for v in node.values():
                visit(v)

    visit(state)
    return total


# -------------------------------------------------------------------------------- scenarios


def save_run(
    rank: int,
    world: int,
    port: int,
    url: str | list[str],
    run: str,
    out: str,
    saves: list[int],
    steps: int,
    direct: bool = False,
) -> None:
    """Train ``steps`` steps, saving with dcp.save after each step in ``saves`` (and
    gathering the full state then); the losses of every step go to losses-{rank}.json.
    The writer's grid is 64 bytes: every 2-d shard is stored as pieces of a few rows.
    ``direct``: each rank encodes its own part."""
    init(rank, world, port)
    model, opt = build()
    writer = CkptStoreWriter(replica(url, rank), run, grid_bytes=GRID, direct=direct)
    losses = {}
    for step in range(1, steps + 1):
        losses[step] = train_step(model, opt, step)
        if step in saves:
            dcp.save(sharded(model, opt), storage_writer=writer, checkpoint_id=step)
            full = gathered(model, opt)
            if rank == 0:
                torch.save(full, Path(out) / f"full-{step}.pt")
    Path(out, f"losses-{rank}.json").write_text(json.dumps(losses))
    dist.destroy_process_group()


def load_run(
    rank: int,
    world: int,
    port: int,
    url: str | list[str],
    run: str,
    out: str,
    loads: list[int | str],
    then_train: list[int],
    direct: bool = False,
) -> None:
    """Load each of ``loads`` into a fresh model of ``world`` ranks, gathering the full state
    (rank 0: loaded-{world}-{step}.pt) and noting the bytes each rank fetched; then train
    the steps ``then_train`` from the last one loaded (losses in resumed-{rank}.json).
    ``direct``: each rank decodes what it reads (``CkptStoreReader(direct=True)``)."""
    init(rank, world, port)
    model, opt = build(seed=1234)  # other values than the saved ones
    fetched = {}
    for step in loads:
        state = sharded(model, opt)
        reader = CkptStoreReader(replica(url, rank), run, step, direct=direct)
        dcp.load(state, storage_reader=reader)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        fetched[str(step)] = [reader.bytes_read, local_shard_bytes(state)]
        full = gathered(model, opt)
        if rank == 0:
            torch.save(full, Path(out) / f"loaded-{world}-{step}.pt")
    Path(out, f"fetched-{world}-{rank}.json").write_text(json.dumps(fetched))
    losses = {step: train_step(model, opt, step) for step in then_train}
    Path(out, f"resumed-{rank}.json").write_text(json.dumps(losses))
    dist.destroy_process_group()


def save_once(
    rank: int,
    world: int,
    port: int,
    url: str | list[str],
    run: str,
    out: str,
    hsdp: bool,
    steps: int,
    grid_bytes: int | None = None,
) -> None:
    """``steps`` training steps, then one dcp.save as step 1 (FSDP, or HSDP on 2x2); ``url``:
    one, or several replicas' (the ranks spread over them)."""
    init(rank, world, port)
    model, opt = build(hsdp=hsdp)
    for step in range(1, steps + 1):
        train_step(model, opt, step)
    writer = CkptStoreWriter(replica(url, rank), run, 1, grid_bytes=grid_bytes)
    dcp.save(sharded(model, opt), storage_writer=writer)
    full = gathered(model, opt)
    if rank == 0:
        torch.save(full, Path(out) / f"full-{run}.pt")
    dist.destroy_process_group()


def resharded_save(rank: int, world: int, port: int, url: str, run: str, grid_bytes: int) -> None:
    """Load step 1 into ``world`` ranks, train a step, save it as step 2."""
    init(rank, world, port)
    model, opt = build(seed=1234)
    state = sharded(model, opt)
    dcp.load(state, storage_reader=CkptStoreReader(url, run, 1))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train_step(model, opt, 2)
    writer = CkptStoreWriter(url, run, 2, grid_bytes=grid_bytes)
    dcp.save(sharded(model, opt), storage_writer=writer)
    dist.destroy_process_group()


def async_run(
    rank: int,
    world: int,
    port: int,
    url: str,
    run: str,
    out: str,
    executor: str,
    async_staging: bool = False,
) -> None:
    """Two dcp.async_save calls (steps 1 and 2), the second step's training beside the first
    upload; rank 0 gathers the full state saved and notes the time until control came back.
    ``async_staging``: the writer copies the state in a thread; the next step's forward and
    backward passes run beside the copy, its optimizer step waits for it."""
    import time

    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    init(rank, world, port)
    model, opt = build()
    # the upload's collectives run beside training's: on a group of their own (as DCP advises)
    group = dist.new_group(backend="gloo")
    kind = AsyncCheckpointerType(executor)
    writer = CkptStoreWriter(url, run, async_staging=async_staging)
    stalls = []
    futures = []
    staged: list[Any] = []
    for step in (1, 2):
        # overlaps the previous step's upload (and, with async staging, its copy)
        train_step(model, opt, step, lambda pending=staged: [s.result() for s in pending])
        full = gathered(model, opt)
        if rank == 0:
            torch.save(full, Path(out) / f"full-{step}.pt")
        if futures:  # one save in flight: two at once would interleave their collectives
            futures[-1].result()  # type: ignore[union-attr]
        start = time.perf_counter()
        response = dcp.async_save(
            sharded(model, opt),
            storage_writer=writer,
            checkpoint_id=step,
            process_group=group,
            async_checkpointer_type=kind,
        )
        stalls.append(time.perf_counter() - start)
        if async_staging:  # returned before the copy is done
            staged = [response.staging_completion]  # type: ignore[union-attr]
            response = response.upload_completion  # type: ignore[union-attr]
        futures.append(response)
    for future in futures:
        future.result()  # type: ignore[union-attr]
    dist.barrier()
    if rank == 0:
        Path(out, "stalls.json").write_text(json.dumps(stalls))
    dist.destroy_process_group()


def async_beside_training(
    rank: int, world: int, port: int, url: str, run: str, out: str, dedicated: bool
) -> None:
    """One dcp.async_save (thread executor) of step 1, then training goes on beside the
    upload, step after step (FSDP's collectives on the default group), until every rank's
    save is done (an all_reduce of the ranks' "done" flags after each step). ``dedicated``:
    the save on a gloo group of its own; else on the default group, which the writer must
    refuse at once (its message goes to refused-{rank}.txt). Collectives give up after
    30 s: a hang fails the rank instead of blocking the test. Rank 0 keeps the full state
    saved (full-1.pt)."""
    init(rank, world, port, timeout_s=30)
    model, opt = build()
    group = dist.new_group(backend="gloo") if dedicated else None
    train_step(model, opt, 1)
    full = gathered(model, opt)
    if rank == 0:
        torch.save(full, Path(out) / "full-1.pt")
    writer = CkptStoreWriter(url, run)
    try:
        future = dcp.async_save(
            sharded(model, opt), storage_writer=writer, checkpoint_id=1, process_group=group
        )
    except ValueError as exc:
        Path(out, f"refused-{rank}.txt").write_text(str(exc))
        dist.destroy_process_group()
        return
    step, done = 1, torch.zeros(1)
    while not done.item():
        step += 1
        train_step(model, opt, step)
        done = torch.tensor([float(future.done())])  # type: ignore[union-attr]
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
    future.result()  # type: ignore[union-attr]
    Path(out, f"trained-{rank}.json").write_text(json.dumps(step - 1))
    writer.close()
    dist.destroy_process_group()


class _MidPartPlanner(DefaultSavePlanner):
    """Calls ``at_second()`` before resolving the second tensor it is asked for: mid-way
    through the part's body (the writer resolves tensors while streaming them, so the
    header and the first tensor are on their way)."""

    def __init__(self, at_second: Callable[[], None]) -> None:
        super().__init__()
        self.resolved = 0
        self.at_second = at_second

    def resolve_data(self, write_item: WriteItem) -> Any:
        self.resolved += write_item.tensor_data is not None
        if self.resolved == 2:
            self.at_second()
        return super().resolve_data(write_item)


def _fail() -> None:
    raise RuntimeError("this rank fails mid-upload")


def _stall() -> None:
    """Wait for good: the part's upload stays in progress until the test kills the rank."""
    threading.Event().wait()


def failing_save(rank: int, world: int, port: int, url: str, run: str, out: str) -> None:
    """Save step 1; then a save of step 2 in which the last rank fails while streaming its
    part (every rank must see the failure); then step 2 again, which must land."""
    init(rank, world, port)
    model, opt = build()
    writer = CkptStoreWriter(url, run)
    train_step(model, opt, 1)
    dcp.save(sharded(model, opt), storage_writer=writer, checkpoint_id=1)
    train_step(model, opt, 2)
    planner = _MidPartPlanner(_fail) if rank == world - 1 else None
    try:
        dcp.save(sharded(model, opt), storage_writer=writer, checkpoint_id=2, planner=planner)
    except CheckpointException as exc:
        Path(out, f"failed-{rank}.txt").write_text(str(exc))
    latest = CkptStoreReader(url, run)
    dist.barrier()
    if rank == 0:
        Path(out, "latest-after-failure.json").write_text(
            json.dumps(latest.read_metadata().storage_meta.checkpoint_id)  # type: ignore[union-attr]
        )
    dist.barrier()
    dcp.save(sharded(model, opt), storage_writer=writer, checkpoint_id=2)
    full = gathered(model, opt)
    if rank == 0:
        torch.save(full, Path(out) / "full-2.pt")
    dist.destroy_process_group()


def staged_run(rank: int, world: int, port: int, url: str, run: str, out: str) -> None:
    """Two dcp.async_save calls (steps 1 and 2, thread executor) staged by the writer itself;
    right after each returns, the trainer changes its parameters, optimizer state and a
    list in the state in place. Rank 0 keeps the full state at each call; every rank notes
    whether the second save staged into the first one's buffers."""
    init(rank, world, port)
    model, opt = build()
    group = dist.new_group(backend="gloo")
    writer = CkptStoreWriter(url, run)
    extra: dict[str, Any] = {"seen": [0]}
    buffers: list[list[int]] = []
    for step in (1, 2):
        train_step(model, opt, step)
        extra["seen"].append(step)
        full = gathered(model, opt)
        if rank == 0:
            full["extra"] = {"seen": list(extra["seen"])}
            torch.save(full, Path(out) / f"full-{step}.pt")
        state = sharded(model, opt)
        state["extra"] = extra
        future = dcp.async_save(
            state, storage_writer=writer, checkpoint_id=step, process_group=group
        )
        with torch.no_grad():  # what the next optimizer step does while the upload runs
            for param in model.parameters():
                param.add_(1.0)
            for per_param in opt.state.values():
                for value in per_param.values():
                    if isinstance(value, torch.Tensor):
                        value.add_(3.0)
        extra["seen"].append(-1)
        staging = writer._staging
        assert staging is not None
        buffers.append(sorted(b.data_ptr() for b in staging._buffers.values()))
        future.result()  # type: ignore[union-attr]
        extra["seen"].pop()
    dist.barrier()
    Path(out, f"reused-{rank}.json").write_text(json.dumps(buffers[0] == buffers[1]))
    writer.close()
    dist.destroy_process_group()


def killed_save(
    rank: int, world: int, port: int, url: str, run: str, out: str, victim: int, timeout_s: float
) -> None:
    """Save step 1; then step 2, in which rank ``victim`` stops for good in the middle of
    its part's body (the test SIGKILLs it there). The others' collectives give up on the
    dead rank after ``timeout_s`` at most: each notes the error it saw in
    failed-{rank}.txt and exits with status 1."""
    init(rank, world, port, timeout_s)
    model, opt = build()
    writer = CkptStoreWriter(url, run)
    train_step(model, opt, 1)
    dcp.save(sharded(model, opt), storage_writer=writer, checkpoint_id=1)
    train_step(model, opt, 2)
    planner = _MidPartPlanner(_stall) if rank == victim else None
    try:
        dcp.save(sharded(model, opt), storage_writer=writer, checkpoint_id=2, planner=planner)
    except Exception as exc:
        Path(out, f"failed-{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        os._exit(1)  # the group is broken: no clean shutdown to wait for
    Path(out, f"saved-{rank}.txt").write_text("step 2 saved")  # never: the victim is dead


def resumed_save(
    rank: int,
    world: int,
    port: int,
    url: str,
    run: str,
    out: str,
    step: int,
    direct: tuple[bool, bool] = (False, False),
    read_bases: bool = True,
) -> None:
    """A restarted job: load ``latest`` (noting its step in resumed-from.json), train step
    ``step``, save it; rank 0 keeps the full state saved (full-{step}.pt). ``direct``:
    whether the load and the save are direct (a direct save's writer cuts :data:`GRID`
    cells, as :func:`save_run`'s); ``read_bases``: the process's writer's setting (a
    direct save reads the parent's tensors it holds no base for from the store)."""
    init(rank, world, port)
    if direct[1]:
        from ckptstore.direct import shared_writer

        shared_writer().read_bases = read_bases
    model, opt = build(seed=1234)  # other values than the saved ones
    state = sharded(model, opt)
    reader = CkptStoreReader(url, run, direct=direct[0])
    dcp.load(state, storage_reader=reader)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train_step(model, opt, step)
    options: dict[str, Any] = {"direct": True, "grid_bytes": GRID} if direct[1] else {}
    dcp.save(sharded(model, opt), storage_writer=CkptStoreWriter(url, run, step, **options))
    full = gathered(model, opt)
    if rank == 0:
        Path(out, "resumed-from.json").write_text(json.dumps(reader.served_step))
        torch.save(full, Path(out) / f"full-{step}.pt")
    dist.destroy_process_group()
