"""The tokens table on both backends (catalog/tokens.py): a name is unique among the tokens
in use and free again once revoked; look-ups find only tokens in use, by hash."""

from __future__ import annotations

import pytest

from ckptstore_core.errors import InvalidRequest
from ckptstore_service.auth import hash_token, issue_token
from ckptstore_service.catalog import Catalog


def test_tokens_by_hash_names_unique_in_use(database_url: str) -> None:
    catalog = Catalog(database_url)
    try:
        catalog.upgrade()
        store = catalog.tokens
        secret, info = issue_token(store, "ci", "write", "team-a-*")
        assert store.find(hash_token(secret)) == info
        assert (info.scope, info.runs, info.revoked) == ("write", "team-a-*", None)
        assert store.find(hash_token(secret + "x")) is None
        with pytest.raises(InvalidRequest, match="exists already"):
            issue_token(store, "ci", "read", "*")

        revoked = store.revoke("ci")
        assert revoked is not None and revoked.revoked is not None
        assert store.find(hash_token(secret)) is None
        assert store.revoke("ci") is None  # nothing in use by that name
        again, new = issue_token(store, "ci", "read", "*")  # the name is free again
        assert new.runs is None  # "*" is every run
        assert store.revoke(str(new.id)) == store.list(revoked=True)[-1]
        assert [t.name for t in store.list()] == []
        assert [t.id for t in store.list(revoked=True)] == [info.id, new.id]
        assert store.find(hash_token(again)) is None
    finally:
        catalog.close()


@pytest.mark.parametrize("runs", ["", " ", "  ", None, "a,", ",a", "a b"])
def test_a_token_for_every_run_is_asked_for_with_a_star(
    database_url: str, runs: str | None
) -> None:
    """An empty, blank or missing run pattern is refused: only ``*`` covers every run."""
    catalog = Catalog(database_url)
    try:
        catalog.upgrade()
        with pytest.raises(InvalidRequest, match="run pattern"):
            issue_token(catalog.tokens, "ci", "write", runs)
        assert catalog.tokens.list() == []
    finally:
        catalog.close()


def test_a_token_named_by_digits_before_they_were_refused_is_revoked_by_name(
    database_url: str,
) -> None:
    """A name comes first, an id second: the token named "1" (as an older replica let a
    token be named) is revoked by its name, and the token of id 1 stays in use."""
    catalog = Catalog(database_url)
    try:
        catalog.upgrade()
        store = catalog.tokens
        _, first = issue_token(store, "first", "read", "*")
        digits = store.create(str(first.id), "read", None, hash_token("old"))  # not checked
        revoked = store.revoke(str(first.id))
        assert revoked is not None and revoked.id == digits.id
        assert [t.id for t in store.list()] == [first.id]
        revoked = store.revoke(str(first.id))  # no name left: the id
        assert revoked is not None and revoked.id == first.id
        assert store.list() == []
        assert store.revoke(str(1 << 63)) is None  # an id no column holds: none
    finally:
        catalog.close()
