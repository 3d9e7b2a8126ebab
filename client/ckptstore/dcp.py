"""torch.distributed.checkpoint (DCP) storage for ckptstore: save and load FSDP/HSDP states.

::

    from ckptstore.dcp import CkptStoreWriter, CkptStoreReader
    dcp.save(state, storage_writer=CkptStoreWriter(URL, "run", step))
    dcp.load(state, storage_reader=CkptStoreReader(URL, "run"))         # step="latest"

How a checkpoint is stored
    Every rank uploads its own write items as one *part* of the checkpoint
    (:func:`part_name`: ``rank-{i}.{save}``, ``i`` its rank in the process group, ``save``
    a token of this save), streamed tensor by tensor from its shards: no rank holds more
    than its own items. A shard is cut along dim 0 into pieces at a grid of the
    global tensor (cells of ``grid_bytes``, default 4 MiB; :func:`grid_cuts`), and a piece
    is the tensor ``{fqn}@{offsets}`` (its global offsets joined by ``,``;
    ``"model.w@1024,0"``). So the same piece of the next save has the same name and shape
    and the service stores its delta against it -- also after the world size changed,
    wherever both worlds' shards cover whole cells. A non-tensor item (DCP's own
    ``torch.save`` bytes: learning rates, param group lists) travels as a ``U8`` tensor
    ``{fqn}@bytes``. The coordinator's ``finish`` then commits all parts at once with DCP's
    :class:`~torch.distributed.checkpoint.metadata.Metadata` as JSON (:func:`metadata_to_json`)
    in the commit's metadata under ``"dcp"``: no pickle on the wire or at rest. Until the
    commit nothing is visible; ``latest`` moves with it.

How it is loaded
    Each rank reads the metadata (``GET .../info``), lets DCP plan which stored pieces its
    own tensors overlap, and fetches exactly those tensors in one ``POST .../select``,
    copying the overlapping regions into place as each piece arrives. Any world size loads
    any other's checkpoint. Without a process group, :func:`load_full` (and
    :meth:`ckptstore.CheckpointClient.load`) assembles the full, unsharded state dict.

``checkpoint_id`` (``dcp.save(..., checkpoint_id=...)``) may be the step (``1000`` or
``"1000"``) or ``"run/step"``; for the reader also ``"latest"`` and ``"run/latest"``.

Both classes hold only plain configuration (URL, run, step, client options) and open their
HTTP connections per call, so they pickle (``dcp.async_save``'s process executor sends the
writer to another process; the writer's staging buffers stay behind).

``dcp.async_save``
    The writer is also DCP's :class:`~torch.distributed.checkpoint.staging.AsyncStager`
    (``async_save`` stages with a ``storage_writer`` that is one, unless given an
    ``async_stager``): :meth:`CkptStoreWriter.stage` copies every tensor -- a DTensor's
    local shard, wrapped again in a DTensor of the same spec -- into host buffers that the
    next save reuses (:class:`ckptstore.staging.StagingBuffers`), and deep-copies every other
    leaf, before ``async_save`` returns. A save's buffers are reused only once nothing holds
    them any more (its upload is done and dropped); otherwise the next save stages into
    fresh ones. The thread executor on the default process group is refused
    (:func:`_refuse_the_default_group`): its collectives would interleave with training's.
    So wait for a save before starting the next (DCP wants that anyway: two
    saves in flight interleave their collectives) and steady-state saves allocate nothing.

    With ``CkptStoreWriter(..., async_staging=True)`` the copy runs in a thread of the
    writer's instead: ``async_save`` returns at once with an ``AsyncSaveResponse``, and the
    copy overlaps the next step's forward and backward passes, which only read the state::

        group = dist.new_group(backend="gloo")   # once: the upload's collectives
        ...
        response = dcp.async_save(state, storage_writer=writer, checkpoint_id=step,
                                  process_group=group)
        loss = model(batch).loss; loss.backward()
        response.staging_completion.result()    # before the weights and moments change
        optimizer.step()
"""

