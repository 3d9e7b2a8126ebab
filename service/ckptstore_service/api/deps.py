"""Typed dependencies of the routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from ckptstore_service.api.body import Uploads
from ckptstore_service.maintenance import Maintenance
from ckptstore_service.runtime import Runtime

__all__ = ["MaintenanceDep", "RuntimeDep", "UploadLimiterDep"]


def _runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(_runtime)]


def _uploads(request: Request) -> Uploads:
    """Threads for uploads in progress, apart from the pool that the other routes share,
    and how slow a body may be."""
    uploads: Uploads = request.app.state.uploads
    return uploads


UploadLimiterDep = Annotated[Uploads, Depends(_uploads)]


def _maintenance(request: Request) -> Maintenance:
    maintenance: Maintenance = request.app.state.maintenance
    return maintenance


MaintenanceDep = Annotated[Maintenance, Depends(_maintenance)]
