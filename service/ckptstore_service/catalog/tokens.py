"""Bearer tokens in the catalog: create, find by the hash of their secret, list, revoke.

Only the SHA-256 of a token is stored (:mod:`ckptstore_service.auth` makes and hashes them):
a copy of the database gives nobody a token that works. A revoked token keeps its row, with
``revoked_at`` set, so ``token list --all`` still shows who had access; its name may be used
again by a new token.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from ckptstore_core.access import Scope, TokenInfo, check_scope
from ckptstore_core.errors import InvalidRequest
from ckptstore_service.catalog.db import Database, utc
from ckptstore_service.catalog.models import Token

__all__ = ["TokenStore"]

_MAX_ID = (1 << 63) - 1  # a 64-bit signed integer column, on SQLite and PostgreSQL


def _info(row: Token) -> TokenInfo:
    return TokenInfo(
        id=row.id,
        name=row.name,
        scope=check_scope(row.scope),
        runs=row.runs,
        created=utc(row.created_at),
        revoked=utc(row.revoked_at) if row.revoked_at else None,
    )


class TokenStore:
    """The tokens of one catalog database (``Catalog.tokens``)."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def create(self, name: str, scope: Scope, runs: str | None, secret_hash: str) -> TokenInfo:
        """A new token row; InvalidRequest if a token not revoked has that name already."""
        row = Token(name=name, scope=scope, runs=runs, secret_hash=secret_hash)
        try:
            with self._db.session() as s:
                s.add(row)
                s.flush()
                return _info(row)
        except IntegrityError:
            raise InvalidRequest(
                f"a token named {name!r} exists already: revoke it or choose another name"
            ) from None

    def find(self, secret_hash: str) -> TokenInfo | None:
        """The token, not revoked, whose secret hashes to ``secret_hash``; else None."""
        with self._db.session() as s:
            row = s.scalar(
                select(Token).where(Token.secret_hash == secret_hash, Token.revoked_at.is_(None))
            )
            return None if row is None else _info(row)

    def list(self, *, revoked: bool = False) -> list[TokenInfo]:
        """The tokens by id: those not revoked, and with ``revoked`` the revoked ones too."""
        query = select(Token).order_by(Token.id)
        if not revoked:
            query = query.where(Token.revoked_at.is_(None))
        with self._db.session() as s:
            return [_info(row) for row in s.scalars(query)]

    def revoke(self, key: str) -> TokenInfo | None:
        """Revoke the token in use named ``key``, else the one of id ``key`` (ASCII digits);
        the token revoked, or None if no such token was in use. A name comes first: tokens
        made before names of digits alone were refused may have one."""
        in_use = Token.revoked_at.is_(None)
        with self._db.session() as s:
            row = s.scalar(select(Token).where(Token.name == key, in_use))
            # not "³", which isdigit() takes and int() refuses, nor an id no column holds
            if row is None and key.isascii() and key.isdigit() and int(key) <= _MAX_ID:
                row = s.scalar(select(Token).where(Token.id == int(key), in_use))
            if row is None:
                return None
            s.execute(update(Token).where(Token.id == row.id).values(revoked_at=datetime.now(UTC)))
            s.refresh(row)
            return _info(row)
