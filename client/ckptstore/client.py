"""``CheckpointClient``: save and load PyTorch state dicts through a ckptstore service.

Saving streams the state as a safetensors body straight from tensor memory, one tensor at a
time (never the whole body in memory, no copy of contiguous CPU tensors). Loading reads the
response straight into one buffer per tensor, which then becomes the tensor's storage.

Every request goes through the client's :class:`~ckptstore.transport.Transport`
(``client.transport``): its connections, retries and error mapping. Connection errors and
503s are retried with exponential backoff and jitter; that is safe for saves because a
repeated POST of the same step with the same content is an idempotent 200. Each retry is
logged as a warning on the ``ckptstore`` logger (what failed, the attempt, the wait), so a job
or command waiting on a service that is down says so at once.

``save_async`` copies the state into reused host buffers and uploads it in a background
thread through the same path as ``save`` (see :mod:`ckptstore.staging`). Connections come from
a pool that gives each request its own, so a background upload never shares a connection with
the caller's loads and listings.
"""

from __future__ import annotations

import builtins
import json
import logging
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlencode

import numpy as np

from ckptstore.transport import (
    DEFAULT_URL,
    PIECE,
    Progress,
    Transport,
    check_tensor,
    checkpoint_path,
    checksums_of,
    digest,
    read_header,
    read_into,
    run_path,
)
from ckptstore_core.errors import CheckpointExists, CorruptData, InvalidRequest, InvalidStream
from ckptstore_core.lossy import Lossy
from ckptstore_core.names import check_run_name
from ckptstore_core.records import (
    LOSSY_KEY,
    PARAM_NAMES_KEY,
    USER_METADATA_KEY,
    CheckpointInfo,
    RunDetail,
    RunInfo,
    encode_user_metadata,
)
from ckptstore_core.retention import KeepBest, RetentionPolicy
from ckptstore_core.wire import FORMAT, Header, TensorPiece, encode_header

if TYPE_CHECKING:
    import torch

    from ckptstore.staging import AsyncSaver
    from ckptstore.state import FlatState

__all__ = [
    "DEFAULT_URL",
    "CheckpointClient",
    "CheckpointInfo",
    "RunInfo",
    "fetch_tensors",
    "save_body",
]

logger = logging.getLogger("ckptstore")


def lossy_text(lossy: bool | Lossy | Mapping[str, Any] | None) -> str | None:
    """What a save sends under ``ckptstore.lossy`` for ``lossy`` (the parameters as JSON,
    ``True`` resolved to the defaults), None for a bit-exact save; InvalidRequest for bad
    parameters, before anything is sent."""
    if lossy is None or lossy is False:
        return None
    return json.dumps(Lossy.from_json(lossy).to_json(), separators=(",", ":"))


