"""A throwaway database on the machine's real PostgreSQL server.

The server is found through CKPTSTORE_TEST_PG_URL (default: postgres@127.0.0.1:5432). When it
is unreachable the tests that need it are skipped on a developer's machine, but under CI=true
they fail: PostgreSQL is a required service there.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

__all__ = ["PG_URL", "pg_database"]

PG_URL = os.environ.get(
    "CKPTSTORE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


@contextmanager
def pg_database() -> Iterator[str]:
    """Create a fresh database, yield its URL, drop it afterwards."""
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    name = f"ckptstore_test_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:
        admin.dispose()
        message = f"PostgreSQL unreachable at {PG_URL}: {exc}"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    try:
        yield make_url(PG_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
