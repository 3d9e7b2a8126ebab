"""Fixtures of the raw-HTTP API tests."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from support.bodies import client_for, close_clients
from support.serviceproc import Service


@pytest.fixture(scope="module", autouse=True)
def _close_clients() -> Iterator[None]:
    """The keep-alive clients ``support.bodies.client_for`` opened, closed after each module."""
    yield
    close_clients()


@pytest.fixture(scope="module")
def http(service: Service) -> httpx.Client:
    """A keep-alive httpx client of the module's ``service``."""
    return client_for(service)
