"""ckptstore client: save and load training checkpoints through a ckptstore service.

``import ckptstore`` does not import torch: the wire format and codec are torch-free and the
service uses them. ``CheckpointClient`` (and the state-dict code) import torch on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptstore_core.errors import (
    CheckpointExists,
    CheckpointNotFound,
    CkptStoreError,
    CorruptData,
    InternalError,
    InvalidRequest,
    InvalidStream,
    NotFound,
    PayloadTooLarge,
    RunNotFound,
    ServiceUnavailable,
    StorageUnavailable,
    UnsupportedDtype,
)

if TYPE_CHECKING:
    from ckptstore.client import CheckpointClient, CheckpointInfo, RunInfo

__version__ = "0.1.0"

__all__ = [
    "CheckpointClient",
    "CheckpointExists",
    "CheckpointInfo",
    "CheckpointNotFound",
    "CkptStoreError",
    "CorruptData",
    "InternalError",
    "InvalidRequest",
    "InvalidStream",
    "NotFound",
    "PayloadTooLarge",
    "RunInfo",
    "RunNotFound",
    "ServiceUnavailable",
    "StorageUnavailable",
    "UnsupportedDtype",
]


def __getattr__(name: str) -> Any:
    if name in ("CheckpointClient", "CheckpointInfo", "RunInfo"):
        from ckptstore import client

        return getattr(client, name)
    raise AttributeError(f"module 'ckptstore' has no attribute {name!r}")
