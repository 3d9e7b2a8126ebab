"""Bearer tokens: making and hashing them, who a request acts as, and when they are required.

A token is ``ckpt_`` and 43 URL-safe characters (32 random bytes, :func:`secrets.token_urlsafe`).
The catalog stores only its SHA-256 (:mod:`.catalog.tokens`): with 256 random bits a fast hash
is enough (no one can try guesses against it, unlike a password, so no slow KDF is needed),
and the look-up of a request's token is one indexed SELECT of its hash.

Whether tokens are required is ``CKPTSTORE_AUTH``: ``on``, ``off``, or ``auto`` (the default),
which requires them unless the service listens on a loopback address only
(:func:`auth_required`): a service on ``127.0.0.1`` can only be reached from its own machine,
one on ``0.0.0.0`` from anywhere. The HTTP side (which route needs which scope, the check
itself) is :mod:`ckptstore_service.api.auth`.
"""

from __future__ import annotations

import hashlib
import ipaddress
import secrets
from dataclasses import dataclass
from typing import Literal

from ckptstore_core.access import (
    Scope,
    TokenInfo,
    check_scope,
    check_token_name,
    pattern_matches,
    scope_allows,
    token_runs,
)
from ckptstore_service.catalog.tokens import TokenStore

__all__ = [
    "OPEN",
    "TOKEN_PREFIX",
    "AuthMode",
    "Principal",
    "auth_required",
    "hash_token",
    "is_loopback",
    "issue_token",
    "new_token",
]

AuthMode = Literal["auto", "on", "off"]
TOKEN_PREFIX = "ckpt_"


def new_token() -> str:
    """A new token's secret: ``ckpt_`` and 32 random bytes, URL-safe base64."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """What the catalog stores of ``token``: its SHA-256, hex."""
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` (an address, or ``localhost``) serves this machine
    only: 127.0.0.0/8 and ::1 do; 0.0.0.0, :: and any other name or address do not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def auth_required(mode: AuthMode, host: str) -> bool:
    """Whether requests need a token: ``on``/``off`` say so; ``auto`` unless the service
    listens on a loopback address (``host``)."""
    if mode == "auto":
        return not is_loopback(host)
    return mode == "on"


@dataclass(frozen=True)
class Principal:
    """Who a request acts as: a token's name, scope and run pattern (None: every run)."""

    name: str | None
    scope: Scope
    runs: str | None

    @classmethod
    def of(cls, token: TokenInfo) -> Principal:
        return cls(token.name, token.scope, token.runs)

    def allows(self, scope: Scope) -> bool:
        return scope_allows(self.scope, scope)

    def covers(self, run: str) -> bool:
        """Whether the token's run pattern covers the run ``run``."""
        return pattern_matches(self.runs, run)

    def describe(self) -> str:
        """The token in a few words, for an error message."""
        runs = f", runs {self.runs}" if self.runs is not None else ""
        return f"token {self.name!r} (scope {self.scope}{runs})"


#: who every request acts as when tokens are not required
OPEN = Principal(None, "admin", None)


def issue_token(
    store: TokenStore, name: str, scope: str, runs: str | None
) -> tuple[str, TokenInfo]:
    """Create a token: its secret (shown once, never stored) and its record. InvalidRequest
    for a bad name, scope or run pattern (``runs`` is required: ``*`` for every run), or a
    name in use."""
    checked_runs = token_runs(runs)
    secret = new_token()
    info = store.create(
        check_token_name(name), check_scope(scope), checked_runs, hash_token(secret)
    )
    return secret, info
