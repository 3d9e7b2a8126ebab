"""The HTTP calls of multi-part checkpoints, over a :class:`~ckptstore.CheckpointClient`'s
connections and retries.

A distributed save uploads one *part* per rank and commits them once::

    PUT  /v1/runs/{run}/checkpoints/{step}/parts/{part}   a safetensors stream (no skeleton)
    POST /v1/runs/{run}/checkpoints/{step}/commit         {"parts": [...], "metadata": {...}}

and a distributed load asks for what one rank needs::

    GET  /v1/runs/{run}/checkpoints/{step}/info           record, metadata, tensor list
    POST /v1/runs/{run}/checkpoints/{step}/select         {"names": [...]} -> safetensors stream

Parts are invisible until the commit and idempotent (the same part with the same content is a
200), and a retried commit with the same parts is a 200, so every call here is retried like a
save on connection errors and 503s. A ``select`` response is consumed tensor by tensor, each
checked against the checksum the service recorded at save time; a retry after a cut asks only
for the tensors not consumed yet, so the caller sees each tensor exactly once.

Used by :mod:`ckptstore.dcp`; torch-free (the caller turns bytes into tensors).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import quote

import numpy as np
import xxhash

from ckptstore.client import (
    _CHECKSUMS_KEY,
    CheckpointClient,
    _raise_for,
    _read_header,
    _read_into,
)
from ckptstore_core.dcp_layout import FULL, LAYOUT_KEY
from ckptstore_core.errors import CorruptData, InvalidStream, ServiceUnavailable
from ckptstore_core.names import PART_NAME_RULE, check_part_name
from ckptstore_core.wire import FORMAT, TensorSpec, encode_header

__all__ = [
    "PART_NAME_RULE",
    "check_part_name",
    "commit",
    "full_state_if_distributed",
    "info",
    "put_part",
    "select",
]

_PIECE = 8 << 20  # bytes per socket write while streaming

#: ``(name, safetensors dtype code, shape)`` of one tensor of a part, in stream order.
Spec = tuple[str, str, Sequence[int]]


def _checkpoint_path(run: str, step: int | str) -> str:
    return CheckpointClient._path(run, step)


def _call(
    client: CheckpointClient,
    method: str,
    path: str,
    body: Iterable[bytes | memoryview] | None,
    length: int,
    content_type: str,
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """Send one request on a pooled connection of ``client``; give it back with
    ``client._done`` once the response is read."""
    return client._request(method, path, body, length, content_type=content_type)


def _json_call(client: CheckpointClient, method: str, path: str, obj: object | None) -> Any:
    data = None if obj is None else json.dumps(obj, separators=(",", ":")).encode()
    conn, response = _call(
        client, method, path, None if data is None else [data], len(data or b""),
        "application/json",
    )  # fmt: skip
    raw = response.read()
    client._done(conn, response)
    _raise_for(response.status, raw)
    return json.loads(raw)


def put_part(
    client: CheckpointClient,
    run: str,
    step: int,
    part: str,
    specs: Sequence[Spec],
    data: Callable[[], Iterator[memoryview | bytes]],
) -> dict[str, Any]:
    """Upload part ``part`` of checkpoint ``run/step``: the tensors ``specs`` (in order),
    whose bytes ``data()`` yields back to back (called again on each retry). Returns the
    service's JSON (``tensors``, ``raw_bytes``, ``stored_bytes``, ...)."""
    path = f"{_checkpoint_path(run, step)}/parts/{quote(check_part_name(part), safe='')}"
    prefix, header = encode_header(specs, {"format": FORMAT})

    def body() -> Iterator[memoryview | bytes]:
        yield prefix
        sent = 0
        for piece in data():
            view = memoryview(piece).cast("B")
            for off in range(0, len(view), _PIECE):
                yield view[off : off + _PIECE]
            sent += len(view)
        if sent != header.data_len:
            raise ValueError(f"part {part!r}: {sent} bytes of tensor data, not {header.data_len}")

    def attempt() -> dict[str, Any]:
        conn, response = _call(
            client, "PUT", path, body(), header.total_len, "application/octet-stream"
        )
        raw = response.read()
        client._done(conn, response)
        _raise_for(response.status, raw)
        out: dict[str, Any] = json.loads(raw)
        return out

    return client._retry(attempt)


