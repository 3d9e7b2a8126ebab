"""``CheckpointClient``: save and load PyTorch state dicts through a ckptstore service.

Saving streams the state as a safetensors body straight from tensor memory, one tensor at a
time (never the whole body in memory, no copy of contiguous CPU tensors). Loading reads the
response straight into one buffer per tensor, which then becomes the tensor's storage.

The HTTP layer is the standard library's ``http.client``: with ``sendall`` of memoryviews and
``readinto`` of preallocated buffers it moves 2+ GB/s on loopback, where httpx (h11) topped out
near 0.5 GB/s in our measurements, and the transfer speed is what a trainer waits on.

Connection errors and 503s are retried with exponential backoff and jitter; that is safe for
saves because a repeated POST of the same step with the same content is an idempotent 200.
Each retry is logged as a warning on the ``ckptstore`` logger (what failed, the attempt, the
wait), so a job or command waiting on a service that is down says so at once.

``save_async`` copies the state into reused host buffers and uploads it in a background
thread through the same path as ``save`` (see :mod:`ckptstore.staging`). Connections come from
a pool that gives each request its own, so a background upload never shares a connection with
the caller's loads and listings.
"""

from __future__ import annotations

import builtins
import http.client
import json
import logging
import os
import random
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from urllib.parse import quote, urlencode, urlsplit

import numpy as np
import xxhash

from ckptstore_core.errors import (
    CkptStoreError,
    CorruptData,
    InvalidStream,
    NotFound,
    RequestTimeout,
    ServiceUnavailable,
    StorageUnavailable,
    TooManyUploads,
    error_from_code,
)
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
from ckptstore_core.wire import FORMAT, Header, StreamParser, encode_header

if TYPE_CHECKING:
    import torch

    from ckptstore.staging import AsyncSaver
    from ckptstore.state import FlatState

__all__ = ["DEFAULT_URL", "CheckpointClient", "CheckpointInfo", "RunInfo"]

#: The service a client with no ``url`` talks to when ``CKPTSTORE_URL`` is not set.
DEFAULT_URL = "http://127.0.0.1:8000"

_PIECE = 8 << 20  # bytes per socket write/read while streaming
_CHECKSUMS_KEY = "ckptstore.xxh3_128"
_TRANSIENT = (OSError, http.client.HTTPException)
T = TypeVar("T")
logger = logging.getLogger("ckptstore")