from __future__ import annotations

import copy
import dataclasses
import io
import math
import os
import re
import sys
import uuid
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future as ConcurrentFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from ckptstore import parts
from ckptstore.client import CheckpointClient, fetch_tensors
from ckptstore.dcp_metadata import (
    StorageInfo,
    full_state,
    full_state_if_dcp,
    metadata_from_json,
    metadata_to_json,
)
from ckptstore.staging import StagingBuffers
from ckptstore.state import FlatState, dtype_to_wire, tensor_bytes, tensor_from_bytes
from ckptstore_core.dcp_layout import FULL, LAYOUT_KEY, METADATA_KEY
from ckptstore_core.errors import CorruptData, InvalidRequest
from ckptstore_core.names import check_run_name
from ckptstore_core.records import USER_METADATA_KEY, encode_user_metadata
from ckptstore_core.wire import TensorSpec

__all__ = [
    "METADATA_KEY",
    "CkptStoreReader",
    "CkptStoreWriter",
    "full_state",
    "load_full",
    "metadata_from_json",
    "metadata_to_json",
    "parse_checkpoint_id",
    "part_name",
    "shard_name",
]

#: The default of ``CkptStoreWriter(grid_bytes=...)``: the service's default chunk size.
GRID_BYTES = 4 << 20
#: DCP's metadata version, as its FileSystemWriter writes it (torch 2.4+).
DCP_VERSION = "1.0.0"
_BYTES_SUFFIX = "@bytes"


# ---------------------------------------------------------------------------- names and ids


def shard_name(fqn: str, offsets: Sequence[int]) -> str:
    """The stored tensor of a shard of ``fqn`` starting at ``offsets`` (global element
    coordinates): ``"{fqn}@{o0,o1,...}"``. A scalar's is ``"{fqn}@"``."""
    return f"{fqn}@{','.join(str(int(o)) for o in offsets)}"


def part_name(rank: int, save_id: str) -> str:
    """The part rank ``rank`` uploads in the save ``save_id`` (the coordinator's
    :attr:`CkptStoreWriter.save_id`, new at each save): ``rank-{rank}.{token}``. Each save
    names its parts anew, so the parts an earlier attempt at the same step left (a rank
    was killed mid-save; the job restarted, maybe with another world size) never clash with
    this save's: its commit names its own, and the service deletes the others."""
    return f"rank-{rank}.{save_id.replace('-', '')[:12]}"


def bytes_name(fqn: str) -> str:
    """The stored ``U8`` tensor of a non-tensor item: ``"{fqn}@bytes"`` (never a shard's
    name: those end in digits and commas after their last ``@``)."""
    return fqn + _BYTES_SUFFIX


_STEP = re.compile(r"[0-9]{1,18}")


def parse_checkpoint_id(
    checkpoint_id: object, *, allow_latest: bool = False
) -> tuple[str | None, int | str]:
    """``(run or None, step)`` of a ``checkpoint_id``: a step (``12``, ``"12"``),
    ``"run/step"``, and with ``allow_latest`` also ``"latest"`` / ``"run/latest"``.
    InvalidRequest for anything else."""
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        if checkpoint_id < 0:
            raise InvalidRequest(f"checkpoint step must be >= 0, got {checkpoint_id}")
        return None, checkpoint_id
    if isinstance(checkpoint_id, str | os.PathLike):
        text = os.fspath(checkpoint_id)
        if isinstance(text, str):
            run, _, step = text.rpartition("/")
            if run:
                check_run_name(run)
            if _STEP.fullmatch(step):
                return run or None, int(step)
            if allow_latest and step == "latest":
                return run or None, "latest"
    want = "a step, 'run/step'" + (", 'latest' or 'run/latest'" if allow_latest else "")
    raise InvalidRequest(f"checkpoint_id must be {want}; got {checkpoint_id!r}")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# ------------------------------------------------------------- writer and reader plans


