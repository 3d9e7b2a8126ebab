"""The HTTP calls of multi-part checkpoints, over a :class:`~ckptstore.Transport` (or a
:class:`~ckptstore.CheckpointClient`'s: each function takes either).

A distributed save uploads one *part* per rank and commits them once::

    POST /v1/runs/{run}/checkpoints/{step}/parts/{part}/check  {"header", "checksums"}
    PUT  /v1/runs/{run}/checkpoints/{step}/parts/{part}   a safetensors stream (no skeleton)
    POST /v1/runs/{run}/checkpoints/{step}/commit         {"parts": [...], "metadata": {...}}

and a distributed load asks for what one rank needs::

    GET  /v1/runs/{run}/checkpoints/{step}/info           record, metadata, tensor list
    POST /v1/runs/{run}/checkpoints/{step}/select         {"names": [...]} -> safetensors stream

Parts are invisible until the commit and idempotent (the same part with the same content is a
200), and a retried commit with the same parts is a 200, so every call here is retried like a
save on connection errors and 503s. Before a part's body goes, :func:`put_part` asks
whether the step is committed already (its header only: one small request); only if it is
are the part's tensors hashed (``data()`` once, nothing sent) and their checksums compared
with the committed content: the same, and the body is never sent; other, a 409. A
``select`` response is consumed tensor by tensor, each checked against the checksum the
service recorded at save time; a retry after a cut asks only for the tensors not consumed
yet, so the caller sees each tensor exactly once.

Used by :mod:`ckptstore.dcp`; torch-free (the caller turns bytes into tensors).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import closing
from typing import Any
from urllib.parse import quote

import numpy as np
import xxhash

from ckptstore.transport import (
    PIECE,
    Transport,
    UsesTransport,
    check_tensor,
    checkpoint_path,
    checksums_of,
    digest,
    read_header,
    read_into,
    transport_of,
)
from ckptstore_core.dcp_layout import FULL, LAYOUT_KEY
from ckptstore_core.errors import CkptStoreError, InvalidStream, ServiceUnavailable
from ckptstore_core.names import PART_NAME_RULE, check_part_name
from ckptstore_core.wire import FORMAT, Header, TensorSpec, encode_header

__all__ = [
    "PART_NAME_RULE",
    "check_part_name",
    "commit",
    "full_state_if_distributed",
    "info",
    "put_part",
    "select",
    "tensor_checksums",
]

#: ``(name, safetensors dtype code, shape)`` of one tensor of a part, in stream order.
Spec = tuple[str, str, Sequence[int]]
#: What the functions here send through: a transport, or what has one (a client).
Via = Transport | UsesTransport


def put_part(
    client: Via,
    run: str,
    step: int,
    part: str,
    specs: Sequence[Spec],
    data: Callable[[], Iterator[memoryview | bytes]],
    *,
    direct: bool = False,
) -> dict[str, Any]:
    """Upload part ``part`` of checkpoint ``run/step``: the tensors ``specs`` (in order),
    whose bytes ``data()`` yields back to back (called again on each retry). Returns the
    service's JSON (``tensors``, ``raw_bytes``, ``stored_bytes``, ...). ``direct``: encoded
    here and sent encoded (:mod:`ckptstore.direct`), against what this process last sent
    or loaded of the run. A step committed already is compared first, without the body
    (:func:`_committed_already`): the same content returns the service's record of the part
    compared (``committed`` true, ``stored_bytes`` 0); other content raises
    CheckpointExists."""
    transport = transport_of(client)
    path = f"{checkpoint_path(run, step)}/parts/{quote(check_part_name(part), safe='')}"
    prefix, header = encode_header(specs, {"format": FORMAT})
    done = _committed_already(transport, f"{path}/check", prefix, header, data)
    if done is not None:
        return done
    if direct:
        return _put_encoded(transport, run, step, part, specs, data)

    def body() -> Iterator[memoryview | bytes]:
        yield prefix
        sent = 0
        for piece in data():
            view = memoryview(piece).cast("B")
            for off in range(0, len(view), PIECE):
                yield view[off : off + PIECE]
            sent += len(view)
        if sent != header.data_len:
            raise ValueError(f"part {part!r}: {sent} bytes of tensor data, not {header.data_len}")

    def attempt() -> dict[str, Any]:
        out: dict[str, Any] = transport.send("PUT", path, body(), header.total_len)
        return out

    return transport.retry(attempt)


def _committed_already(
    transport: Transport,
    path: str,
    prefix: bytes,
    header: Header,
    data: Callable[[], Iterator[memoryview | bytes]],
) -> dict[str, Any] | None:
    """The service's record of a part whose step is committed with its content already
    (its body need not be sent), else None (send it). Asks ``path`` (``.../check``) with
    the part's header only; only for a committed step does it hash the part's tensors
    (``data()`` once) and ask again with their checksums. CheckpointExists for other
    content. A service without the route (older, during a rolling upgrade) answers a plain
    404: the part is uploaded, as before the route."""
    doc: dict[str, Any] = {"header": bytes(prefix[8:]).decode()}
    try:
        answer = transport.call("POST", path, doc)
    except CkptStoreError as exc:
        if type(exc) is CkptStoreError and exc.status in (404, 405):
            return None  # a service older than the route (a rolling upgrade): upload
        raise
    if not answer["committed"]:
        return None
    doc["checksums"] = tensor_checksums(header, data())
    answer = transport.call("POST", path, doc)
    if not answer.get("same"):  # a step deleted between the two questions: upload it
        return None
    part: dict[str, Any] = answer["part"]
    return part


def tensor_checksums(header: Header, data: Iterable[memoryview | bytes]) -> dict[str, str]:
    """The xxh3-128 hex of each of ``header``'s tensors, by name, from their bytes ``data``
    (back to back, cut anywhere): what the service records of each (``TensorInfo.sent``)."""
    specs = header.tensors
    hashers = [xxhash.xxh3_128() for _ in specs]
    pos, i = 0, 0  # bytes seen; the first tensor that may still take some
    for piece in data:
        view = memoryview(piece).cast("B")
        if pos + len(view) > header.data_len:
            raise ValueError(f"more than the header's {header.data_len} bytes of tensor data")
        while len(view):
            while specs[i].end <= pos:
                i += 1
            take = min(specs[i].end - pos, len(view))
            hashers[i].update(view[:take])
            view, pos = view[take:], pos + take
    if pos != header.data_len:
        raise ValueError(f"{pos} bytes of tensor data, not {header.data_len}")
    return {spec.name: h.hexdigest() for spec, h in zip(specs, hashers, strict=True)}


def _put_encoded(
    transport: Transport,
    run: str,
    step: int,
    part: str,
    specs: Sequence[Spec],
    data: Callable[[], Iterator[memoryview | bytes]],
) -> dict[str, Any]:
    """:func:`put_part` with ``direct=True``. The part's raw bytes become the run's base
    at once: a rank never learns of the commit, and a base whose checksums match no parent
    is never diffed against."""
    from ckptstore.direct import shared_writer, tensor_pieces  # the codec: only when used

    writer = shared_writer()
    path = checkpoint_path(run, step)
    sent = transport.retry(
        lambda: writer.save_part(
            transport, path, run, check_part_name(part), specs, lambda: tensor_pieces(specs, data())
        )
    )
    writer.keep(sent)
    out: dict[str, Any] = sent.answer
    return out


def commit(
    client: Via,
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
    path = f"{checkpoint_path(run, step)}/commit"
    try:
        out: dict[str, Any] = transport_of(client).call("POST", path, body)
    except ServiceUnavailable as exc:
        raise ServiceUnavailable(
            f"{exc.message}; the commit of {run}/{step} may have landed all the same: "
            "saving the same content again is accepted, other content is refused"
        ) from exc
    return out


def info(client: Via, run: str, step: int | str) -> dict[str, Any]:
    """``{"checkpoint": record, "metadata": {...}, "tensors": [{"name","dtype","shape"}]}``
    of checkpoint ``run/step`` (``step`` may be ``"latest"``)."""
    path = f"{checkpoint_path(run, step)}/info"
    out: dict[str, Any] = transport_of(client).call("GET", path)
    return out


def select(
    client: Via,
    run: str,
    step: int,
    names: Iterable[str],
    consume: Callable[[TensorSpec, memoryview], None],
    *,
    direct: bool = False,
) -> int:
    """Fetch the tensors ``names`` of checkpoint ``run/step`` and hand each to
    ``consume(spec, data)`` as it arrives (``data`` is valid during the call only), checked
    against its checksum. Each tensor is consumed once: a retry after a cut connection asks
    for the rest only. Returns the bytes of tensor data received. ``direct``: their stored
    chunks are fetched and decoded here (:mod:`ckptstore.direct_load`), each tensor handed
    over as soon as it is decoded (one held at a time), and kept as this process's base of
    the run for its next direct save."""
    transport = transport_of(client)
    left = dict.fromkeys(names)  # the names not consumed yet, in the order asked
    path = f"{checkpoint_path(run, step)}/select"
    received = 0

    def attempt() -> None:
        nonlocal received
        if not left:
            return
        if direct:
            from ckptstore.direct import shared_writer  # the codec: only when used
            from ckptstore.direct_load import each_direct

            # one tensor held at a time: each consumed as soon as it is decoded; closed at
            # once if ``consume`` raises (the decoder's queue cancelled, the base kept)
            keep = shared_writer().loaded
            with closing(each_direct(transport, run, step, list(left), keep_base=keep)) as got:
                for t, buf in got:
                    consume(TensorSpec(t.name, t.dtype, t.shape, 0, t.nbytes), buf)
                    del left[t.name]
                    received += t.nbytes
            return
        raw = json.dumps({"names": list(left)}, separators=(",", ":")).encode()
        with transport.stream("POST", path, [raw], len(raw), "application/json") as response:
            header = read_header(response)
            sums = checksums_of(header)
            unasked = {t.name for t in header.tensors} - left.keys()
            if unasked or len(header.tensors) != len(left):
                raise InvalidStream(
                    f"select of {len(left)} tensors answered {len(header.tensors)}"
                    + (f", among them {sorted(unasked)[:3]} not asked for" if unasked else "")
                )
            for spec in header.tensors:
                buf = np.empty(spec.nbytes, np.uint8).data
                read_into(response, buf, lambda n: None)
                check_tensor(spec.name, digest(buf), sums)
                consume(spec, buf)
                del left[spec.name]
                received += spec.nbytes
            if response.read(1):
                raise InvalidStream("response is longer than its header says")

    transport.retry(attempt)
    return received


def full_state_if_distributed(
    tensors: dict[str, Any], metadata: Mapping[str, str], map_location: Any
) -> Any:
    """:meth:`CheckpointClient.load`'s hook for a checkpoint without a skeleton: a plain
    safetensors file stays the flat dict ``tensors``; a DCP checkpoint, which the service
    serves as its full tensors, becomes its state dict
    (:func:`ckptstore.dcp_metadata.full_state`). Imports torch.distributed.checkpoint only
    for such checkpoints."""
    if metadata.get(LAYOUT_KEY) != FULL:
        return tensors
    from ckptstore.dcp_metadata import full_state_if_dcp

    return full_state_if_dcp(tensors, metadata, map_location)