class CheckpointClient:
    """Client of a ckptstore service at ``url`` (e.g. ``http://127.0.0.1:8000``); without
    one, at ``CKPTSTORE_URL`` from the environment, else :data:`DEFAULT_URL`.

    ``token`` is the bearer token sent with every request (default: ``CKPTSTORE_TOKEN`` from
    the environment; none if unset); a service that requires one answers
    :class:`~ckptstore_core.errors.Unauthorized` (401) or
    :class:`~ckptstore_core.errors.Forbidden` (403), never retried (docs/security.md).

    ``retries`` bounds the attempts after the first on connection errors and 503s (then
    :class:`~ckptstore_core.errors.ServiceUnavailable` or the service's 503 error is raised);
    ``timeout`` applies to each socket operation, not to a whole transfer. ``progress=True``
    shows a tqdm bar on saves and loads. Safe to share between threads.

    ``direct=True`` encodes each save in this process (the core's chunk pipeline, against
    the state this process last saved or loaded of the run) and sends the encoded chunks
    (straight to S3 through presigned URLs where the service's store is S3): the service
    plans, checks and commits, never encodes; loads fetch the stored chunks (straight from
    S3 through presigned URLs, else through the service unchanged) and decode them here, so
    no replica decodes, and keep them as the base of the run's next direct save
    (docs/scale.md). ``None`` (the default) and ``False``: the service encodes and decodes.
    ``read_bases`` (``direct=True`` only): a direct save whose parent holds tensors this
    process neither saved nor loaded reads them from the store first and diffs against
    them (``True``), or encodes them self-contained (``False``); ``None``: the process's
    writer's default (:data:`ckptstore.direct.READ_BASES`).

    ``transport``: a :class:`~ckptstore.Transport` to send through instead of one the
    client makes from ``url``, ``token``, ``timeout``, ``retries`` and ``backoff`` (passing
    any of those with it is a ``ValueError``); ``client.transport`` is the one in use.

    :meth:`close` (and leaving a ``with`` block) first waits for a :meth:`save_async` upload
    in flight.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        timeout: float = 120.0,
        retries: int = 5,
        backoff: float = 0.5,
        progress: bool = False,
        token: str | None = None,
        direct: bool | None = None,
        read_bases: bool | None = None,
        transport: Transport | None = None,
    ) -> None:
        if transport is None:
            transport = Transport(
                url, token=token, timeout=timeout, retries=retries, backoff=backoff
            )
        elif (url, token, timeout, retries, backoff) != (None, None, 120.0, 5, 0.5):
            raise ValueError(
                "pass url, token, timeout, retries and backoff to the Transport, "
                "not with transport="
            )
        self.transport = transport
        self.progress = progress
        self._saver: AsyncSaver | None = None  # made by the first save_async (imports torch)
        self._saver_lock = threading.Lock()
        self.direct = bool(direct)
        self.read_bases = read_bases

    def close(self) -> None:
        """Wait for the :meth:`save_async` upload in flight, then free the staging buffers
        and the idle connections.

        Never raises a save's error: that is on the save's future (use :meth:`wait` to have
        it raised). The client stays usable: later calls open new connections.
        """
        if self._saver is not None:
            self._saver.close()
        self.transport.close()

    @property
    def url(self) -> str:
        """The service's base URL (the transport's)."""
        return self.transport.url

    @property
    def retries(self) -> int:
        """Retries after a first attempt (the transport's; settable)."""
        return self.transport.retries

    @retries.setter
    def retries(self, value: int) -> None:
        self.transport.retries = value

    @property
    def backoff(self) -> float:
        """Seconds before the first retry, doubled at each (the transport's; settable)."""
        return self.transport.backoff

    @backoff.setter
    def backoff(self, value: float) -> None:
        self.transport.backoff = value

    def __enter__(self) -> CheckpointClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- public API -------------------------------------------------------------------------

    def save(
        self,
        run: str,
        step: int,
        state: object,
        *,
        metadata: Mapping[str, Any] | None = None,
        progress: bool | None = None,
        lossy: bool | Lossy | None = None,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    ) -> CheckpointInfo:
        """Store ``state`` (a nested state dict) as checkpoint ``step`` of ``run``.

        ``metadata``: a small JSON object kept with the checkpoint and returned in its
        listings (``CheckpointInfo.metadata``), e.g. ``{"eval_loss": 0.31}``; at most 64 KiB
        of JSON, no NaN (``ValueError``/``TypeError`` before anything is sent). Part of the
        checkpoint: a retry with other metadata is a conflict.

        ``lossy``: ``True`` (the default parameters) or a :class:`ckptstore.Lossy` stores
        the fp32 weights and their Adam moments lossy, against the previous checkpoint as it
        loads; everything else stays bit-exact. The checkpoint then loads to the same
        bytes every time, but not to the bytes saved; its listing's ``lossy`` says so
        (None: bit-exact). Bad parameters raise InvalidRequest before anything is sent
        (docs/lossy.md).

        ``model`` and ``optimizer`` (one or a list): the live objects whose state dicts
        ``state`` holds. The save then records which of the optimizer's parameter ids is
        which of the model's parameters (``ckptstore.param_names``), so that a lossy save
        (or a later archival) pairs every weight with its Adam moments whatever the param
        groups' order; without them only what the state itself proves is paired
        (docs/lossy.md#which-weights-pair). The checkpoint's listing's ``pairing`` says what
        was paired.
        """
        check_run_name(run)  # before the state is flattened
        text = None if metadata is None else encode_user_metadata(metadata)
        asked = lossy_text(lossy)
        from ckptstore.state import flatten, param_names

        flat = flatten(state)
        names = param_names(model, optimizer, flat)
        return self._upload(run, step, flat, progress, text, asked, names)

    def save_async(
        self,
        run: str,
        step: int,
        state: object,
        *,
        metadata: Mapping[str, Any] | None = None,
        progress: bool | None = None,
        lossy: bool | Lossy | None = None,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    ) -> Future[CheckpointInfo]:
        """Start saving ``state`` as checkpoint ``step`` of ``run``; return once it is copied.

        The state's tensors are copied into host buffers that this client keeps and reuses
        from one save to the next (same name, dtype and shape: no new allocation), and its
        non-tensor leaves are serialised, before this returns; the upload then runs in a
        background thread. So the caller may change the state in place (``optimizer.step()``)
        as soon as this returns: the checkpoint holds the state as it was at the call, and
        it is byte-identical to what :meth:`save` of that state stores.

        One save is in flight per client: a call made while the previous upload is still
        running first waits for it to finish. Errors never raise here (apart from a
        ``KeyboardInterrupt`` while waiting or copying): a state that cannot be flattened, a
        service still down after ``retries`` (:class:`~ckptstore_core.errors.ServiceUnavailable`),
        a conflicting step -- each is set on the returned future and logged as a warning on
        the ``ckptstore`` logger (metadata that is no small JSON object too). ``metadata``,
        ``lossy``, ``model`` and ``optimizer``: as for :meth:`save` (bad lossy parameters
        raise here). The buffers
        hold one host copy of the state's tensors until :meth:`close`. The future's
        done-callbacks run on the upload thread: calling ``save_async``, :meth:`wait` or
        :meth:`close` from one raises ``RuntimeError``.

        Before the process ends, call :meth:`wait` (raises the last save's error) or
        :meth:`close` (waits, raises nothing), or leave the client's ``with`` block. As a
        safety net, interpreter exit also waits for an upload in flight; a killed process
        loses it (and, the commit being atomic, leaves nothing partial behind).
        """
        asked = lossy_text(lossy)
        saver = self._saver
        if saver is None:
            from ckptstore.staging import AsyncSaver

            with self._saver_lock:
                if self._saver is None:
                    self._saver = AsyncSaver(self._upload)
                saver = self._saver
        return saver.submit(run, step, state, progress, metadata, asked, model, optimizer)

    def wait(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Wait for the last :meth:`save_async` to finish and return its checkpoint.

        ``None`` if this client never called :meth:`save_async`. Raises that save's error
        (earlier saves' outcomes stay on their own futures), or ``TimeoutError`` if
        ``timeout`` seconds pass first (the upload goes on).
        """
        return None if self._saver is None else self._saver.wait(timeout)

    def load(
        self,
        run: str,
        step: int | str = "latest",
        *,
        map_location: Any = "cpu",
        prefix: str | None = None,
        progress: bool | None = None,
    ) -> Any:
        """Rebuild checkpoint ``step`` (or ``"latest"``) of ``run`` as a nested state dict.

        ``prefix`` fetches only tensors whose flattened name starts with it (``"model/"``):
        the result keeps the nesting down to them and drops everything else.
        ``map_location`` is passed to ``Tensor.to`` (``"cpu"``, ``"cuda:0"``, a device).

        A checkpoint saved through ``torch.distributed.checkpoint`` (:mod:`ckptstore.dcp`)
        comes back whole: its shards assembled into full tensors, nested as it was saved
        (``prefix`` then matches DCP's dotted names, ``"model."``).
        """
        from ckptstore.state import referenced_tensors, unflatten

        show = self.progress if progress is None else progress
        tensors, metadata, served = self._fetch(run, step, prefix, map_location, show)
        skeleton = metadata.get("skeleton")
        if skeleton is None:  # a plain safetensors checkpoint (a flat dict), or DCP's shards
            from ckptstore.parts import full_state_if_distributed

            return full_state_if_distributed(tensors, metadata, map_location)
        if prefix:
            # a tensor under the prefix tied to one outside it travels under the outside
            # name: fetch it by that name, from the step that was served (not a newer latest)
            for name in referenced_tensors(skeleton, prefix):
                if name not in tensors:
                    extra, _, _ = self._fetch(run, served, name, map_location, show)
                    if name not in extra:
                        raise CorruptData(f"the checkpoint has no tensor {name!r}")
                    tensors[name] = extra[name]
        return unflatten(skeleton, tensors, prefix=prefix)

    def list(self, run: str) -> builtins.list[CheckpointInfo]:
        """The committed checkpoints of ``run``, by step."""
        obj = self.transport.call("GET", run_path(run) + "/checkpoints")
        return [CheckpointInfo.from_json(c) for c in obj["checkpoints"]]

    def runs(self) -> builtins.list[RunInfo]:
        """Every run with at least one committed checkpoint."""
        obj = self.transport.call("GET", "/v1/runs")
        return [RunInfo.from_json(r) for r in obj["runs"]]

    def delete(self, run: str, step: int) -> None:
        """Delete checkpoint ``step`` of ``run``: every other checkpoint keeps loading to the
        same bytes (those that rested on it are re-based first; the run's saves wait for
        that). Raises CheckpointNotFound / RunNotFound if there is none, RunBusy (409)
        while a checkpoint of the run is being written in parts. A retry after a lost
        answer that finds the checkpoint gone is taken as done (docs/lifecycle.md)."""
        self.transport.delete(checkpoint_path(run, step))

    def delete_run(self, run: str) -> None:
        """Delete every checkpoint of ``run``; a later save under that name starts a fresh
        chain. Raises RunNotFound if it has none (a retry as :meth:`delete`)."""
        self.transport.delete(run_path(run))

    def fork(self, src_run: str, src_step: int, new_run: str) -> CheckpointInfo:
        """Make run ``new_run`` whose first checkpoint, at ``src_step``, loads to exactly
        the bytes of checkpoint ``src_step`` of ``src_run``, without copying them (its
        chunks refer to the source's); ``new_run``'s later saves are deltas of it, so a
        fine-tune's first save costs about a delta. Deleting the source (checkpoint or run)
        leaves the fork whole. Raises RunNotFound / CheckpointNotFound for an absent source,
        CheckpointExists (409) if ``new_run`` has checkpoints, Forbidden without read on
        ``src_run``. A retry after a lost answer that finds this fork made takes it as done.
        Returns the new checkpoint as listed (docs/lifecycle.md, Forks)."""
        check_run_name(src_run)
        body = {"from_run": src_run, "from_step": int(src_step)}
        obj = self.transport.call("POST", run_path(new_run) + "/fork", body)
        return CheckpointInfo.from_json(obj)

    def pin(self, run: str, step: int) -> CheckpointInfo:
        """Pin checkpoint ``step`` of ``run``: no delete takes it (:meth:`delete` raises
        CheckpointPinned; retention keeps it) until :meth:`unpin`. Returns it as listed."""
        obj = self.transport.call("PUT", checkpoint_path(run, step) + "/pin")
        return CheckpointInfo.from_json(obj)

    def unpin(self, run: str, step: int) -> CheckpointInfo:
        """Unpin checkpoint ``step`` of ``run``; its run's retention policy may then delete
        it (in the background). Returns it as listed."""
        obj = self.transport.call("DELETE", checkpoint_path(run, step) + "/pin")
        return CheckpointInfo.from_json(obj)

    def set_retention(
        self,
        run: str,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: tuple[str, Literal["min", "max"], int] | KeepBest | None = None,
        *,
        lossy_after: int | None = None,
        lossy: Lossy | None = None,
    ) -> RetentionPolicy:
        """Set ``run``'s retention policy, replacing any it had: keep the newest
        ``keep_last``, every step that is a multiple of ``keep_every`` and the ``keep_best``
        ``(metric, "min"|"max", n)`` best by a key of the checkpoints' metadata; a checkpoint
        is kept if any rule keeps it, and the newest and pinned ones always are. No rule:
        everything is kept (whatever the service's default). With ``lossy_after=K`` the
        checkpoints kept that are older than the newest K (and not pinned) are re-encoded
        lossy, with the parameters ``lossy`` (None: the defaults; docs/lossy.md#archival).
        The service applies it at once and after each save, in the background. ValueError
        for a bad rule, before anything is sent. Returns the policy stored
        (docs/lifecycle.md)."""
        best = KeepBest(*keep_best) if isinstance(keep_best, tuple) else keep_best
        policy = RetentionPolicy(keep_last, keep_every, best, lossy_after, lossy)
        path = run_path(run) + "/retention"
        obj = self.transport.call("PUT", path, policy.to_json())
        return RetentionPolicy.from_json(obj["retention"])

    def clear_retention(self, run: str) -> RetentionPolicy | None:
        """Clear ``run``'s own retention policy; returns the one that applies from now on:
        the service's default (None: none, everything is kept)."""
        obj = self.transport.call("DELETE", run_path(run) + "/retention")
        applied = obj["effective_retention"]
        return None if applied is None else RetentionPolicy.from_json(applied)

    def run_info(self, run: str) -> RunDetail:
        """``run``'s record, its pinned steps, its own retention policy and the one applied
        (its own, else the service's default). RunNotFound if it has no checkpoint."""
        return RunDetail.from_json(self.transport.call("GET", run_path(run)))

    # -- plumbing ---------------------------------------------------------------------------

    def _upload(
        self,
        run: str,
        step: int,
        flat: FlatState,
        progress: bool | None,
        metadata: str | None = None,
        lossy: str | None = None,
        names: str | None = None,
    ) -> CheckpointInfo:
        """The one save path (``save`` and ``save_async``): stream the flattened state with
        the user's ``metadata`` (encoded JSON), the ``lossy`` parameters asked for (JSON,
        :func:`lossy_text`) and the parameter ``names`` (JSON,
        :func:`ckptstore.state.param_names`), retrying as configured."""
        from ckptstore.state import dtype_to_wire, upload_order

        ordered = upload_order(flat.tensors)
        specs = [(name, dtype_to_wire(t.dtype), tuple(t.shape)) for name, t in ordered]
        stored = {"format": FORMAT, "skeleton": flat.skeleton}
        if metadata is not None:
            stored[USER_METADATA_KEY] = metadata
        if self.direct:
            if lossy is not None:
                raise InvalidRequest("a direct save is bit-exact: save lossy with direct=False")
            return self._save_direct(run, step, specs, [t for _, t in ordered], stored)
        if lossy is not None:
            stored[LOSSY_KEY] = lossy
        if names is not None:
            stored[PARAM_NAMES_KEY] = names
        prefix, header = encode_header(specs, stored)
        show = self.progress if progress is None else progress

        def attempt() -> CheckpointInfo:
            bar = Progress(show, header.total_len, f"save {run}/{step}")
            body = save_body(prefix, (t for _, t in ordered))
            try:
                payload = self.transport.post(
                    checkpoint_path(run, step), body, header.total_len, bar.update
                )
            finally:
                bar.close()
            return CheckpointInfo.from_json(payload)

        return self.transport.retry(attempt)

    def _save_direct(
        self,
        run: str,
        step: int,
        specs: builtins.list[tuple[str, str, tuple[int, ...]]],
        tensors: builtins.list[Any],
        metadata: dict[str, str],
    ) -> CheckpointInfo:
        """A save encoded here (``direct=True``): one part, sent encoded, then committed."""
        from ckptstore.direct import Sent, pieces_of, shared_writer  # the codec: only when used
        from ckptstore.state import tensor_bytes

        writer = shared_writer()
        path = checkpoint_path(run, step)

        def data() -> Iterator[TensorPiece]:
            return pieces_of(tensor_bytes(t) for t in tensors)  # one host copy at a time

        def attempt() -> tuple[str, Sent]:
            # a part name of its own per attempt: a replica that died mid-part holds the
            # last one's lock until its lease runs out (the sweep collects that part)
            part = f"direct-{uuid.uuid4().hex[:12]}"
            return part, writer.save_part(
                self.transport, path, run, part, specs, data, read_bases=self.read_bases
            )

        part, sent = self.transport.retry(attempt)
        if sent.answer.get("committed"):  # the same tensors are committed at that step
            writer.discard(sent)
            return self._committed_again(path, metadata)
        try:
            commit = {"parts": [part], "metadata": metadata}
            info = self.transport.call("POST", path + "/commit", commit)
        except BaseException:
            writer.discard(sent)
            raise
        writer.keep(sent)
        return CheckpointInfo.from_json(info)

    def _committed_again(self, path: str, metadata: dict[str, str]) -> CheckpointInfo:
        """A direct save of a step that is committed already, whose tensors the service
        found the same: the same save again if its metadata (skeleton, the user's) is the
        same too, else CheckpointExists (as a plain save of other content)."""
        found = self.transport.call("GET", path + "/info")
        if found["metadata"] != metadata:
            raise CheckpointExists(
                f"{path}: committed already with the same tensors but other metadata "
                "(the state's non-tensor values, or the user's metadata)"
            )
        return CheckpointInfo.from_json(found["checkpoint"])

    def _fetch(
        self, run: str, step: int | str, prefix: str | None, map_location: Any, show: bool
    ) -> tuple[dict[str, Any], dict[str, str], int | str]:
        return fetch_tensors(
            self.transport, run, step, prefix, map_location, show, self.direct, keep_base=True
        )


def fetch_tensors(
    transport: Transport,
    run: str,
    step: int | str,
    prefix: str | None,
    map_location: Any,
    show: bool,
    direct: bool = False,
    *,
    keep_base: bool = False,
) -> tuple[dict[str, Any], dict[str, str], int | str]:
    """The tensors of ``run/step`` whose names start with ``prefix`` (on ``map_location``),
    the header's metadata and the step served (``latest`` resolved); retried as
    ``transport`` is configured, a progress bar if ``show``. ``direct``: fetched as stored
    and decoded here (no progress bar), and with ``keep_base`` kept as the run's base of
    this process's next direct save (:func:`ckptstore.direct_load.load_direct`)."""
    if direct:
        from ckptstore.direct import shared_writer  # the codec: only when used
        from ckptstore.direct_load import load_direct

        keep = shared_writer().loaded if keep_base else None
        got = transport.retry(lambda: load_direct(transport, run, step, prefix, keep_base=keep))
        return as_tensors(got.specs, got.buffers, map_location), got.metadata, got.step
    query = f"?{urlencode({'prefix': prefix})}" if prefix else ""
    header, buffers, served = transport.retry(
        lambda: _download(transport, checkpoint_path(run, step) + query, show, f"load {run}/{step}")
    )
    specs = [(t.name, t.dtype, t.shape) for t in header.tensors]
    tensors = as_tensors(specs, buffers, map_location)
    return tensors, dict(header.metadata), step if served is None else int(served)


def as_tensors(
    specs: Sequence[tuple[str, str, tuple[int, ...]]],
    buffers: Sequence[memoryview],
    map_location: Any,
) -> dict[str, Any]:
    """The tensors ``specs`` (name, dtype, shape) on ``map_location``, each one's storage
    its buffer (on the CPU)."""
    from ckptstore.state import tensor_from_bytes

    tensors = {}
    for (name, dtype, shape), buf in zip(specs, buffers, strict=True):
        tensor = tensor_from_bytes(buf, dtype, shape)
        if str(map_location) != "cpu":
            tensor = tensor.to(map_location)
        tensors[name] = tensor
    return tensors


def _download(
    transport: Transport, path: str, show: bool, desc: str
) -> tuple[Header, builtins.list[memoryview], str | None]:
    with transport.stream("GET", path) as response:
        served = response.getheader("X-Ckptstore-Step")
        total = int(response.getheader("Content-Length") or 0)
        bar = Progress(show, total, desc)
        try:
            header = read_header(response)
            checksums = checksums_of(header)
            bar.update(header.header_len)
            buffers = []
            for spec in header.tensors:
                # uninitialised: zero-filling what the socket overwrites cost ~10 ms/100 MB
                buf = np.empty(spec.nbytes, np.uint8).data
                read_into(response, buf, bar.update)
                # checked as it ends, before the next is read: a service that finds stored
                # data corrupt mid-stream completes this tensor wrong, then cuts the response
                check_tensor(spec.name, digest(buf), checksums)
                buffers.append(buf)
        finally:
            bar.close()
        if response.read(1):
            raise InvalidStream("response is longer than its header says")
    return header, buffers, served


def save_body(prefix: bytes, tensors: Iterable[torch.Tensor]) -> Iterator[memoryview | bytes]:
    """A save's request body: the header's bytes (``prefix``, from ``encode_header``), then
    each tensor's bytes in pieces of at most :data:`~ckptstore.transport.PIECE` bytes (views
    of the tensors, no copy)."""
    from ckptstore.state import tensor_bytes

    yield prefix
    for tensor in tensors:
        data = tensor_bytes(tensor)
        for off in range(0, len(data), PIECE):
            yield data[off : off + PIECE]
