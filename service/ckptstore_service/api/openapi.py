"""What ``/openapi.json`` says beyond the routes' signatures: the safetensors stream that a
save sends and a load returns, and the error bodies of each status.

Each route names the errors it raises; their codes, per status, are read from the error tree
(:mod:`ckptstore_core.errors`, plus the classes the service adds) with each class's summary. Every
operation also documents a ``default`` error response: any other status (405 for a method
the path does not take, say) comes in the same body, and FastAPI adds its 422 validation
error only to operations without one; the service never answers 422 (a parameter that fails
validation is a 400 ``invalid_request``).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from ckptstore_core.errors import CkptStoreError, InternalError, error_types
from ckptstore_service.api.schemas import ErrorBody

__all__ = ["CHECKPOINT_STREAM", "SAFETENSORS_BODY", "error_responses"]

_BINARY = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
_FRAMING = (
    "one safetensors stream: a u64 little-endian header length N, N bytes of JSON header "
    '(`{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}`), then the tensor '
    "bytes back to back in header order"
)

#: ``openapi_extra`` of the save: the route reads its body as a stream, not as a parameter.
SAFETENSORS_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": (
            f"The checkpoint as {_FRAMING}. `CheckpointClient.save` sends one (with the "
            '`"format": "ckptstore/1"` metadata and the state\'s skeleton); a plain '
            "safetensors file is stored as it is. A torch.save file or any other format is a "
            "400 `invalid_stream`."
        ),
        "content": _BINARY,
    },
    "parameters": [
        {
            "name": "Content-Length",
            "in": "header",
            "required": False,
            "schema": {"type": "integer", "minimum": 0},
            "description": (
                "The stream's length in bytes; it must agree with the header (else 400 "
                "`invalid_stream`). Without it the body may come chunked "
                "(`Transfer-Encoding: chunked`)."
            ),
        }
    ],
}

#: The load's 200 response: a stream, not JSON.
CHECKPOINT_STREAM: dict[str, Any] = {
    "description": (
        f"The checkpoint, rebuilt bit for bit, as {_FRAMING}; only the tensors under "
        "`prefix` when one is given."
    ),
    "content": _BINARY,
    "headers": {
        "X-Ckptstore-Step": {
            "description": "The step served: what `latest` resolved to",
            "schema": {"type": "integer", "minimum": 0},
        },
        "Content-Length": {
            "description": "The length of the whole stream, known before the first byte",
            "schema": {"type": "integer", "minimum": 0},
        },
    },
}


def _tree(errors: tuple[type[CkptStoreError], ...]) -> list[type[CkptStoreError]]:
    """``errors`` and their subclasses, once each, in the tree's order."""
    return [cls for cls in error_types() if issubclass(cls, errors)]


def error_responses(*errors: type[CkptStoreError]) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route that raises ``errors`` (each with its subclasses) and,
    like any route, InternalError: the error body under each of their statuses, with the
    codes listed, plus ``default`` for any other status."""
    by_status: dict[int, list[str]] = {}
    for cls in _tree((*errors, InternalError)):
        summary = (cls.__doc__ or "").strip().split("\n")[0]
        line = f"- `{cls.code}`: {summary}" if summary else f"- `{cls.code}`"
        by_status.setdefault(cls.status, []).append(line)
    out: dict[int | str, dict[str, Any]] = {
        status: {
            "model": ErrorBody,
            "description": f"{HTTPStatus(status).phrase}; `error.code` is one of:\n\n"
            + "\n".join(lines),
        }
        for status, lines in sorted(by_status.items())
    }
    out["default"] = {
        "model": ErrorBody,
        "description": "Any other error, in the same body: 404 `not_found` for a path no "
        "route takes, 405 for a method the path does not take",
    }
    return out
