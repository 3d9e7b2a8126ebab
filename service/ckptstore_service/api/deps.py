"""Typed dependencies of the routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from ckptstore_service.runtime import Runtime

__all__ = ["RuntimeDep"]


def _runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(_runtime)]