@dataclass(frozen=True, slots=True)
class _Pieces:
    """``SavePlan.storage_data`` of a local plan: each grid piece's index -> the index of the
    shard it was cut from (what the planner resolves)."""

    shards: dict[MetadataIndex, MetadataIndex]


@dataclass(frozen=True, slots=True)
class _PartPlan:
    """``SavePlan.storage_data`` of a final plan: the part a rank uploads (named by the
    coordinator) and its pieces."""

    part: str
    shards: dict[MetadataIndex, MetadataIndex]


def grid_cuts(
    size: Sequence[int], itemsize: int, start: int, rows: int, grid_bytes: int | None
) -> list[tuple[int, int]]:
    """``(first row, rows)`` of the pieces that rows ``[start, start + rows)`` of a tensor of
    ``size`` are stored as: cut at the multiples of the tensor's grid, ``cell`` rows, the
    largest power of two whose rows hold at most ``grid_bytes`` (at least one row). The grid
    depends on the global tensor only, so shards of any world size that cover whole cells
    store those cells under the same names and shapes, and the service diffs them against
    the previous checkpoint's even when the world size changed; a load reads whole pieces,
    so at most a cell more than it needs at each end of a shard."""
    if grid_bytes is None or not size or rows <= 1:
        return [(start, rows)]
    row_bytes = math.prod(size[1:]) * itemsize
    if row_bytes == 0:
        return [(start, rows)]
    cell = 1 << max(0, (grid_bytes // row_bytes).bit_length() - 1)
    cuts = []
    row, end = start, start + rows
    while row < end:
        stop = min(end, (row // cell + 1) * cell)
        cuts.append((row, stop - row))
        row = stop
    return cuts


# ------------------------------------------------------------------------------- the writer


class CkptStoreWriter(StorageWriter, AsyncStager):
    """DCP :class:`~torch.distributed.checkpoint.StorageWriter` that stores a checkpoint as
    step ``step`` of run ``run`` of the ckptstore service at ``url``.

    ``step`` may instead come as ``dcp.save(..., checkpoint_id=step)`` (or ``"run/step"``),
    which is how one writer saves many steps. ``client_options`` go to
    :class:`~ckptstore.CheckpointClient` (``timeout``, ``retries``, ``backoff``).
    ``grid_bytes`` sets the grid pieces are cut at (:func:`grid_cuts`; ``None``: one piece
    per shard). Below 64 KiB the service stores pieces whole, never as deltas; smaller
    cells keep more pieces' names across world sizes, at one catalog row per piece.
    ``metadata``: the checkpoint's user metadata, as for :meth:`CheckpointClient.save`
    (``{"eval_loss": 0.31}``); the coordinator's commit carries it. ``direct=True``: each
    rank encodes its own part (against what its process last sent of the run) and sends
    it encoded; the service plans, checks and commits (docs/scale.md).

    Every rank uploads its items as one part; the coordinator commits them once. A step
    that already exists is refused (:class:`~ckptstore.CheckpointExists`), unless it is the
    same content again (a retried save). ``use_collectives=False`` is refused: the commit
    needs every rank's results.

    ``dcp.async_save`` stages with the writer (:meth:`stage`): its host buffers are reused
    from one save to the next and held until :meth:`close`. ``async_staging=True`` copies
    in a thread of the writer's: ``async_save`` returns at once with an
    ``AsyncSaveResponse``, and the loop waits for its ``staging_completion`` before the
    next ``optimizer.step()``.
    """

    # stage() has copied everything when it returns: nothing to synchronise afterwards
    _synchronize_after_execute = False
    _staging: StagingBuffers | None = None
    _copier: ThreadPoolExecutor | None = None

    def __init__(
        self,
        url: str,
        run: str,
        step: int | None = None,
        *,
        grid_bytes: int | None = GRID_BYTES,
        metadata: Mapping[str, Any] | None = None,
        async_staging: bool = False,
        direct: bool = False,
        **client_options: Any,
    ) -> None:
        super().__init__()
        self.async_staging = async_staging
        self.direct = direct
        self.url = url
        # checked here, in the training process, not at the commit
        self.metadata = None if metadata is None else encode_user_metadata(metadata)
        self.run = check_run_name(run)
        self.step = None if step is None else int(parse_checkpoint_id(step)[1])
        if grid_bytes is not None and grid_bytes < 1:
            raise ValueError(f"grid_bytes must be positive or None, got {grid_bytes}")
        self.grid_bytes = grid_bytes
        self.client_options = dict(client_options)
        self.rank = 0
        self.is_coordinator = True
        self.save_id = str(uuid.uuid4())

    @property
    def checkpoint_id(self) -> str | None:
        return None if self.step is None else f"{self.run}/{self.step}"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_staging", None)  # host buffers (and copy threads) stay in this process
        state.pop("_copier", None)
        return state

    def stage(
        self, state_dict: dict[str, Any]
    ) -> dict[str, Any] | ConcurrentFuture[dict[str, Any]]:
        """``state_dict`` copied for ``dcp.async_save`` (:meth:`_staged`): done when this
        returns; or, with ``async_staging=True``, a future of it, the copy running in a thread
        of this writer's. ``async_save`` then returns at once, with an ``AsyncSaveResponse``:
        the training loop may run its next forward and backward passes (which only read the
        weights) but must wait for ``response.staging_completion`` before
        ``optimizer.step()`` changes them. The copy then overlaps the next step's compute
        instead of stalling it.

        Refuses (``ValueError``, before anything is copied or sent) ``async_save``'s
        thread executor on the default process group: see :func:`_refuse_the_default_group`.
        """
        _refuse_the_default_group()
        if not self.async_staging:
            return self._staged(state_dict)
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="ckptstore-stage")
        return self._copier.submit(self._staged, state_dict)

    def _staged(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` copied for ``dcp.async_save``, done when this returns: tensors
        into this writer's reused host buffers (a DTensor's local tensor, wrapped again in a
        DTensor of the same spec; a ShardedTensor copied whole, as DCP's own stager does),
        every other leaf deep-copied. Later changes to the trainer's state do not reach it.

        The buffers of the previous save are reused only when nothing else holds them any
        more; else this save stages into new ones (and those are reused from then on).
        """
        staging = self._staging
        if staging is None or staging.held_elsewhere():
            if staging is not None:
                staging.clear()  # its buffers live on in the staged state that holds them
            staging = self._staging = StagingBuffers()
        sources: list[torch.Tensor] = []
        memo: dict[int, int] = {}
        _collect(state_dict, sources, memo)
        flat = FlatState([(str(i), t) for i, t in enumerate(sources)], skeleton="")
        staged = [buf.detach() for _, buf in staging.stage(flat).tensors]
        return _rebuild(state_dict, staged, memo, {})  # type: ignore[no-any-return]

    def close(self) -> None:
        """Free the staging buffers (a later :meth:`stage` makes new ones), after a copy
        still running (``async_staging``)."""
        copier, self._copier = self._copier, None
        if copier is not None:
            copier.shutdown(wait=True)
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.clear()

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            run, step = parse_checkpoint_id(checkpoint_id)
            self.run = run or self.run
            self.step = int(step)
        self.save_id = str(uuid.uuid4())

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            parse_checkpoint_id(checkpoint_id)
        except InvalidRequest:
            return False
        return True

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.step is None:
            raise InvalidRequest(
                "CkptStoreWriter has no step: pass step= or dcp.save(..., checkpoint_id=step)"
            )
        if not kwargs.get("use_collectives", True):
            raise ValueError(
                "CkptStoreWriter commits every rank's part at once, from the coordinator: "
                "dcp.save(use_collectives=False) is not supported"
            )
        rank = kwargs.get("rank")
        self.rank = _rank() if rank is None else int(rank)
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Cut each tensor item along dim 0 at its grid (:func:`grid_cuts`): the items DCP
        plans, dedups and records in the metadata are the pieces."""
        if not plan.usable:
            return plan
        items: list[WriteItem] = []
        shards: dict[MetadataIndex, MetadataIndex] = {}
        for item in plan.items:
            td = item.tensor_data
            if td is None:
                items.append(item)
                continue
            if not td.chunk.sizes:  # a scalar
                items.append(item)
                continue
            itemsize = td.properties.dtype.itemsize
            start, rows = td.chunk.offsets[0], td.chunk.sizes[0]
            cuts = grid_cuts(td.size, itemsize, start, rows, self.grid_bytes)
            if len(cuts) == 1:
                items.append(item)
                continue
            for first, count in cuts:
                offsets = torch.Size([first, *td.chunk.offsets[1:]])
                chunk = ChunkStorageMetadata(offsets, torch.Size([count, *td.chunk.sizes[1:]]))
                index = MetadataIndex(item.index.fqn, offsets)
                # SHARD: DCP takes several items of one tensor only as shards
                piece = WriteItem(
                    index=index,
                    type=WriteItemType.SHARD,
                    tensor_data=dataclasses.replace(td, chunk=chunk),
                )
                items.append(piece)
                shards[index] = item.index
        return dataclasses.replace(plan, items=items, storage_data=_Pieces(shards))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # plans come in rank order; an unusable plan (DCP's plan cache: "no change") keeps
        # the cached final plan and with it the part named the first time
        out = []
        for i, plan in enumerate(plans):
            if plan.usable:
                local = plan.storage_data
                shards = local.shards if isinstance(local, _Pieces) else {}
                part = part_name(i, self.save_id)
                plan = dataclasses.replace(plan, storage_data=_PartPlan(part, shards))
            out.append(plan)
        return out

    def _client(self) -> CheckpointClient:
        return CheckpointClient(self.url, **self.client_options)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        storage = plan.storage_data
        if isinstance(storage, _PartPlan):
            part, shards = storage.part, storage.shards
        else:
            part, shards = part_name(self.rank, self.save_id), {}
        results = self._upload(part, plan.items, shards, planner) if plan.items else []
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _upload(
        self,
        part: str,
        items: Sequence[WriteItem],
        shards: Mapping[MetadataIndex, MetadataIndex],
        planner: SavePlanner,
    ) -> list[WriteResult]:
        """Stream ``items`` as part ``part``: the tensors resolved one at a time, widest
        dtype and largest first (as ``CheckpointClient.save`` orders them), then the
        non-tensor items (small, resolved up front: their size is only known then)."""
        assert self.step is not None
        tensors = [(i, i.tensor_data) for i in items if i.tensor_data is not None]
        tensors.sort(
            key=lambda it: (-it[1].properties.dtype.itemsize, -math.prod(it[1].chunk.sizes))
        )
        payloads = []
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                resolved = planner.resolve_data(item)
                assert isinstance(resolved, io.BytesIO)
                payloads.append((item, resolved.getvalue()))
        specs: list[parts.Spec] = []
        results = []
        for item, td in tensors:
            name = shard_name(item.index.fqn, td.chunk.offsets)
            specs.append((name, dtype_to_wire(td.properties.dtype), tuple(td.chunk.sizes)))
            nbytes = td.properties.dtype.itemsize * math.prod(td.chunk.sizes)
            results.append(WriteResult(item.index, nbytes, StorageInfo(part, name)))
        for item, payload in payloads:
            name = bytes_name(item.index.fqn)
            specs.append((name, "U8", (len(payload),)))
            results.append(WriteResult(item.index, len(payload), StorageInfo(part, name)))

        def data() -> Iterator[memoryview | bytes]:
            for item, td in tensors:
                tensor = _resolve(planner, item, shards.get(item.index))
                if tensor.shape != td.chunk.sizes or tensor.dtype != td.properties.dtype:
                    raise ValueError(
                        f"{item.index.fqn}: the planner resolved a {tensor.dtype} tensor of "
                        f"shape {list(tensor.shape)}; its plan says {td.properties.dtype} "
                        f"{list(td.chunk.sizes)}"
                    )
                yield tensor_bytes(tensor)
                del tensor
            for _, payload in payloads:
                yield payload

        with self._client() as client:
            parts.put_part(client, self.run, self.step, part, specs, data, direct=self.direct)
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        assert self.step is not None
        storage: dict[MetadataIndex, StorageInfo] = {}
        for rank_results in results:
            for result in rank_results:
                storage[result.index] = result.storage_data
        metadata.version = DCP_VERSION
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        text = metadata_to_json(metadata)
        names = list(dict.fromkeys(info.part for info in storage.values()))
        with self._client() as client:
            if not names:  # nothing to write anywhere: the checkpoint is one empty part
                names = [part_name(self.rank, self.save_id)]
                parts.put_part(client, self.run, self.step, names[0], [], lambda: iter(()))
            stored = {METADATA_KEY: text}
            if self.metadata is not None:
                stored[USER_METADATA_KEY] = self.metadata
            parts.commit(client, self.run, self.step, names, stored)


_SAVER = "torch.distributed.checkpoint.state_dict_saver"


def _refuse_the_default_group() -> None:
    """Raise ``ValueError`` when the ``dcp.async_save`` calling the writer's :meth:`stage`
    runs its upload in a thread (the default executor) on the default process group.

    The upload's collectives (plans gathered, results gathered, the commit's broadcast) then
    run on the group training's collectives use, from another thread: the two interleave,
    and gloo aborts (``Received data size doesn't match``) or the ranks wait on each other
    for good. A group of its own (``dist.new_group(backend="gloo")``) or the process executor
    (whose process makes its own group) keeps them apart. ``async_save``'s arguments are
    read from its frame; when no ``async_save`` of torch's calls (a later torch that moved
    it, ``stage`` called directly), nothing is checked."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "async_save" and frame.f_globals.get("__name__") == _SAVER:
            break
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None or not (dist.is_available() and dist.is_initialized()):
        return
    args = frame.f_locals
    kind = args.get("async_checkpointer_type")
    if getattr(kind, "value", kind) != "thread" or args.get("no_dist"):
        return
    group = args.get("process_group")
    if group is not None and group != dist.group.WORLD:
        return
    raise ValueError(
        "dcp.async_save(storage_writer=CkptStoreWriter(...)) on the default process group: "
        "the save's collectives would run in the upload thread beside training's on the same "
        "group, and the ranks abort or hang. Make a group for checkpoints once, on every rank, "
        'and pass it: process_group=dist.new_group(backend="gloo") '
        "(or async_checkpointer_type=AsyncCheckpointerType.PROCESS)"
    )


def _is_sharded_tensor(node: object) -> bool:
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor

    return isinstance(node, ShardedTensor)


def _collect(node: object, out: list[torch.Tensor], memo: dict[int, int]) -> None:
    """The tensors :meth:`CkptStoreWriter.stage` copies into buffers, in traversal order
    (a DTensor's local tensor; each tensor object once: ``memo`` maps its id to its index)."""
    if isinstance(node, dict):
        for value in node.values():
            _collect(value, out, memo)
    elif isinstance(node, list | tuple):
        for value in node:
            _collect(value, out, memo)
    elif isinstance(node, DTensor):
        _collect(node._local_tensor, out, memo)
    elif isinstance(node, torch.Tensor) and not _is_sharded_tensor(node) and id(node) not in memo:
        memo[id(node)] = len(out)
        out.append(node)


def _rebuild(
    node: object, staged: list[torch.Tensor], memo: dict[int, int], done: dict[int, Any]
) -> Any:
    """``node`` with each collected tensor replaced by its ``staged`` copy (requires_grad
    kept: DCP records it), every other leaf deep-copied (``done``: one deepcopy memo for
    all of them, so objects shared between leaves stay shared)."""
    if isinstance(node, dict):
        out = {k: _rebuild(v, staged, memo, done) for k, v in node.items()}
        if type(node) is dict:
            return out
        same = copy.copy(node)  # an OrderedDict, a defaultdict (its factory kept), ...
        same.clear()
        same.update(out)
        return same
    if isinstance(node, list | tuple):
        items = [_rebuild(v, staged, memo, done) for v in node]
        if type(node) in (list, tuple):
            return type(node)(items)
        if hasattr(node, "_fields"):  # a NamedTuple
            return type(node)(*items)
        return copy.deepcopy(node, done)  # another sequence type: left to deepcopy
    if isinstance(node, DTensor):
        local = staged[memo[id(node._local_tensor)]]
        return DTensor(local, node._spec, requires_grad=node.requires_grad)  # type: ignore[no-untyped-call]
    if isinstance(node, torch.Tensor) and id(node) in memo:
        copied = staged[memo[id(node)]]
        return copied.requires_grad_(True) if node.requires_grad else copied
    if _is_sharded_tensor(node):
        assert isinstance(node, torch.Tensor)
        return node.to("cpu") if node.device.type != "cpu" else copy.deepcopy(node, done)
    return copy.deepcopy(node, done)


def _resolve(planner: SavePlanner, item: WriteItem, shard: MetadataIndex | None) -> torch.Tensor:
    """The data of tensor item ``item``: of a grid piece, its rows of the shard ``shard``
    it was cut from (the planner knows the shard, not the piece)."""
    if shard is None:
        tensor = planner.resolve_data(item)
        assert isinstance(tensor, torch.Tensor)
        return tensor.detach()
    tensor = planner.resolve_data(dataclasses.replace(item, index=shard))
    assert isinstance(tensor, torch.Tensor) and item.tensor_data is not None
    assert shard.offset is not None and item.index.offset is not None
    first = item.index.offset[0] - shard.offset[0]
    return tensor.detach().narrow(0, first, item.tensor_data.chunk.sizes[0])


# ------------------------------------------------------------------------------- the reader


class CkptStoreReader(StorageReader):
    """DCP :class:`~torch.distributed.checkpoint.StorageReader` of checkpoint ``step``
    (default ``"latest"``) of run ``run`` of the ckptstore service at ``url``.

    Each rank fetches only the stored pieces that overlap its own tensors, in one request
    (:attr:`bytes_read`: the tensor bytes the last ``read_data`` received).
    ``latest`` is resolved once per load by each rank; if it moved in between (another save
    committed), the load fails before reading anything: pass an explicit step.
    ``direct=True`` (a client option): each rank fetches the stored chunks of its pieces
    (presigned S3 URLs, else through the service unchanged) and decodes them itself
    (:mod:`ckptstore.direct_load`), one piece held at a time, and keeps them as its base
    for its next direct save (``CkptStoreWriter(direct=True)``: a delta at once).
    """

    def __init__(
        self, url: str, run: str, step: int | str = "latest", **client_options: Any
    ) -> None:
        super().__init__()
        self.url = url
        self.run = check_run_name(run)
        self.step: int | str = parse_checkpoint_id(step, allow_latest=True)[1]
        self.client_options = dict(client_options)
        self.served_step: int | None = None  # the step read_metadata found
        self.storage_data: dict[MetadataIndex, StorageInfo] = {}
        self.load_id = str(uuid.uuid4())
        self.bytes_read = 0  # tensor bytes the last read_data received

    @property
    def checkpoint_id(self) -> str:
        return f"{self.run}/{self.step}"

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            run, step = parse_checkpoint_id(checkpoint_id, allow_latest=True)
            self.run = run or self.run
            self.step = step
        self.served_step = None
        self.storage_data = {}
        self.load_id = str(uuid.uuid4())

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            parse_checkpoint_id(checkpoint_id, allow_latest=True)
        except InvalidRequest:
            return False
        return True

    def _client(self) -> CheckpointClient:
        return CheckpointClient(self.url, **self.client_options)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            # DCP's fallback to per-rank metadata (saves without collectives): none here
            raise FileNotFoundError("ckptstore keeps no per-rank DCP metadata")
        with self._client() as client:
            metadata, self.served_step = _read_metadata(client, self.run, self.step)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if metadata.storage_data is None:
            raise CorruptData("DCP metadata without storage_data")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        plan.storage_data = self.served_step
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        steps = {p.storage_data for p in plans}
        if len(steps) > 1:
            raise InvalidRequest(
                f"the ranks read different checkpoints of run {self.run!r} (steps "
                f"{sorted(steps)}): 'latest' moved during the load; pass an explicit step"
            )
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_name: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_name.setdefault(self.storage_data[item.storage_index].name, []).append(item)

        def consume(spec: TensorSpec, data: memoryview) -> None:
            for item in by_name[spec.name]:
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(bytes(data)))
                    continue
                stored = tensor_from_bytes(data, spec.dtype, spec.shape)
                source = narrow_tensor_by_index(stored, item.storage_offsets, item.lengths)
                target = planner.resolve_tensor(item).detach()
                if target.size() != source.size():
                    raise CorruptData(
                        f"{spec.name}: region {list(source.size())} does not fit its "
                        f"destination {list(target.size())}"
                    )
                target.copy_(source)
                planner.commit_tensor(item, target)

        self.bytes_read = 0
        if by_name:
            assert self.served_step is not None
            with self._client() as client:
                self.bytes_read = parts.select(
                    client, self.run, self.served_step, by_name, consume, direct=client.direct
                )
        future: Future[None] = Future()
        future.set_result(None)
        return future


def _read_metadata(client: CheckpointClient, run: str, step: int | str) -> tuple[Metadata, int]:
    """DCP's metadata of checkpoint ``run/step`` and the step it is (``latest`` resolved)."""
    found = parts.info(client, run, step)
    served = int(found["checkpoint"]["step"])
    text = found.get("metadata", {}).get(METADATA_KEY)
    if text is None:
        raise InvalidRequest(
            f"checkpoint {run}/{served} was not saved through DCP (no {METADATA_KEY!r} "
            "metadata): load it with CheckpointClient.load"
        )
    try:
        return metadata_from_json(text), served
    except ValueError as exc:
        raise CorruptData(f"checkpoint {run}/{served}: {exc}") from exc


def load_full(
    url: str,
    run: str,
    step: int | str = "latest",
    *,
    prefix: str | None = None,
    map_location: Any = "cpu",
    direct: bool | None = None,
    **client_options: Any,
) -> dict[str, Any]:
    """The full, unsharded state dict of DCP checkpoint ``step`` of ``run``, in one process
    without a process group (evaluation, conversion): what ``get_state_dict(...,
    options=StateDictOptions(full_state_dict=True))`` gave at save time, nested as saved.
    ``prefix`` keeps the entries whose flattened name (``"model.layer.weight"``) starts
    with it and fetches only their shards. ``direct=True``: the stored chunks are fetched
    (straight from S3 through presigned URLs, else through the service unchanged) and
    decoded here, as ``CheckpointClient(direct=True).load`` does; nothing is kept as a base
    for a later save (a full load is no rank's resume)."""
    with CheckpointClient(url, direct=direct, **client_options) as client:
        tensors, header_metadata, served = fetch_tensors(
            client.transport, run, step, prefix, map_location, client.progress, client.direct
        )
    if header_metadata.get(LAYOUT_KEY) != FULL:
        raise InvalidRequest(
            f"checkpoint {run}/{served} was not saved through DCP (no {METADATA_KEY!r} "
            "layout): load it with CheckpointClient.load"
        )
    state = full_state_if_dcp(tensors, header_metadata, map_location)
    assert isinstance(state, dict)
    return state