def commit(
    client: CheckpointClient,
    run: str,
    step: int,
    parts: Sequence[str],
    metadata: Mapping[str, str],
) -> dict[str, Any]:
    """Make checkpoint ``run/step`` of ``parts`` visible, with ``metadata``; the record.

    A commit whose answer was lost (the connection died after it was sent) is asked again:
    a commit is idempotent by its part names, so the retry answers 200 if the first one
    landed. If no answer comes at all, the ServiceUnavailable says that the commit may have
    landed: the same save again is then accepted (docs/client.md, "Retries")."""
    body = {"parts": [check_part_name(p) for p in parts], "metadata": dict(metadata)}
    path = f"{_checkpoint_path(run, step)}/commit"
    try:
        out: dict[str, Any] = client._retry(lambda: _json_call(client, "POST", path, body))
    except ServiceUnavailable as exc:
        raise ServiceUnavailable(
            f"{exc.message}; the commit of {run}/{step} may have landed all the same: "
            "saving the same content again is accepted, other content is refused"
        ) from exc
    return out


def info(client: CheckpointClient, run: str, step: int | str) -> dict[str, Any]:
    """``{"checkpoint": record, "metadata": {...}, "tensors": [{"name","dtype","shape"}]}``
    of checkpoint ``run/step`` (``step`` may be ``"latest"``)."""
    path = f"{_checkpoint_path(run, step)}/info"
    out: dict[str, Any] = client._retry(lambda: _json_call(client, "GET", path, None))
    return out


def select(
    client: CheckpointClient,
    run: str,
    step: int,
    names: Iterable[str],
    consume: Callable[[TensorSpec, memoryview], None],
) -> int:
    """Fetch the tensors ``names`` of checkpoint ``run/step`` and hand each to
    ``consume(spec, data)`` as it arrives (``data`` is valid during the call only), checked
    against its checksum. Each tensor is consumed once: a retry after a cut connection asks
    for the rest only. Returns the bytes of tensor data received."""
    left = dict.fromkeys(names)  # the names not consumed yet, in the order asked
    path = f"{_checkpoint_path(run, step)}/select"
    received = 0

    def attempt() -> None:
        nonlocal received
        if not left:
            return
        raw = json.dumps({"names": list(left)}, separators=(",", ":")).encode()
        conn, response = _call(client, "POST", path, [raw], len(raw), "application/json")
        try:
            if response.status >= 300:
                _raise_for(response.status, response.read())
            header = _read_header(response)
            sums = json.loads(header.metadata.get(_CHECKSUMS_KEY, "{}"))
            unasked = {t.name for t in header.tensors} - left.keys()
            if unasked or len(header.tensors) != len(left):
                raise InvalidStream(
                    f"select of {len(left)} tensors answered {len(header.tensors)}"
                    + (f", among them {sorted(unasked)[:3]} not asked for" if unasked else "")
                )
            for spec in header.tensors:
                buf = np.empty(spec.nbytes, np.uint8).data
                _read_into(response, buf, lambda n: None)
                want = sums.get(spec.name)
                if want is not None and xxhash.xxh3_128_hexdigest(buf) != want:
                    raise CorruptData(f"tensor {spec.name!r} arrived corrupted (checksum mismatch)")
                consume(spec, buf)
                del left[spec.name]
                received += spec.nbytes
            if response.read(1):
                raise InvalidStream("response is longer than its header says")
        except BaseException:
            conn.close()
            raise
        client._done(conn, response)

    client._retry(attempt)
    return received


def full_state_if_distributed(
    tensors: dict[str, Any], metadata: Mapping[str, str], map_location: Any
) -> Any:
    """:meth:`CheckpointClient.load`'s hook for a checkpoint without a skeleton: a plain
    safetensors file stays the flat dict ``tensors``; a DCP checkpoint, which the service
    serves as its full tensors, becomes its state dict (:func:`ckptstore.dcp.full_state`).
    Imports torch.distributed.checkpoint only for such checkpoints."""
    if metadata.get(LAYOUT_KEY) != FULL:
        return tensors
    from ckptstore.dcp import full_state_if_dcp

    return full_state_if_dcp(tensors, metadata, map_location)
