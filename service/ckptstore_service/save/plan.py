"""The delta plan of a save on the service: the run's parent checkpoint and the settings
made into a :class:`ckptstore_core.pipeline.DeltaPlanner` (the planner itself, shared with
clients that encode their own chunks, is in the core)."""

from __future__ import annotations

from collections.abc import Collection

from ckptstore_core.pipeline import ChunkInfo, DeltaPlanner, LossySave, TensorInfo
from ckptstore_core.wire import Header
from ckptstore_service.catalog import Catalog, CheckpointRecord
from ckptstore_service.settings import Settings

__all__ = ["keyframe_after", "parent_rows", "planner_for"]


def keyframe_after(parent: CheckpointRecord | None, settings: Settings) -> tuple[bool, int]:
    """Whether the save after ``parent`` (None: the run's first) is a keyframe (one every
    ``keyframe_interval`` checkpoints), and the ``since_keyframe`` it records."""
    if parent is None:
        return True, 0
    since = parent.since_keyframe + 1
    keyframe = since >= settings.keyframe_interval
    return keyframe, 0 if keyframe else since


def parent_rows(
    catalog: Catalog, parent: CheckpointRecord, names: Collection[str] | None = None
) -> tuple[dict[int, TensorInfo], list[ChunkInfo]]:
    """The parent's tensors (by index) and their chunks; with ``names``, only those of the
    tensors of these names (a part of many: the rest of the parent is other writers')."""
    tensors = {t.idx: t for t in catalog.tensors(parent.id, names)}
    chunks = catalog.chunks(parent.id, None if names is None else tensors.keys())
    return tensors, chunks


def planner_for(
    catalog: Catalog,
    settings: Settings,
    header: Header,
    parent: CheckpointRecord | None,
    lossy: LossySave | None = None,
    *,
    same_names: bool = False,
) -> tuple[DeltaPlanner, dict[int, TensorInfo]]:
    """The delta planner of a save of ``header`` after ``parent`` (None: the run's first),
    and the parent's tensors by index (:func:`keyframe_after`, :func:`parent_rows`);
    ``lossy``: what a lossy save asks for (its chunks need a base: none on a first save).
    ``same_names``: read only the parent's tensors named as the header's."""
    if parent is None:
        return DeltaPlanner(header, keyframe=True, since_keyframe=0, max_chain_depth=0), {}
    keyframe, since = keyframe_after(parent, settings)
    names = {t.name for t in header.tensors} if same_names else None
    tensors, chunks = parent_rows(catalog, parent, names)
    planner = DeltaPlanner(
        header,
        keyframe=keyframe,
        since_keyframe=since,
        max_chain_depth=settings.max_chain_depth,
        parent_tensors=tensors,
        parent_chunks=chunks,
        lossy=lossy,
        lossy_max_depth=settings.lossy_max_chain_depth,
    )
    return planner, tensors
