"""The catalog's database: engine, short transactions, schema migrations, error translation.

Everything here is backend plumbing: which engine options and pragmas each backend gets, how
a lost connection becomes :class:`StorageUnavailable`, and how the schema is brought up to
date. The other catalog modules take a :class:`Database` and open their own short sessions.

On PostgreSQL every call has a client-side deadline (:mod:`.deadline`), and a new connection
libpq's ``connect_timeout``: a database that stalls fails a request with a 503 within about
twice the timeout, not after minutes.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, make_url, text
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker

from ckptstore_core.errors import CorruptData, StorageUnavailable
from ckptstore_service.catalog.deadline import NO_DEADLINE, bound_calls

log = logging.getLogger("ckptstore.catalog")

__all__ = ["DEFAULT_TIMEOUT_S", "Database", "shown_url", "translate_errors", "utc"]

#: PostgreSQL: the longest wait for one call of the database (CKPTSTORE_DATABASE_TIMEOUT_S)
DEFAULT_TIMEOUT_S = 30.0

_MIGRATION_LOCK = 0x636B7074  # "ckpt"


def shown_url(url: str) -> str:
    """``url`` as it may be shown in an error: without its password."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # a URL SQLAlchemy cannot parse holds no password it could hide
        return url.split("@")[-1] if "@" in url else url


def utc(value: datetime) -> datetime:
    """``value`` as an aware UTC datetime."""
    # SQLite hands back naive datetimes even for timezone-aware columns.
    return value if value.tzinfo else value.replace(tzinfo=UTC)


@contextlib.contextmanager
def translate_errors(on_damage: Callable[[str], None] | None = None) -> Iterator[None]:
    """Turn every database failure that a retry can fix into StorageUnavailable (a 503,
    which clients retry): a lost or refused connection, a server out of connection slots
    ("too many clients already"), starting up or shutting down, a pool with no connection
    to lend in time, a serialization failure or deadlock, a SQLite database locked past its
    busy timeout. A full disk is StorageUnavailable too, on every backend (PostgreSQL's
    SQLSTATE 53100, SQLite's ``SQLITE_FULL``): freeing space fixes it.

    A damaged database (SQLite's ``SQLITE_CORRUPT``/``SQLITE_NOTADB``, PostgreSQL's
    ``data_corrupted``/``index_corrupted``) is CorruptData, whose message names the damage but
    never the statement (that goes to the log); ``on_damage`` is told, so that readiness
    fails. Any other database error (constraint violations included) passes unchanged: a
    retry would fail the same way."""
    try:
        yield
    except IntegrityError:
        raise
    except PoolTimeout as exc:
        raise StorageUnavailable(
            f"database unavailable: no connection free in the pool in time ({exc})"
        ) from exc
    except DBAPIError as exc:
        if _is_disk_full(exc):
            raise StorageUnavailable(
                f"database unavailable: its disk is full ({_first_line(exc)})"
            ) from exc
        if _is_damaged(exc):
            why = f"the catalog database is damaged: {_first_line(exc)}"
            log.error("%s; the failed statement: %s", why, exc)
            if on_damage is not None:
                on_damage(why)
            raise CorruptData(f"{why} (the service's log has the details)") from exc
        if exc.connection_invalidated or _is_transient(exc):
            raise StorageUnavailable(f"database unavailable: {exc.orig}") from exc
        raise


def _first_line(exc: DBAPIError) -> str:
    """The driver's own message, without the statement SQLAlchemy appends."""
    return str(exc.orig).strip().splitlines()[0] if str(exc.orig).strip() else type(exc).__name__


def _sqlite_code(exc: DBAPIError) -> int | None:
    """The primary SQLite result code of ``exc`` (None for other drivers)."""
    code = getattr(exc.orig, "sqlite_errorcode", None)
    return code & 0xFF if isinstance(code, int) else None


_SQLITE_CORRUPT, _SQLITE_FULL, _SQLITE_NOTADB = 11, 13, 26
_DAMAGED_SQLSTATES = ("XX001", "XX002")  # data_corrupted, index_corrupted


def _is_disk_full(exc: DBAPIError) -> bool:
    return _sqlite_code(exc) == _SQLITE_FULL or getattr(exc.orig, "sqlstate", None) == "53100"


def _is_damaged(exc: DBAPIError) -> bool:
    if _sqlite_code(exc) in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
        return True
    return getattr(exc.orig, "sqlstate", None) in _DAMAGED_SQLSTATES


