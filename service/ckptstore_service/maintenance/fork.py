"""Forking a checkpoint into a new run without copying its bytes (docs/lifecycle.md, Forks).

``fork(src_run, src_step, new_run)`` commits checkpoint ``src_step`` of ``new_run`` whose
tensors are the source's and whose every chunk is a *ref* to the source's chunk at the same
place (codec ``ref``, no stored bytes): it loads to exactly the source's bytes, and its blob
is empty. A ref's base is never itself a ref: where the source chunk is a ref, the fork's
points at what that one points at. The new run's later saves take the fork as their parent
and diff against it as against any checkpoint (a ref in the parent leads the delta planner to
the chunk it equals), so a fine-tune's first save costs about a delta.

The source's chunks then have dependents in another run. A delete of the source
checkpoint, or of the whole source run, or retention on it, re-bases them first
(:mod:`.delete` takes the fork's run's locks too), so the fork never loses a byte.

What keeps it safe: the source run's lock is held from the first read to the commit (no
delete or re-root of the source changes its chunks meanwhile), then the new run's (no save
to it interleaves). The commit follows the upload protocol: a ``writing`` row names the
empty blob before it is written, so a crash at any point leaves nothing the next
collection does not find.
"""

from __future__ import annotations

import logging

from ckptstore_core import codec
from ckptstore_core.errors import CheckpointExists, InvalidRequest, RunBusy
from ckptstore_service.catalog import Catalog, CheckpointRecord, ChunkInfo, NewChunk
from ckptstore_service.names import blob_key
from ckptstore_service.storage import BlobStore

__all__ = ["fork_checkpoint", "fork_chunks"]

log = logging.getLogger("ckptstore")


def fork_chunks(source: list[ChunkInfo]) -> list[NewChunk]:
    """The fork's chunks: a ref to each of ``source`` (or to what it refers to, if it is a
    ref itself), at the same place, with its checksum and depth, storing nothing."""
    out = []
    for c in source:
        base = c.base_id if c.codec == codec.REF else c.id
        out.append(
            NewChunk(
                tensor_idx=c.tensor_idx,
                offset=c.offset,
                raw_len=c.raw_len,
                itemsize=c.itemsize,
                codec=codec.REF,
                base_id=base,
                depth=c.depth,
                blob_offset=0,
                stored_len=0,
                checksum=c.checksum,
            )
        )
    return out


def _is_fork_of(catalog: Catalog, mine: CheckpointRecord, source: CheckpointRecord) -> bool:
    """Whether ``mine`` is a fork of ``source`` as :func:`fork_checkpoint` makes it: a
    retried fork whose first answer was lost finds it and is answered as done."""
    if mine.step != source.step or mine.parent_step is not None:
        return False
    want = fork_chunks(catalog.chunks(source.id))
    have = catalog.chunks(mine.id)
    fields = NewChunk.__slots__
    return len(want) == len(have) and all(
        all(getattr(w, f) == getattr(h, f) for f in fields) for w, h in zip(want, have, strict=True)
    )


def fork_checkpoint(
    catalog: Catalog, store: BlobStore, src_run: str, src_step: int, new_run: str
) -> tuple[CheckpointRecord, bool]:
    """Fork checkpoint ``src_step`` of ``src_run`` into ``new_run`` (see the module's
    docstring); returns the new checkpoint and whether it was made now (False: ``new_run``
    already held exactly this fork, a retry). RunNotFound / CheckpointNotFound for an absent
    source, CheckpointExists (409) if ``new_run`` has checkpoints, InvalidRequest for a fork
    of a run into itself, RunBusy while ``new_run`` has a checkpoint being written in parts.
    """
    if src_run == new_run:
        raise InvalidRequest(f"a fork makes a new run: {new_run!r} is its source's name")
    with catalog.run_lock(src_run), catalog.run_lock(new_run):
        source = catalog.get(src_run, src_step)
        existing = catalog.find(new_run, None)
        if existing is not None:
            if (
                _is_fork_of(catalog, existing, source)
                and len(catalog.list_checkpoints(new_run)) == 1
            ):
                return existing, False
            raise CheckpointExists(
                f"run {new_run!r} has checkpoints already: a fork makes a new run "
                f"(delete it first, or name another)"
            )
        step = catalog.open_parts_step(new_run)
        if step is not None:
            raise RunBusy(f"run {new_run!r} has a checkpoint being written in parts (step {step})")
        made = _commit_fork(catalog, store, source, new_run)
    log.info(
        "forked %s/%d into %s: %d tensors, no bytes copied",
        src_run,
        src_step,
        new_run,
        made.tensors,
    )
    return made, True


def _commit_fork(
    catalog: Catalog, store: BlobStore, source: CheckpointRecord, new_run: str
) -> CheckpointRecord:
    """Write the fork's empty blob and commit its rows (the upload protocol)."""
    chunks = fork_chunks(catalog.chunks(source.id))
    key = blob_key(new_run, source.step)
    checkpoint_id = catalog.begin_upload(catalog.ensure_run(new_run), source.step, key)
    store.put_stream(key, iter(()))
    depth = max((c.depth for c in chunks), default=0)
    catalog.commit_upload(
        checkpoint_id,
        parent_id=None,
        keyframe=depth == 0,
        chain_depth=depth,
        since_keyframe=0,
        raw_bytes=source.raw_bytes,
        stored_bytes=0,
        metadata=source.stored_metadata,
        tensors=catalog.tensors(source.id),
        chunks=chunks,
        lossy=source.lossy,  # it loads to the source's reconstruction
    )
    return catalog.get(new_run, source.step)
