"""Scopes, run patterns, token names and the auth default (core/ckptstore_core/access.py,
service/ckptstore_service/auth.py): the rules both sides of the wire apply."""

from __future__ import annotations

import hashlib

import pytest

from ckptstore_core.access import (
    SCOPES,
    check_run_pattern,
    check_scope,
    check_token_name,
    pattern_matches,
    scope_allows,
)
from ckptstore_core.errors import Forbidden, InvalidRequest, Unauthorized, error_from_code
from ckptstore_service.auth import (
    Principal,
    auth_required,
    hash_token,
    is_loopback,
    new_token,
)


def test_scopes_are_ordered() -> None:
    assert SCOPES == ("read", "write", "admin")
    allowed = {(have, need) for have in SCOPES for need in SCOPES if scope_allows(have, need)}
    assert allowed == {
        ("read", "read"),
        ("write", "read"),
        ("write", "write"),
        ("admin", "read"),
        ("admin", "write"),
        ("admin", "admin"),
    }
    with pytest.raises(InvalidRequest, match="read, write, admin"):
        check_scope("root")


@pytest.mark.parametrize(
    ("pattern", "run", "covered"),
    [
        ("team-a-*", "team-a-exp1", True),
        ("team-a-*", "team-a-", True),  # * may stand for nothing
        ("team-a-*", "team-b-exp1", False),
        ("team-a-*", "xteam-a-1", False),  # the whole name must match
        ("*-eval", "gpt2-eval", True),
        ("exp.*.v2", "exp.7.v2", True),
        ("exp.*.v2", "exp-7-v2", False),  # . is a character, not a wildcard
        ("team-a-*,shared", "shared", True),
        ("team-a-*,shared", "shared2", False),
        ("team-a-*", "team-a-x/../b", False),  # * covers run-name characters only
        ("*", "anything.at_all-1", True),
        (None, "any-run", True),
    ],
)
def test_run_patterns(pattern: str | None, run: str, covered: bool) -> None:
    assert pattern_matches(pattern, run) is covered
    assert Principal("t", "read", pattern).covers(run) is covered


@pytest.mark.parametrize("bad", ["", "team/a-*", "a,,b", "a b", "x" * 129, "team-a-?", "é*"])
def test_bad_run_patterns_name_the_rule(bad: str) -> None:
    with pytest.raises(InvalidRequest, match="comma-separated list of globs"):
        check_run_pattern(bad)


def test_token_names() -> None:
    assert check_token_name("ci-team-a.1") == "ci-team-a.1"
    assert check_token_name("7a") == "7a"
    for bad in ("", "-x", "a/b", "x" * 65, "two words", "7", "0123"):  # digits: an id
        with pytest.raises(InvalidRequest, match="invalid token name"):
            check_token_name(bad)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.1.2.3", False),
        ("ckptstore.example.com", False),
        ("", False),
    ],
)
def test_auto_requires_tokens_unless_listening_on_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
    assert auth_required("auto", host) is not loopback
    assert auth_required("on", host) is True
    assert auth_required("off", host) is False


def test_tokens_are_random_and_stored_as_their_sha256() -> None:
    tokens = {new_token() for _ in range(100)}
    assert len(tokens) == 100
    for token in tokens:
        assert token.startswith("ckpt_") and len(token) == 5 + 43
        assert hash_token(token) == hashlib.sha256(token.encode()).hexdigest()


def test_401_and_403_are_typed_errors_on_both_sides() -> None:
    assert (Unauthorized.status, Unauthorized.code) == (401, "unauthorized")
    assert (Forbidden.status, Forbidden.code) == (403, "forbidden")
    assert type(error_from_code("unauthorized", "no", 401)) is Unauthorized
    assert type(error_from_code("forbidden", "no", 403)) is Forbidden
