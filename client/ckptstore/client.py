"""``CheckpointClient``: save and load PyTorch state dicts through a ckptstore service.

Saving streams the state as a safetensors body, one tensor at a time (never the whole body in
memory). Loading streams the response into one buffer per tensor and rebuilds the nested state.
Connection errors and 503s are retried with exponential backoff and jitter; that is safe for
saves because a repeated POST of the same step with the same content is an idempotent 200.
"""

from __future__ import annotations

import builtins
import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any, TypeVar

import httpx
import xxhash

from ckptstore.errors import CkptStoreError, CorruptData, StorageUnavailable, error_from_code
from ckptstore.wire import FORMAT, Header, StreamParser, TensorPiece, encode_header

__all__ = ["CheckpointClient", "CheckpointInfo", "RunInfo"]

_PIECE = 4 << 20  # bytes per write/read while streaming
_CHECKSUMS_KEY = "ckptstore.xxh3_128"
T = TypeVar("T")


@dataclass(frozen=True)
class CheckpointInfo:
    run: str
    step: int
    parent_step: int | None
    keyframe: bool
    chain_depth: int
    raw_bytes: int
    stored_bytes: int
    tensors: int
    created: datetime

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> CheckpointInfo:
        return cls(**{**obj, "created": datetime.fromisoformat(obj["created"])})


@dataclass(frozen=True)
class RunInfo:
    name: str
    checkpoints: int
    latest_step: int
    raw_bytes: int
    stored_bytes: int
    created: datetime

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> RunInfo:
        return cls(**{**obj, "created": datetime.fromisoformat(obj["created"])})


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


class CheckpointClient:
    """Client of a ckptstore service at ``url`` (e.g. ``http://127.0.0.1:8000``).

    ``retries`` bounds the attempts after the first on connection errors and 503s;
    ``timeout`` applies to each network operation (connect, one read, one write), not to a
    whole transfer. ``progress=True`` shows a tqdm bar on saves and loads.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 120.0,
        retries: int = 5,
        backoff: float = 0.5,
        progress: bool = False,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.retries = retries
        self.backoff = backoff
        self.progress = progress
        self._http = httpx.Client(
            base_url=self.url,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            transport=transport,
        )

    def close(self) -> None:
        self._http.close()

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
        self, run: str, step: int, state: object, *, progress: bool | None = None
    ) -> CheckpointInfo:
        """Store ``state`` (a nested state dict) as checkpoint ``step`` of ``run``."""
        from ckptstore.state import dtype_to_wire, flatten, tensor_bytes

        flat = flatten(state)
        specs = [(name, dtype_to_wire(t.dtype), tuple(t.shape)) for name, t in flat.tensors]
        prefix, header = encode_header(specs, {"format": FORMAT, "skeleton": flat.skeleton})
        show = self.progress if progress is None else progress

        def body() -> Iterator[bytes]:
            bar = _Progress(show, header.total_len, f"save {run}/{step}")
            try:
                yield prefix
                bar.update(len(prefix))
                for _, tensor in flat.tensors:
                    data = tensor_bytes(tensor)
                    for off in range(0, len(data), _PIECE):
                        piece = bytes(data[off : off + _PIECE])
                        yield piece
                        bar.update(len(piece))
            finally:
                bar.close()

        def attempt() -> CheckpointInfo:
            response = self._http.post(
                f"/v1/runs/{run}/checkpoints/{step}",
                content=body(),
                headers={
                    "Content-Type": "application/octet-stream",
                    "Content-Length": str(header.total_len),
                },
            )
            _raise_for(response)
            return CheckpointInfo.from_json(response.json())

        return self._retry(attempt)

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
        """
        from ckptstore.state import tensor_from_bytes, unflatten

        params = {"prefix": prefix} if prefix else {}
        show = self.progress if progress is None else progress
        header, buffers = self._retry(
            lambda: self._download(f"/v1/runs/{run}/checkpoints/{step}", params, show)
        )
        tensors = {}
        for spec, buf in zip(header.tensors, buffers, strict=True):
            tensor = tensor_from_bytes(buf, spec.dtype, spec.shape)
            if str(map_location) != "cpu":
                tensor = tensor.to(map_location)
            tensors[spec.name] = tensor
        skeleton = header.metadata.get("skeleton")
        if skeleton is None:  # a plain safetensors checkpoint: a flat dict
            return tensors
        return unflatten(skeleton, tensors, prefix=prefix)

    def list(self, run: str) -> list[CheckpointInfo]:
        """The committed checkpoints of ``run``, by step."""
        response = self._retry(lambda: self._get(f"/v1/runs/{run}/checkpoints"))
        return [CheckpointInfo.from_json(c) for c in response.json()["checkpoints"]]

    def runs(self) -> builtins.list[RunInfo]:
        """Every run with at least one committed checkpoint."""
        response = self._retry(lambda: self._get("/v1/runs"))
        return [RunInfo.from_json(r) for r in response.json()["runs"]]

    # -- plumbing ---------------------------------------------------------------------------

    def _get(self, path: str) -> httpx.Response:
        response = self._http.get(path)
        _raise_for(response)
        return response

    def _download(
        self, path: str, params: dict[str, str], show: bool
    ) -> tuple[Header, builtins.list[bytearray]]:
        parser = StreamParser(max_header_bytes=1 << 30)
        buffers: builtins.list[bytearray] = []
        with self._http.stream("GET", path, params=params) as response:
            _raise_for(response)
            total = int(response.headers.get("content-length", 0))
            bar = _Progress(show, total, f"load {path.split('/v1/runs/')[-1]}")
            try:
                for data in response.iter_raw(_PIECE):
                    for event in parser.feed(data):
                        if isinstance(event, TensorPiece):
                            buffers[event.index][event.offset : event.offset + len(event.data)] = (
                                event.data
                            )
                        else:
                            buffers = [bytearray(t.nbytes) for t in event.tensors]
                    bar.update(len(data))
            finally:
                bar.close()
        header = parser.close()
        _verify(header, buffers)
        return header, buffers

    def _retry(self, attempt: Callable[[], T]) -> T:
        for n in range(self.retries + 1):
            try:
                return attempt()
            except (httpx.TransportError, StorageUnavailable):
                if n == self.retries:
                    raise
                delay = self.backoff * 2**n
                time.sleep(delay * (0.5 + random.random()))
        raise AssertionError("unreachable")


def _raise_for(response: httpx.Response) -> None:
    if response.is_success:
        return
    response.read()
    try:
        err = response.json()["error"]
        raise error_from_code(err["code"], err["message"], response.status_code)
    except (ValueError, KeyError, TypeError) as exc:
        raise CkptStoreError(
            f"HTTP {response.status_code} from {response.request.url}: {response.text[:500]}"
        ) from exc


def _verify(header: Header, buffers: list[bytearray]) -> None:
    """Check each tensor against the checksum the service recorded at save time."""
    raw = header.metadata.get(_CHECKSUMS_KEY)
    if raw is None:
        return
    expected = json.loads(raw)
    for spec, buf in zip(header.tensors, buffers, strict=True):
        want = expected.get(spec.name)
        if want is not None and xxhash.xxh3_128_hexdigest(buf) != want:
            raise CorruptData(f"tensor {spec.name!r} arrived corrupted (checksum mismatch)")