class Database:
    """One catalog database (a SQLAlchemy URL): its engine and its transactions.

    Every :meth:`session` is one transaction, committed when its block ends and rolled back
    if it raises: callers hold none across a long upload.

    ``timeout_s`` (PostgreSQL): the longest wait for one call (a statement, a commit, the
    check of a pooled connection), past which the connection is cut and the caller gets
    :class:`StorageUnavailable`; also libpq's ``connect_timeout`` (whole seconds, at least 2)
    unless the URL sets one. Schema migrations are exempt (:meth:`upgrade`).
    """

    def __init__(self, url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not timeout_s > 0:
            raise ValueError(f"a database timeout must be > 0 s, not {timeout_s!r}")
        self.url = url
        self.is_postgres = url.startswith("postgresql")
        is_sqlite = url.startswith("sqlite")
        # PostgreSQL: bound_calls checks a pooled connection at checkout, with a deadline
        kwargs: dict[str, Any] = {"pool_pre_ping": not self.is_postgres}
        if is_sqlite:
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 60}
        else:
            kwargs.update(pool_size=10, max_overflow=20)
        if self.is_postgres and "connect_timeout" not in _query_of(url):
            kwargs["connect_args"] = {"connect_timeout": max(2, math.ceil(timeout_s))}
        try:
            self.engine: Engine = create_engine(url, **kwargs)
        except Exception as exc:  # a bad URL or a missing driver
            raise ValueError(f"cannot use database URL {shown_url(url)!r}: {exc}") from exc
        if is_sqlite:
            event.listen(self.engine, "connect", _sqlite_pragmas)
        elif self.is_postgres:
            bound_calls(self.engine, timeout_s)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        database = make_url(url).database if is_sqlite else None
        #: the SQLite file, None for PostgreSQL or an in-memory database
        self.sqlite_file = Path(database) if database and database != ":memory:" else None
        #: why the database was found damaged (None: never was): until a restart, readiness
        #: fails, so that a probe takes this process out of rotation
        self.damaged: str | None = None

    @contextlib.contextmanager
    def session(self) -> Iterator[Session]:
        """One transaction: committed when the block ends, rolled back if it raises."""
        with translate_errors(self._found_damaged), self._sessions.begin() as session:
            yield session

    def _found_damaged(self, why: str) -> None:
        self.damaged = why

    def close(self) -> None:
        self.engine.dispose()

    def ping(self) -> None:
        with self.session() as s:
            s.execute(text("SELECT 1"))

    def check_ready(self) -> None:
        """Ready: the database answers and no call has found it damaged (CorruptData if one
        has: a damaged catalog stays damaged until an operator repairs or restores it)."""
        if self.damaged is not None:
            raise CorruptData(self.damaged)
        self.ping()

    def upgrade(self) -> None:
        """Bring the schema to the newest Alembic revision (idempotent).

        On PostgreSQL an advisory lock keeps replicas that start together from migrating
        at the same time. Logs one line when it changed the schema (``catalog schema:
        upgraded from 0005 to 0008``); Alembic's own lines (a plugin set-up each, and each
        revision's docstring) are logged at debug level only, so a first start does not
        print two dozen lines of migration history.
        """
        with _alembic_at_debug():  # its import and its context log too
            before, after = self._upgrade_to_head()
        if after != before:
            done = f"created at {after}" if before is None else f"upgraded from {before} to {after}"
            logging.getLogger("ckptstore").info("catalog schema: %s", done)

    def _upgrade_to_head(self) -> tuple[str | None, str | None]:
        """Alembic's upgrade to ``head``; the revisions before and after."""
        from alembic import command
        from alembic.config import Config
        from alembic.runtime.migration import MigrationContext

        config = Config()
        config.set_main_option("script_location", str(Path(__file__).with_name("migrations")))
        with translate_errors(self._found_damaged), self.engine.begin() as conn:
            # no deadline: an index built on a large table, or another replica's migration
            # waited for (the lock below), may rightly take minutes
            conn.execution_options(**{NO_DEADLINE: True})
            if self.is_postgres:
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _MIGRATION_LOCK})
            config.attributes["connection"] = conn
            before = MigrationContext.configure(conn).get_current_revision()
            command.upgrade(config, "head")
            after = MigrationContext.configure(conn).get_current_revision()
        return before, after

    def revision(self) -> str | None:
        """The schema's current Alembic revision (None before the first upgrade)."""
        from alembic.runtime.migration import MigrationContext

        with translate_errors(self._found_damaged), self.engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()


@contextlib.contextmanager
def _alembic_at_debug() -> Iterator[None]:
    """Alembic's loggers show only warnings while it runs, unless debug is asked for."""
    logger = logging.getLogger("alembic")
    if logger.getEffectiveLevel() <= logging.DEBUG:
        yield
        return
    saved = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(saved)


def _query_of(url: str) -> Any:
    """The query parameters of ``url`` (none when SQLAlchemy cannot parse it: create_engine
    says why)."""
    try:
        return make_url(url).query
    except Exception:
        return {}


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=FULL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=60000")
    cur.close()


# SQLSTATE classes a retry can fix: 08 connection exception, 53 insufficient resources
# (53300 too_many_connections), 57P operator intervention (shutdown, starting up), 40001
# serialization failure, 40P01 deadlock
_TRANSIENT_SQLSTATES = ("08", "53", "57P", "40001", "40P01")
_TRANSIENT_TEXT = (
    "connection refused",
    "could not connect",
    "connection failed",
    "server closed",
    "timeout",
    "too many clients",
    "too many connections",
    "remaining connection slots",
    "the database system is",  # starting up, shutting down, in recovery mode
    "terminating connection",
    "database is locked",  # SQLite, past its busy timeout
)


def _is_transient(exc: DBAPIError) -> bool:
    sqlstate = getattr(exc.orig, "sqlstate", None)
    if isinstance(sqlstate, str) and sqlstate.startswith(_TRANSIENT_SQLSTATES):
        return True
    if isinstance(exc, OperationalError) and type(exc.orig).__module__.startswith("psycopg"):
        # psycopg's OperationalError: the server's operation, not the statement (a failed
        # connection carries no SQLSTATE at all)
        return True
    text_ = str(exc.orig).lower()
    return any(s in text_ for s in _TRANSIENT_TEXT)
