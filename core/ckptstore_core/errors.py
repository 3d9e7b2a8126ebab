"""The one error tree shared by the service (which raises) and the client (which re-raises).

Every error has a stable ``code`` (what goes on the wire) and an HTTP ``status``. The service
renders it as ``{"error": {"code": ..., "message": ...}}``; the client maps the code back to
the same class, so ``except CheckpointNotFound`` works on both sides of the wire.

    CkptStoreError
    ├── InvalidRequest            400 invalid_request   bad run name, bad step, bad query
    ├── InvalidStream             400 invalid_stream    malformed safetensors body
    │   └── UnsupportedDtype      400 unsupported_dtype dtype outside the table in wire.py
    ├── Unauthorized              401 unauthorized      no token, or one the service does
    │                                                     not know (wrong, revoked)
    ├── Forbidden                 403 forbidden         the token's scope or run pattern
    │   │                                                 does not cover the request
    │   └── UrlExpired            403 url_expired       client side: a presigned store URL
    │                                                     expired (a direct save: plan again)
    ├── NotFound                  404 not_found         unknown route
    │   ├── RunNotFound           404 run_not_found
    │   └── CheckpointNotFound    404 checkpoint_not_found
    ├── CheckpointExists          409 checkpoint_exists same step, different content
    ├── RunBusy                   409 run_busy          the run is in a state that refuses
    │                                                     the request now (retry later)
    ├── CheckpointPinned          409 checkpoint_pinned a delete of a pinned checkpoint
    │                                                     (unpin it first)
    ├── RequestTimeout            408 request_timeout   an upload's body stalled or crawled
    │                                                     past the limits (retry)
    ├── PayloadTooLarge           413 payload_too_large header or body over the limits
    ├── CorruptData               500 corrupt_data      checksum mismatch on read
    ├── InternalError             500 internal_error    a bug: anything not translated
    ├── StorageUnavailable        503 storage_unavailable blob store or database unreachable
    │   │                                                 (or refusing connections: full)
    │   └── LockLost              503 lock_lost         the run's lock was lost (its lease
    │                                                     expired, another writer took it):
    │                                                     the commit is refused, retry
    ├── TooManyUploads            503 too_many_uploads  this client (token or address)
    │                                                     holds its share of the upload
    │                                                     slots already (Retry-After)
    └── ServiceUnavailable        503 service_unavailable client side: the service cannot
                                                          be reached (after retries)

This module is stdlib-only: the service imports it without pulling torch.
"""

from __future__ import annotations

__all__ = [
    "CheckpointExists",
    "CheckpointNotFound",
    "CheckpointPinned",
    "CkptStoreError",
    "CorruptData",
    "Forbidden",
    "InternalError",
    "InvalidRequest",
    "InvalidStream",
    "LockLost",
    "NotFound",
    "PayloadTooLarge",
    "RunBusy",
    "RunNotFound",
    "ServiceUnavailable",
    "StorageUnavailable",
    "TooManyUploads",
    "Unauthorized",
    "UnsupportedDtype",
    "UrlExpired",
    "error_from_code",
    "error_types",
]


class CkptStoreError(Exception):
    """Base of every ckptstore error. ``code`` is stable; ``status`` is the HTTP status."""

    code = "error"
    status = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_json(self) -> dict[str, dict[str, str]]:
        return {"error": {"code": self.code, "message": self.message}}


class InvalidRequest(CkptStoreError):
    """Bad run name, bad step, bad query or header."""

    code = "invalid_request"
    status = 400


class InvalidStream(CkptStoreError):
    """The body is not a valid safetensors stream (malformed, truncated, not safetensors)."""

    code = "invalid_stream"
    status = 400


class UnsupportedDtype(InvalidStream):
    """A tensor's dtype is none of those the wire format carries (wire.DTYPE_SIZES)."""

    code = "unsupported_dtype"


class Unauthorized(CkptStoreError):
    """The request carries no bearer token, or one the service does not know (wrong,
    revoked). Never retried: the same token gets the same answer."""

    code = "unauthorized"
    status = 401


class Forbidden(CkptStoreError):
    """The token is valid but its scope (read < write < admin) or its run pattern does not
    cover the request. Never retried."""

    code = "forbidden"
    status = 403


class UrlExpired(Forbidden):
    """A presigned store URL (a direct save's or load's) has expired: plan again."""

    code = "url_expired"


class NotFound(CkptStoreError):
    """No such route."""

    code = "not_found"
    status = 404


class RunNotFound(NotFound):
    """The run has no committed checkpoint."""

    code = "run_not_found"


class CheckpointNotFound(NotFound):
    """The run has no committed checkpoint of that step."""

    code = "checkpoint_not_found"


class CheckpointExists(CkptStoreError):
    """The step is stored already, with different content."""

    code = "checkpoint_exists"
    status = 409


class RunBusy(CkptStoreError):
    """The run cannot take the request now: e.g. a delete while a checkpoint of the run is
    being written in parts (uploaded, not committed). Retry once that is over."""

    code = "run_busy"
    status = 409


class CheckpointPinned(CkptStoreError):
    """A delete names a pinned checkpoint (or a run holding one): pinned checkpoints are
    never deleted, by hand or by retention. Unpin it first. Never retried."""

    code = "checkpoint_pinned"
    status = 409


class RequestTimeout(CkptStoreError):
    """The upload's body stalled: no byte for the service's idle timeout, or fewer than its
    minimum rate over a window. Nothing was stored; the slot and the run's lock are free
    again. The client retries it, sending the body anew."""

    code = "request_timeout"
    status = 408


class PayloadTooLarge(CkptStoreError):
    """The header or the whole checkpoint is over the service's limits."""

    code = "payload_too_large"
    status = 413


class CorruptData(CkptStoreError):
    """Stored data failed its checksum or structure checks on read."""

    code = "corrupt_data"
    status = 500


class InternalError(CkptStoreError):
    """A bug: an error nothing translated."""

    code = "internal_error"
    status = 500


class StorageUnavailable(CkptStoreError):
    """The blob store or the database cannot be reached."""

    code = "storage_unavailable"
    status = 503


class LockLost(StorageUnavailable):
    """The lock a write held was lost before its commit (a lease that expired while the
    database was unreachable, taken over by another writer): the commit is refused, nothing
    of the write is visible, and a retry starts afresh."""

    code = "lock_lost"


class TooManyUploads(CkptStoreError):
    """The client (its token, or its address without one) has its share of the service's
    upload slots in use already: retry once one of its uploads is done."""

    code = "too_many_uploads"
    status = 503


class ServiceUnavailable(CkptStoreError):
    """Client side: the service cannot be reached (after retries)."""

    code = "service_unavailable"
    status = 503


def _all_subclasses(cls: type[CkptStoreError]) -> list[type[CkptStoreError]]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


def error_types() -> list[type[CkptStoreError]]:
    """Every error class below :class:`CkptStoreError` defined so far, parents first: this
    tree, plus any a later import adds (the service's storage layer defines one)."""
    return _all_subclasses(CkptStoreError)


_BY_CODE = {cls.code: cls for cls in error_types()}


def error_from_code(code: str, message: str, status: int) -> CkptStoreError:
    """The exception for a wire ``code``; an unknown code keeps its status on the base class."""
    cls = _BY_CODE.get(code)
    if cls is None:
        err = CkptStoreError(f"[{code}] {message}")
        err.status = status
        return err
    return cls(message)