class _Progress:
    """A tqdm bar when asked for, else nothing."""

    def __init__(self, enabled: bool, total: int, desc: str) -> None:
        self._bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError as exc:
                raise ImportError(
                    "progress bars need tqdm: pip install 'ckptstore[progress]'"
                ) from exc
            self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024)

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class _Pool:
    """Keep-alive connections to one service, one per concurrent request, thread-safe."""

    def __init__(self, url: str, timeout: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"service URL must be http(s)://host[:port][/base], got {url!r}")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self.base = parts.path.rstrip("/")
        self._timeout = timeout
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def get(self) -> http.client.HTTPConnection:
        """An idle connection the service has not closed, else a new one."""
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                break
            if not _dropped(conn):
                return conn
            conn.close()  # the service closed it while idle (its keep-alive timeout)
        if self._https:
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=self._timeout, context=ssl.create_default_context()
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)

    def put(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._idle.append(conn)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


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
    ) -> None:
        if url is None:
            url = os.environ.get("CKPTSTORE_URL") or DEFAULT_URL
        if token is None:
            token = os.environ.get("CKPTSTORE_TOKEN") or None
        self.url = url.rstrip("/")
        # the header, not the token, is kept: no attribute shows the secret by its name
        self._authorization = f"Bearer {token.strip()}" if token else None
        self.retries = retries
        self.backoff = backoff
        self.progress = progress
        self._pool = _Pool(self.url, timeout)
        self._saver: AsyncSaver | None = None  # made by the first save_async (imports torch)
        self._saver_lock = threading.Lock()

    def close(self) -> None:
        """Wait for the :meth:`save_async` upload in flight, then free the staging buffers
        and the idle connections.

        Never raises a save's error: that is on the save's future (use :meth:`wait` to have
        it raised). The client stays usable: later calls open new connections.
        """
        if self._saver is not None:
            self._saver.close()
        self._pool.close()

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
        path = self._run_path(run) + "/checkpoints"
        obj = self._retry(lambda: self._get_json(path))
        return [CheckpointInfo.from_json(c) for c in obj["checkpoints"]]

    def runs(self) -> builtins.list[RunInfo]:
        """Every run with at least one committed checkpoint."""
        obj = self._retry(lambda: self._get_json("/v1/runs"))
        return [RunInfo.from_json(r) for r in obj["runs"]]

    def delete(self, run: str, step: int) -> None:
        """Delete checkpoint ``step`` of ``run``: every other checkpoint keeps loading to the
        same bytes (those that rested on it are re-based first; the run's saves wait for
        that). Raises CheckpointNotFound / RunNotFound if there is none, RunBusy (409)
        while a checkpoint of the run is being written in parts. A retry after a lost
        answer that finds the checkpoint gone is taken as done (docs/lifecycle.md)."""
        self._delete(self._path(run, step))

    def delete_run(self, run: str) -> None:
        """Delete every checkpoint of ``run``; a later save under that name starts a fresh
        chain. Raises RunNotFound if it has none (a retry as :meth:`delete`)."""
        self._delete(self._run_path(run))

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
        obj = self._call("POST", self._run_path(new_run) + "/fork", body)
        return CheckpointInfo.from_json(obj)

    def pin(self, run: str, step: int) -> CheckpointInfo:
        """Pin checkpoint ``step`` of ``run``: no delete takes it (:meth:`delete` raises
        CheckpointPinned; retention keeps it) until :meth:`unpin`. Returns it as listed."""
        return CheckpointInfo.from_json(self._call("PUT", self._path(run, step) + "/pin"))

    def unpin(self, run: str, step: int) -> CheckpointInfo:
        """Unpin checkpoint ``step`` of ``run``; its run's retention policy may then delete
        it (in the background). Returns it as listed."""
        return CheckpointInfo.from_json(self._call("DELETE", self._path(run, step) + "/pin"))

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
        path = self._run_path(run) + "/retention"
        obj = self._call("PUT", path, policy.to_json())
        return RetentionPolicy.from_json(obj["retention"])

    def clear_retention(self, run: str) -> RetentionPolicy | None:
        """Clear ``run``'s own retention policy; returns the one that applies from now on:
        the service's default (None: none, everything is kept)."""
        obj = self._call("DELETE", self._run_path(run) + "/retention")
        applied = obj["effective_retention"]
        return None if applied is None else RetentionPolicy.from_json(applied)

    def run_info(self, run: str) -> RunDetail:
        """``run``'s record, its pinned steps, its own retention policy and the one applied
        (its own, else the service's default). RunNotFound if it has no checkpoint."""
        return RunDetail.from_json(self._call("GET", self._run_path(run)))

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
        from ckptstore.state import dtype_to_wire, tensor_bytes, upload_order

        ordered = upload_order(flat.tensors)
        specs = [(name, dtype_to_wire(t.dtype), tuple(t.shape)) for name, t in ordered]
        stored = {"format": FORMAT, "skeleton": flat.skeleton}
        if metadata is not None:
            stored[USER_METADATA_KEY] = metadata
        if lossy is not None:
            stored[LOSSY_KEY] = lossy
        if names is not None:
            stored[PARAM_NAMES_KEY] = names
        prefix, header = encode_header(specs, stored)
        show = self.progress if progress is None else progress

        def body() -> Iterator[memoryview | bytes]:
            yield prefix
            for _, tensor in ordered:
                data = tensor_bytes(tensor)
                for off in range(0, len(data), _PIECE):
                    yield data[off : off + _PIECE]

        def attempt() -> CheckpointInfo:
            bar = _Progress(show, header.total_len, f"save {run}/{step}")
            try:
                payload = self._post(self._path(run, step), body(), header.total_len, bar.update)
            finally:
                bar.close()
            return CheckpointInfo.from_json(payload)

        return self._retry(attempt)

    def _fetch(
        self, run: str, step: int | str, prefix: str | None, map_location: Any, show: bool
    ) -> tuple[dict[str, Any], dict[str, str], int | str]:
        """The tensors of ``run/step`` whose names start with ``prefix``, the header's
        metadata and the step served (``latest`` resolved)."""
        from ckptstore.state import tensor_from_bytes

        query = f"?{urlencode({'prefix': prefix})}" if prefix else ""
        header, buffers, served = self._retry(
            lambda: self._download(self._path(run, step) + query, show, f"load {run}/{step}")
        )
        tensors = {}
        for spec, buf in zip(header.tensors, buffers, strict=True):
            tensor = tensor_from_bytes(buf, spec.dtype, spec.shape)
            if str(map_location) != "cpu":
                tensor = tensor.to(map_location)
            tensors[spec.name] = tensor
        return tensors, dict(header.metadata), step if served is None else int(served)

    @staticmethod
    def _run_path(run: str) -> str:
        """The run's path; InvalidRequest for a name the service would refuse."""
        return f"/v1/runs/{quote(check_run_name(run), safe='')}"

    @staticmethod
    def _path(run: str, step: int | str) -> str:
        """The checkpoint's path; InvalidRequest for a run name the service would refuse
        (the same rule), before anything is sent."""
        return f"{CheckpointClient._run_path(run)}/checkpoints/{quote(str(step), safe='')}"

    def _request(
        self,
        method: str,
        path: str,
        body: Iterable[memoryview | bytes] | None = None,
        length: int = 0,
        sent: Callable[[int], None] | None = None,
        content_type: str = "application/octet-stream",
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send a request; returns the connection (give it back with ``_done``) and response."""
        conn = self._pool.get()
        try:
            conn.putrequest(method, self._pool.base + path, skip_accept_encoding=True)
            if self._authorization is not None:
                conn.putheader("Authorization", self._authorization)
            if body is not None:
                conn.putheader("Content-Type", content_type)
                conn.putheader("Content-Length", str(length))
            conn.endheaders()
            if body is not None:
                try:
                    for piece in body:
                        conn.send(piece)
                        if sent is not None:
                            sent(len(piece))
                except OSError:
                    # The service may have answered early (a 4xx after the header) and
                    # closed; read that answer if there is one, else retry the transport.
                    response = conn.getresponse()
                    if response.status < 400:
                        raise
                    return conn, response
            return conn, conn.getresponse()
        except BaseException:
            conn.close()
            raise

    def _done(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
        if response.isclosed() and not response.will_close:
            self._pool.put(conn)
        else:
            conn.close()

    def _post(
        self,
        path: str,
        body: Iterator[memoryview | bytes],
        length: int,
        sent: Callable[[int], None],
    ) -> Any:
        conn, response = self._request("POST", path, body, length, sent)
        data = response.read()
        self._done(conn, response)
        _raise_for(response.status, data)
        return json.loads(data)

    def _delete(self, path: str) -> None:
        """DELETE ``path``, retried as configured; a 404 after a first attempt that may
        have deleted it (its answer lost) is success."""
        tries = 0

        def attempt() -> None:
            nonlocal tries
            tries += 1
            conn, response = self._request("DELETE", path)
            data = response.read()
            self._done(conn, response)
            try:
                _raise_for(response.status, data)
            except NotFound:
                if tries == 1:
                    raise

        self._retry(attempt)

    def _call(self, method: str, path: str, payload: Any = None) -> Any:
        """``method path`` with ``payload`` as its JSON body (if not None), retried as
        configured (the callers' requests are idempotent); the answer's JSON."""
        body = None if payload is None else json.dumps(payload).encode()

        def attempt() -> Any:
            pieces = None if body is None else [body]
            length = 0 if body is None else len(body)
            conn, response = self._request(
                method, path, pieces, length, content_type="application/json"
            )
            data = response.read()
            self._done(conn, response)
            _raise_for(response.status, data)
            return json.loads(data)

        return self._retry(attempt)

    def _get_json(self, path: str) -> Any:
        conn, response = self._request("GET", path)
        data = response.read()
        self._done(conn, response)
        _raise_for(response.status, data)
        return json.loads(data)

    def _download(
        self, path: str, show: bool, desc: str
    ) -> tuple[Header, builtins.list[memoryview], str | None]:
        conn, response = self._request("GET", path)
        try:
            if response.status >= 300:
                _raise_for(response.status, response.read())
            served = response.getheader("X-Ckptstore-Step")
            total = int(response.getheader("Content-Length") or 0)
            bar = _Progress(show, total, desc)
            try:
                header = _read_header(response)
                bar.update(header.header_len)
                buffers = []
                for spec in header.tensors:
                    # uninitialised: zero-filling what the socket overwrites cost ~10 ms/100 MB
                    buf = np.empty(spec.nbytes, np.uint8).data
                    _read_into(response, buf, bar.update)
                    buffers.append(buf)
            finally:
                bar.close()
            if response.read(1):
                raise InvalidStream("response is longer than its header says")
        except BaseException:
            conn.close()
            raise
        self._done(conn, response)
        _verify(header, buffers)
        return header, buffers, served

    def _retry(self, attempt: Callable[[], T]) -> T:
        """``attempt()``, again after each transient failure (up to ``retries`` times, each
        logged as a warning), backing off exponentially with jitter."""
        for n in range(self.retries + 1):
            try:
                return attempt()
            except (*_TRANSIENT, StorageUnavailable, RequestTimeout, TooManyUploads) as exc:
                if n == self.retries:
                    if isinstance(exc, CkptStoreError):
                        raise
                    if isinstance(exc, http.client.IncompleteRead):
                        # the status line and headers came: the service failed mid-stream
                        raise ServiceUnavailable(
                            f"the ckptstore service at {self.url} cut its response short "
                            f"({exc!r}): it failed while sending; its log says why"
                        ) from exc
                    raise ServiceUnavailable(
                        f"cannot reach the ckptstore service at {self.url}: {_reason(exc)}"
                    ) from exc
                delay = self.backoff * 2**n * (0.5 + random.random())
                logger.warning(
                    "%s; retrying in %.1f s (retry %d of %d)",
                    _failure(self.url, exc),
                    delay,
                    n + 1,
                    self.retries,
                )
                time.sleep(delay)
        raise AssertionError("unreachable")


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle keep-alive connection was closed by its peer: its socket is readable
    (an EOF, or bytes no request asked for) or gone. Without this check, the next request on
    it would fail once (``RemoteDisconnected``) and cost a retry with its back-off."""
    sock = conn.sock
    if sock is None:
        return True
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def _failure(url: str, exc: BaseException) -> str:
    """What a transient failure of a request to ``url`` was, in one line for a log."""
    if isinstance(exc, CkptStoreError):
        return f"{url} answered {exc.status} {exc.code}: {exc.message}"
    if isinstance(exc, http.client.IncompleteRead):
        return f"{url} cut its response short"
    return f"cannot reach {url}: {_reason(exc)}"


def _reason(exc: BaseException) -> str:
    """A network failure in a few words ("connection refused", "timed out"), else its repr."""
    if isinstance(exc, socket.gaierror):
        return f"host not found ({exc.strerror})"
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror[:1].lower() + exc.strerror[1:]
    return repr(exc)


def _read_into(
    response: http.client.HTTPResponse, view: memoryview, progress: Callable[[int], None]
) -> None:
    got = 0
    while got < len(view):
        n = response.readinto(view[got : got + _PIECE])
        if not n:
            raise http.client.IncompleteRead(bytes(0), len(view) - got)
        got += n
        progress(n)


def _read_header(response: http.client.HTTPResponse) -> Header:
    parser = StreamParser(max_header_bytes=1 << 30)
    prefix = bytearray(8)
    _read_into(response, memoryview(prefix), lambda n: None)
    list(parser.feed(prefix))
    text = bytearray(int.from_bytes(prefix, "little"))
    _read_into(response, memoryview(text), lambda n: None)
    events = list(parser.feed(text))
    if not events or not isinstance(events[0], Header):
        raise InvalidStream("response header did not parse")
    return events[0]


def _raise_for(status: int, data: bytes) -> None:
    if status < 300:
        return
    try:
        err = json.loads(data)["error"]
        code, message = err["code"], err["message"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CkptStoreError(f"HTTP {status}: {data[:500]!r}") from exc
    raise error_from_code(code, message, status)


def _verify(header: Header, buffers: builtins.list[memoryview]) -> None:
    """Check each tensor against the checksum the service recorded at save time."""
    raw = header.metadata.get(_CHECKSUMS_KEY)
    if raw is None:
        return
    expected = json.loads(raw)
    for spec, buf in zip(header.tensors, buffers, strict=True):
        want = expected.get(spec.name)
        if want is not None and xxhash.xxh3_128_hexdigest(buf) != want:
            raise CorruptData(f"tensor {spec.name!r} arrived corrupted (checksum mismatch)")
