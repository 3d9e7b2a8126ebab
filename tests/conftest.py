"""Fixtures for every test folder: databases, real services, the S3 server (helpers: support/)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from support.pg import pg_database
from support.s3server import fake_aws_credentials, start_moto
from support.serviceproc import Service


def pytest_configure(config: pytest.Config) -> None:
    """Compile the codec's numba kernels into their on-disk cache once, before any worker
    starts: a fresh clone's first service start compiles them (~20 s on the 2-core machine),
    and two workers' first services compiling at once under load overran the 30 s a test
    gives a service to start (a whole module's fixture failed in a fresh-clone CI run)."""
    if hasattr(config, "workerinput"):
        return  # a pytest-xdist worker: the controller has done it
    from ckptstore_core import planes

    planes.warm_up()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database on each backend: SQLite and the real PostgreSQL."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'catalog.sqlite3'}"
    else:
        with pg_database() as url:
            yield url


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh database on the real PostgreSQL server."""
    with pg_database() as url:
        yield url


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """A real ckptstore service (uvicorn, SQLite + local folder) shared by a test module."""
    with Service(tmp_path_factory.mktemp("service")) as svc:
        yield svc


@pytest.fixture
def make_service(tmp_path: Path) -> Iterator[Callable[..., Service]]:
    """``make_service(env=None, data_dir=None)`` starts a service; all stop after the test."""
    started: list[Service] = []

    def make(env: dict[str, str] | None = None, data_dir: Path | None = None) -> Service:
        svc = Service(data_dir or tmp_path / f"svc{len(started)}", env).start()
        started.append(svc)
        return svc

    yield make
    for svc in started:
        svc.stop()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server for the session, with dummy credentials in the environment.

    Not skipped when moto is missing or will not start: the S3 backend must be tested.
    """
    with fake_aws_credentials():
        url, stop = start_moto()
        try:
            yield url
        finally:
            stop()


@pytest.fixture(scope="module")
def own_moto() -> Iterator[tuple[str, int]]:
    """A moto S3 server of the test module's own, ``(url, pid)``, for tests that freeze it
    (``support.s3server.frozen``): freezing the session's would stall every other test."""
    from support.s3server import fake_aws_credentials, start_moto_process

    with fake_aws_credentials():
        url, stop, pid = start_moto_process()
        try:
            yield url, pid
        finally:
            stop()
