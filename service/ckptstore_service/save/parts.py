"""Checkpoints written in parts by several writers (the ranks of a distributed save), then
committed once.

A part goes through the same stages as a single writer's save (header, split, plan,
encode, upload transaction), with two differences: no run lock is held while it streams
(the ranks upload at the same time, through any replica), and it writes no base-cache file
(no writer holds the whole checkpoint). Its bases come from the parent's cache file when
this replica holds it (the replica that committed the parent decodes it into the cache in
the background: :mod:`ckptstore_service.cache_policy`), else they are decoded from
storage. Each chunk is diffed against the chunk at the same place of
the tensor of the same name in the run's previous committed checkpoint, so a distributed
run that names its shards the same way at each save pays deltas, like a single writer.

While a part streams, its part lock is held (across replicas): a ``writing`` part whose lock
is free has no writer, and its blob is collected. The commit takes the run's lock, checks
that every named part is done, and makes the checkpoint visible in one transaction.

A step committed already takes parts and commits of the same content again, storing nothing
(a save whose answer was lost, retried under a new save token, maybe by another world size:
:mod:`ckptstore_service.save.committed` defines *the same*); other content is a 409. A
writer learns either before it sends a part's body (:meth:`PartSaver.check`: its header,
then the checksums of its tensors once the step is known to be committed).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence

from ckptstore_core.assemble import layout_view
from ckptstore_core.codec import Buffer
from ckptstore_core.dcp_layout import METADATA_KEY
from ckptstore_core.errors import CheckpointExists, InvalidRequest
from ckptstore_core.pipeline import BaseReader, ChunkPipeline, FileBases
from ckptstore_core.records import LOSSY_KEY, USER_METADATA_KEY, decode_user_metadata
from ckptstore_core.wire import Header
from ckptstore_service.cache_policy import CachePolicy
from ckptstore_service.catalog import Catalog, CheckpointRecord, Lease, PartRecord
from ckptstore_service.chains import ChainDecoder, StoredBases
from ckptstore_service.maintenance.garbage import delete_blob
from ckptstore_service.metrics import Metrics
from ckptstore_service.names import check_part_name
from ckptstore_service.restore import tensors_of
from ckptstore_service.save.committed import (
    ReadTensors,
    check_commit,
    check_digests,
    check_part,
)
from ckptstore_service.save.header import (
    Incoming,
    header_of,
    open_body,
    same_content,
    wait_for_data,
)
from ckptstore_service.save.plan import keyframe_after, planner_for
from ckptstore_service.save.upload import PartTransaction
from ckptstore_service.settings import Settings
from ckptstore_service.storage import BlobStore

__all__ = ["PartSaver", "unstored_part"]

log = logging.getLogger("ckptstore")

_NO_LOSSY_PARTS = (
    "a checkpoint written in parts cannot be lossy (ckptstore.lossy): save it from one "
    "writer, or save it exact (docs/lossy.md)"
)


class PartSaver:
    """Stores the parts of checkpoints and commits them (see the module's docstring)."""

    def __init__(
        self,
        catalog: Catalog,
        store: BlobStore,
        cache: CachePolicy,
        chunks: ChunkPipeline,
        settings: Settings,
        scratch: os.PathLike[str],
        keep_budget: int,
        metrics: Metrics,
        read: ReadTensors,
    ) -> None:
        self._catalog = catalog
        self._store = store
        self._cache = cache
        self._chunks = chunks
        self._settings = settings
        self._scratch = scratch
        self._keep_budget = keep_budget
        self._metrics = metrics
        self._read = read

    def ingest_part(
        self, run: str, step: int, name: str, body: Iterable[Buffer], content_length: int | None
    ) -> tuple[PartRecord, bool]:
        """Store part ``name`` of ``run/step``; returns (part, created). ``created`` is False
        for a retry with the same content, also of a step committed already (then nothing
        is stored: the record says ``stored_bytes`` 0); other content raises
        CheckpointExists, as does a part that is being uploaded right now."""
        check_part_name(name)
        s = self._settings
        # no lock before the first tensor bytes arrive (see Saver.ingest)
        incoming = wait_for_data(open_body(body, content_length, s))
        if LOSSY_KEY in incoming.header.metadata:
            raise InvalidRequest(_NO_LOSSY_PARTS)
        checkpoint_id, committed = self.open_checkpoint(run, step)
        if committed is not None:
            return self._committed_again(committed, name, incoming), False
        with self._catalog.part_lock(run, step, name, blocking=False) as held:
            if held is None:
                raise CheckpointExists(f"part {name!r} of {run}/{step} is being uploaded")
            existing = self._catalog.find_part(checkpoint_id, name)
            if existing is not None and existing.status == "done":
                stored = self._catalog.part_tensors(existing)
                conflict = f"part {name!r} of {run}/{step} holds other data"
                same_content(stored, None, incoming, conflict)
                return existing, False
            if existing is not None:  # a crashed upload of this part: its lock is free
                self.collect(existing)
            self._store_part(run, step, checkpoint_id, name, incoming, held)
        part = self._catalog.find_part(checkpoint_id, name)
        assert part is not None
        self._metrics.part_saved(part)
        return part, True

    def open_checkpoint(self, run: str, step: int) -> tuple[int, CheckpointRecord | None]:
        """The id of the ``parts`` row of ``run/step`` (made if there is none), or the
        step's checkpoint if it is committed already (then the id is 0). Once the first part
        made the row, the others find it without the run's lock: 1,024 ranks queued on it
        one by one (bench/control_plane.py: parts p99 44 s); a commit landing meanwhile
        fails their finish (CheckpointExists)."""
        found = self._catalog.open_parts_of(run, step)
        if found is not None:
            return found, None
        run_id = self._catalog.ensure_run(run)
        with self._catalog.run_lock(run):
            committed = self._catalog.find(run, step)
            if committed is not None:
                return 0, committed
            return self._catalog.open_parts(run_id, step), None

    def check(
        self, run: str, step: int, name: str, text: str, checksums: Mapping[str, str] | None
    ) -> tuple[bool, PartRecord | None]:
        """Whether part ``name`` of ``run/step`` (``text``: its safetensors header;
        ``checksums``: the xxh3-128 hex of each tensor's bytes by name, or None) needs its
        body sent: ``(False, None)`` while the step is not committed (send it); once it is,
        ``(True, record)`` of a part compared and not stored when it holds the committed
        content, ``(True, None)`` when its tensors lie in the committed checkpoint but no
        checksums came to compare (ask again with them); CheckpointExists naming the first
        tensor that differs. The stored regions a part of another rank layout covers are
        read back and hashed, as its upload would have them."""
        check_part_name(name)
        header = header_of(text.encode(), self._settings)
        if LOSSY_KEY in header.metadata:
            raise InvalidRequest(_NO_LOSSY_PARTS)
        digests = None if checksums is None else _digests(header, checksums)
        info = self._catalog.find(run, step)
        if info is None:
            return False, None
        what = f"part {name!r} of {run}/{step}, which is committed already"
        stored = tensors_of(self._catalog, info)
        check_digests(info, stored, header.tensors, digests, self._read, what)
        if digests is None:
            return True, None
        log.info("part %s of %s/%d: committed already, the same checksums", name, run, step)
        return True, unstored_part(info.id, name, header)

    def _committed_again(self, info: CheckpointRecord, name: str, incoming: Incoming) -> PartRecord:
        """Part ``name`` of checkpoint ``info``, committed already, compared with it and not
        stored (CheckpointExists for other content); a record of what it held."""
        what = f"part {name!r} of {info.run}/{info.step}, which is committed already"
        check_part(info, tensors_of(self._catalog, info), incoming, self._read, what)
        header = incoming.header
        log.info("part %s of %s/%d: committed already, the same content", name, info.run, info.step)
        return unstored_part(info.id, name, header)

    def _store_part(
        self,
        run: str,
        step: int,
        checkpoint_id: int,
        name: str,
        incoming: Incoming,
        lease: Lease,
    ) -> None:
        header = incoming.header
        parent = self._catalog.parent_of(run, step)
        planner, _ = planner_for(self._catalog, self._settings, header, parent)
        # the raw bytes go to an unnamed scratch file: a bf16 copy's prediction reads its
        # fp32 master there (no part is ever a base-cache file)
        with (
            self._bases(run, parent) as bases,
            tempfile.TemporaryFile(dir=self._scratch) as raw,
            PartTransaction.begin(
                self._catalog, self._store, run, step, checkpoint_id, name, lease
            ) as tx,
        ):
            stored = self._chunks.run(header, incoming.pieces, planner, bases, raw.fileno(), tx)
            stored_bytes = tx.finish()
            tx.commit(
                raw_bytes=header.data_len,
                stored_bytes=stored_bytes,
                tensors=stored.tensors,
                chunks=stored.chunks,
                sibling_bases=stored.siblings,
            )
        log.info(
            "saved part %s of %s/%d: %d -> %d bytes", name, run, step, header.data_len, stored_bytes
        )

    @contextlib.contextmanager
    def _bases(self, run: str, parent: CheckpointRecord | None) -> Iterator[BaseReader | None]:
        """Where the part's bases are read: the parent's cache file if this replica holds
        it, else storage (None: a run's first checkpoint has no bases)."""
        if parent is None:
            yield None
            return
        with self._cache.part_base(run, parent) as fd:
            if fd is not None:
                yield FileBases(fd)
                return
            _, closure = self._catalog.chunk_tree(parent.id)
            yield StoredBases(ChainDecoder(self._store, closure, self._keep_budget))

    def commit(
        self, run: str, step: int, names: Sequence[str], metadata: Mapping[str, str]
    ) -> tuple[CheckpointRecord, bool]:
        """Make ``run/step`` visible, made of the parts ``names`` in that order; returns
        (record, created). A retried commit of the same parts is ``created=False``, as is a
        commit of other parts with the same content (:func:`check_commit`: a save retried
        under a new token); parts uploaded but not named are deleted."""
        for name in names:
            check_part_name(name)
        with self._catalog.run_lock(run) as lease:
            existing = self._catalog.find(run, step)
            if existing is not None:
                committed = self._catalog.committed_parts(existing.id)
                check_commit(existing, committed, names, metadata)
                return existing, False
            if LOSSY_KEY in metadata:
                raise InvalidRequest(_NO_LOSSY_PARTS)
            if USER_METADATA_KEY in metadata:
                try:
                    decode_user_metadata(metadata[USER_METADATA_KEY])
                except ValueError as exc:
                    raise InvalidRequest(f"{USER_METADATA_KEY!r}: {exc}") from None
            if METADATA_KEY in metadata:
                self._check_layout(run, step, names, metadata[METADATA_KEY])
            parent = self._catalog.parent_of(run, step)
            keyframe, since = keyframe_after(parent, self._settings)
            unnamed = self._catalog.commit_parts(
                run,
                step,
                names,
                parent_id=None if parent is None else parent.id,
                keyframe=keyframe,
                since_keyframe=since,
                metadata=dict(metadata),
                fence=lease,
            )
        for part in unnamed:
            self.collect(part)
        record = self._catalog.get(run, step)
        self._metrics.committed(record)
        if record.verification == "service":
            # the new latest: its loads and its successor's parts (a checkpoint its writers
            # encoded is not decoded here for it: that is the work they took off the service)
            self._cache.warm(record)
        return record, True

    def _check_layout(self, run: str, step: int, names: Sequence[str], text: str) -> None:
        """InvalidRequest unless DCP metadata ``text`` is a layout of the parts' tensors
        (what a plain GET serves as full tensors, :mod:`ckptstore_core.assemble`).
        Parts missing or unfinished are left to the commit to refuse."""
        checkpoint_id = self._catalog.open_parts_of(run, step)
        if checkpoint_id is None:
            return
        tensors = []
        for name in names:
            part = self._catalog.find_part(checkpoint_id, name)
            if part is None or part.status != "done":
                return
            tensors += self._catalog.part_tensors(part)
        try:
            layout_view(text, tensors)
        except ValueError as exc:
            raise InvalidRequest(
                f"{run}/{step}: metadata {METADATA_KEY!r} is no DCP layout of the parts' "
                f"tensors: {exc}"
            ) from None

    def collect(self, part: PartRecord) -> bool:
        """Delete a part that nobody writes and no commit names: its blob, then its rows
        (the row names the blob: it goes last). Whether it is gone."""
        try:
            delete_blob(self._store, part.blob_key)
        except Exception as exc:
            log.warning("cannot delete part blob %r yet: %s", part.blob_key, exc)
            return False
        self._catalog.drop_part(part.id)
        self._metrics.parts_collected([part])
        return True


def _digests(header: Header, checksums: Mapping[str, str]) -> list[bytes]:
    """The 16-byte xxh3-128 of each of ``header``'s tensors, in its order, from their hex
    ``checksums`` by name (InvalidRequest unless there is one per tensor, and no other)."""
    names = [t.name for t in header.tensors]
    if set(checksums) != set(names):
        odd = sorted(set(checksums) ^ set(names))[:3]
        raise InvalidRequest(f"checksums must name every tensor of the header and no other: {odd}")
    out = []
    for name in names:
        text = checksums[name]
        if len(text) != 32 or text.strip("0123456789abcdef"):
            raise InvalidRequest(f"checksum of {name!r}: not 32 lowercase hex digits")
        out.append(bytes.fromhex(text))
    return out


def unstored_part(checkpoint_id: int, name: str, header: Header) -> PartRecord:
    """The record of a part that was the same content again as committed checkpoint
    ``checkpoint_id`` holds: nothing stored, no row (``id`` 0)."""
    return PartRecord(
        id=0,
        checkpoint_id=checkpoint_id,
        name=name,
        blob_key="",
        status="done",
        raw_bytes=header.data_len,
        stored_bytes=0,
        n_tensors=len(header.tensors),
    )
