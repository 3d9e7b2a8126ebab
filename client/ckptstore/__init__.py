"""ckptstore client: save and load training checkpoints through a ckptstore service.

``import ckptstore`` does not import torch: the wire format and codec are torch-free and the
service uses them. ``CheckpointClient`` (and the state-dict code) import torch on first use;
``Transport`` (the HTTP every client module shares) never does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptstore_core.errors import (
    CheckpointExists,
    CheckpointNotFound,
    CheckpointPinned,
    CkptStoreError,
    CorruptData,
    Forbidden,
    InternalError,
    InvalidRequest,
    InvalidStream,
    LockLost,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
    RunBusy,
    RunNotFound,
    ServiceUnavailable,
    StorageUnavailable,
    TooManyUploads,
    Unauthorized,
    UnsupportedDtype,
    UrlExpired,
)
from ckptstore_core.lossy import Lossy

if TYPE_CHECKING:
    from ckptstore.client import CheckpointClient, CheckpointInfo, RunInfo
    from ckptstore.transport import Transport

__version__ = "0.1.0"

__all__ = [
    "CheckpointClient",
    "CheckpointExists",
    "CheckpointInfo",
    "CheckpointNotFound",
    "CheckpointPinned",
    "CkptStoreError",
    "CorruptData",
    "Forbidden",
    "InternalError",
    "InvalidRequest",
    "InvalidStream",
    "LockLost",
    "Lossy",
    "NotFound",
    "PayloadTooLarge",
    "RequestTimeout",
    "RunInfo",
    "RunBusy",
    "RunNotFound",
    "ServiceUnavailable",
    "StorageUnavailable",
    "TooManyUploads",
    "Transport",
    "Unauthorized",
    "UnsupportedDtype",
    "UrlExpired",
]


def __getattr__(name: str) -> Any:
    if name in ("CheckpointClient", "CheckpointInfo", "RunInfo"):
        from ckptstore import client

        return getattr(client, name)
    if name == "Transport":
        from ckptstore.transport import Transport

        return Transport
    raise AttributeError(f"module 'ckptstore' has no attribute {name!r}")
