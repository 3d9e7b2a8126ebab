"""Typed dependencies of the routes."""

from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import Depends, Request

from ckptstore_service.maintenance import Maintenance
from ckptstore_service.runtime import Runtime

__all__ = ["MaintenanceDep", "RuntimeDep", "UploadLimiterDep"]


def _runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(_runtime)]


def _upload_limiter(request: Request) -> anyio.CapacityLimiter:
    """Threads for uploads in progress, apart from the pool that the other routes share."""
    limiter: anyio.CapacityLimiter = request.app.state.upload_limiter
    return limiter


UploadLimiterDep = Annotated[anyio.CapacityLimiter, Depends(_upload_limiter)]


def _maintenance(request: Request) -> Maintenance:
    maintenance: Maintenance = request.app.state.maintenance
    return maintenance


MaintenanceDep = Annotated[Maintenance, Depends(_maintenance)]
