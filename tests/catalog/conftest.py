"""Fixtures of the catalog tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ckptstore_service.catalog import Catalog


@pytest.fixture
def catalog(database_url: str) -> Iterator[Catalog]:
    """A migrated catalog on each backend (``database_url``: SQLite and PostgreSQL)."""
    cat = Catalog(database_url)
    cat.upgrade()
    yield cat
    cat.close()
