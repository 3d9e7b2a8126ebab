"""The delta planner of a save: what each chunk may be encoded against, and how the stored
chunk then links into the chain.

* **Base:** the chunk at the same place (name, dtype, shape, offset, length) in the parent
  checkpoint, if there is one. A ref in the parent points at the chunk it equals, so the
  base is that chunk. The chunk may be a delta of its base unless the save is a keyframe
  (every ``keyframe_interval`` checkpoints) or the base's chain is ``max_chain_depth`` deep.
* **Cast source:** a bf16/f16 tensor that pairs with exactly one fp32 tensor of the same
  checkpoint (same shape, same name below the first path component: ``model/fc.weight``
  with ``master/fc.weight``) is first predicted as the rounding of its fp32 chunk, which
  therefore must be in the new cache file first: :class:`CastFrom` carries the event that
  says so. Clients send fp32 tensors first.
* **Lossy** (a save that asks for it, docs/lossy.md): the fp32 weights and Adam moments that
  :func:`ckptstore_core.lossy.pair_tensors` pairs get a :class:`LossyChunk` when they have a
  base no more than ``lossy_max_depth`` deep, keyframe save or not (a keyframe would store
  them exact, which is what the lossy tier is there to avoid): their role, the parameters,
  and where the parent's reconstructed ``exp_avg_sq`` over the same elements lies (the
  importance of each element). The encoder may still store such a chunk losslessly (exact
  moments, a small chunk, no base): then the usual rules apply.
* **Link:** once encoded, a ref, delta or lossy chunk rests on its base (depth + 1 for a
  delta or a lossy chunk); a copy predicted from its master rests on that chunk of the same
  checkpoint (a *sibling*).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ckptstore_core import codec, lossy
from ckptstore_core.lossy import Lossy
from ckptstore_core.pipeline.rows import ChunkInfo, TensorInfo
from ckptstore_core.pipeline.split import RawChunk
from ckptstore_core.records import LOSSY_KEY, PARAM_NAMES_KEY
from ckptstore_core.wire import Header

__all__ = [
    "BaseChunk",
    "CastFrom",
    "ChunkPlan",
    "DeltaPlanner",
    "Link",
    "LossyChunk",
    "LossySave",
    "lossy_params",
    "rests_on_base",
    "same_offsets",
]

_Place = tuple[str, str, tuple[int, ...], int, int]  # name, dtype, shape, offset, length


@dataclass(frozen=True, slots=True)
class BaseChunk:
    chunk_id: int  # a non-ref chunk (refs point straight at what they equal)
    depth: int
    file_offset: int  # of the chunk's raw bytes in the parent's data section


@dataclass(frozen=True, slots=True)
class CastFrom:
    """A bf16/f16 chunk predicted from the fp32 chunk ``source`` of the same checkpoint."""

    dtype: str  # BF16 or F16
    source: tuple[int, int]  # (tensor index, offset) of the fp32 chunk
    file_offset: int  # of the fp32 chunk in the new cache file
    length: int
    written: threading.Event  # set once the fp32 chunk is in the cache file


@dataclass(frozen=True, slots=True)
class LossyChunk:
    """A chunk that may be stored lossy against its (planned) base."""

    role: lossy.Role
    params: lossy.Lossy
    # the parent's chunk of the paired exp_avg_sq over the same elements (its reconstruction
    # is read like a base), None if the parent has none
    v_prev: BaseChunk | None


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    base: BaseChunk | None
    delta: bool  # may be a delta of ``base`` (a ref to it is always allowed)
    cast: CastFrom | None
    written: threading.Event | None  # to set once this chunk is in the cache file
    lossy: LossyChunk | None = None  # may be stored lossy against ``base``


def lossy_params(metadata: Mapping[str, str]) -> Lossy | None:
    """The lossy parameters a save's header asks for under ``ckptstore.lossy`` (None: a
    bit-exact save); InvalidRequest (400) for a value that is neither ``true`` nor an object
    of known parameters in range. ``false`` asks for a bit-exact save."""
    text = metadata.get(LOSSY_KEY)
    if text is None:
        return None
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        value = text  # Lossy.from_json words the error
    return None if value is False else Lossy.from_json(value)


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


@dataclass(frozen=True)
class LossySave:
    """What a lossy save asks for: its parameters, and the paired tensors of its header
    (by index): each one's role and the index of its pair's ``exp_avg_sq`` (None: none);
    ``pairing``: what was paired and what was not (the checkpoint's listing says it)."""

    params: lossy.Lossy
    roles: dict[int, tuple[lossy.Role, int | None]]
    pairing: lossy.Pairing | None = None

    @classmethod
    def asked(cls, header: Header) -> LossySave | None:
        """What the save of ``header`` asks for (``ckptstore.lossy`` in its metadata,
        checked when the header was read), None for a bit-exact save."""
        params = lossy_params(header.metadata)
        if params is None:
            return None
        skeleton = header.metadata.get("skeleton")
        names = header.metadata.get(PARAM_NAMES_KEY)
        return cls.of(header, params, None if skeleton is None else json.loads(skeleton), names)

    @classmethod
    def of(
        cls, header: Header, params: lossy.Lossy, skeleton: object, names: str | None = None
    ) -> LossySave:
        """The paired tensors of ``header`` (``skeleton``: its parsed skeleton, or None;
        ``names``: what the client said about its parameters, ``ckptstore.param_names``)."""
        specs = [(t.name, t.dtype, t.shape) for t in header.tensors]
        index = {t.name: i for i, t in enumerate(header.tensors)}
        roles: dict[int, tuple[lossy.Role, int | None]] = {}
        pairing = lossy.pairing(specs, skeleton, names)
        for pair in pairing.pairs:
            v = None if pair.exp_avg_sq is None else index.get(pair.exp_avg_sq)
            named: list[tuple[lossy.Role, str | None]] = [
                ("weight", pair.weight),
                ("exp_avg", pair.exp_avg),
                ("exp_avg_sq", pair.exp_avg_sq),
            ]
            for role, name in named:
                i = None if name is None else index.get(name)
                # checked here too: a chunk of a paired tensor reads its pair's at its offset
                if (
                    i is not None
                    and header.tensors[i].dtype == "F32"
                    and (v is None or header.tensors[v].shape == header.tensors[i].shape)
                ):
                    roles.setdefault(i, (role, v))
        return cls(params, roles, pairing)


def rests_on_base(encoded_as: str) -> bool:
    """Whether a chunk stored as codec ``encoded_as`` is decoded from its base: a delta or a
    lossy chunk (its residual against the base's reconstruction)."""
    return encoded_as == lossy.LOSSY or codec.is_delta(encoded_as)


@dataclass(frozen=True, slots=True)
class Link:
    base_id: int | None  # None: self-contained, or a copy of a sibling
    depth: int
    sibling: int | None  # index (in the save's chunk list) of the master it is a copy of


def same_offsets(parent: Iterable[TensorInfo], header: Header) -> bool:
    """Whether every tensor of ``header`` that the parent also has (same name, dtype and
    shape) lies at the same offset in both data sections. Then each chunk's base sits where
    the chunk itself goes: a save can overwrite its base file in place, each chunk right
    after reading its base, and nothing it still has to read is overwritten first."""
    begins = {(t.name, t.dtype, t.shape): t.begin for t in parent}
    return all(begins.get((t.name, t.dtype, t.shape), t.begin) == t.begin for t in header.tensors)


def cast_sources(header: Header) -> dict[int, int]:
    """bf16/f16 tensors (index) that look like rounded copies of an fp32 tensor (index)."""
    fp32: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    sources = {}
    for i, t in enumerate(header.tensors):
        tail = t.name.partition("/")[2]
        if not tail or not t.nbytes:
            continue
        if t.dtype == "F32":
            fp32.setdefault((tail, t.shape), []).append(i)
        elif t.dtype in codec.CASTS:
            found = fp32.get((tail, t.shape), [])
            if len(found) == 1:
                sources[i] = found[0]
    return sources


class DeltaPlanner:
    """Plans the chunks of one save, in stream order, then links them as they are stored.

    ``parent_tensors`` (by index) and ``parent_chunks`` describe the parent checkpoint
    (none for a run's first save); ``keyframe`` says whether chunks may be deltas at all and
    ``since_keyframe`` what the checkpoint will record. Not thread-safe: the ingest thread
    alone calls it.
    """

    def __init__(
        self,
        header: Header,
        *,
        keyframe: bool,
        since_keyframe: int,
        max_chain_depth: int,
        parent_tensors: dict[int, TensorInfo] | None = None,
        parent_chunks: Iterable[ChunkInfo] = (),
        lossy: LossySave | None = None,
        lossy_max_depth: int = 0,
    ) -> None:
        self._header = header
        self.keyframe = keyframe
        self.since_keyframe = since_keyframe  # what the checkpoint records, unless keyframe
        self._max_depth = max_chain_depth
        self._lossy = lossy
        self._lossy_max_depth = lossy_max_depth
        #: the tensors that may hold lossy chunks (their checksums are the reconstruction's)
        self.lossy_tensors = frozenset(() if lossy is None else lossy.roles)
        self._bases: dict[_Place, BaseChunk] = {}
        for c in parent_chunks:
            assert parent_tensors is not None
            t = parent_tensors[c.tensor_idx]
            target = c.base_id if c.codec == codec.REF else c.id
            assert target is not None
            place = (t.name, t.dtype, t.shape, c.offset, c.raw_len)
            self._bases[place] = BaseChunk(target, c.depth, t.begin + c.offset)
        self._sources = cast_sources(header)
        self._masters = set(self._sources.values())
        self._written: dict[tuple[int, int], threading.Event] = {}
        self._stored: dict[tuple[int, int], tuple[int, int]] = {}  # -> (index, depth)

    def plan(self, c: RawChunk) -> ChunkPlan:
        spec = self._header.tensors[c.tensor_idx]
        base = self._bases.get((spec.name, spec.dtype, spec.shape, c.offset, c.raw_len))
        delta = not self.keyframe and base is not None and base.depth < self._max_depth
        cast = None
        source = self._sources.get(c.tensor_idx)
        if source is not None:
            src_begin = c.offset // c.itemsize * 4
            cast = CastFrom(
                spec.dtype,
                (source, src_begin),
                self._header.tensors[source].begin + src_begin,
                c.raw_len // c.itemsize * 4,
                self._written[(source, src_begin)],
            )
        written = None
        if c.tensor_idx in self._masters:
            written = self._written[(c.tensor_idx, c.offset)] = threading.Event()
        return ChunkPlan(base, delta, cast, written, self._lossy_plan(c, base))

    def _lossy_plan(self, c: RawChunk, base: BaseChunk | None) -> LossyChunk | None:
        if self._lossy is None or base is None or base.depth >= self._lossy_max_depth:
            return None
        found = self._lossy.roles.get(c.tensor_idx)
        if found is None:
            return None
        role, v = found
        v_prev = None
        if v is not None:
            t = self._header.tensors[v]
            # the same elements: the pair has this tensor's shape and dtype, so its chunks
            # are cut at the same offsets
            v_prev = self._bases.get((t.name, t.dtype, t.shape, c.offset, c.raw_len))
        return LossyChunk(role, self._lossy.params, v_prev)

    def link(self, c: RawChunk, plan: ChunkPlan, encoded_as: str) -> Link:
        """How chunk ``c``, planned as ``plan`` and encoded as codec ``encoded_as``, rests
        on what it was encoded against; call in stream order, once per chunk."""
        sibling = None
        base_id, depth = None, 0
        if plan.cast is not None and codec.split_cast(encoded_as):
            sibling, master_depth = self._stored[plan.cast.source]
            depth = master_depth + 1
        elif encoded_as == codec.REF or rests_on_base(encoded_as):
            assert plan.base is not None
            base_id = plan.base.chunk_id
            depth = plan.base.depth + rests_on_base(encoded_as)
        self._stored[(c.tensor_idx, c.offset)] = (len(self._stored), depth)
        return Link(base_id, depth, sibling)
