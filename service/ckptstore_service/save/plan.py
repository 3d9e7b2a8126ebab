"""The delta plan of a save on the service: the run's parent checkpoint and the settings
made into a :class:`ckptstore_core.pipeline.DeltaPlanner` (the planner itself, shared with
clients that encode their own chunks, is in the core)."""

from __future__ import annotations

from ckptstore_core.pipeline import DeltaPlanner, LossySave, TensorInfo
from ckptstore_core.wire import Header
from ckptstore_service.catalog import Catalog, CheckpointRecord
from ckptstore_service.settings import Settings

__all__ = ["planner_for"]


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
    and the parent's tensors by index. A keyframe every ``keyframe_interval`` checkpoints;
    ``lossy``: what a lossy save asks for (its chunks need a base: none on a first save).
    ``same_names``: read only the parent's tensors named as the header's (a part of many:
    the rest of the parent is other writers')."""
    if parent is None:
        return DeltaPlanner(header, keyframe=True, since_keyframe=0, max_chain_depth=0), {}
    names = {t.name for t in header.tensors} if same_names else None
    tensors = {t.idx: t for t in catalog.tensors(parent.id, names)}
    since = parent.since_keyframe + 1
    keyframe = since >= settings.keyframe_interval
    planner = DeltaPlanner(
        header,
        keyframe=keyframe,
        since_keyframe=0 if keyframe else since,
        max_chain_depth=settings.max_chain_depth,
        parent_tensors=tensors,
        parent_chunks=catalog.chunks(parent.id, None if names is None else tensors.keys()),
        lossy=lossy,
        lossy_max_depth=settings.lossy_max_chain_depth,
    )
    return planner, tensors
