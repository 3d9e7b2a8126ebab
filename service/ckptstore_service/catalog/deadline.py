"""A client-side deadline on PostgreSQL calls: a statement, a commit, a rollback or the pool's
connection check that gets no answer within the engine's timeout has its connection cut.

Why: a database that keeps its connections open and answers nothing (a hung server; a proxy,
a load balancer or a network path that acknowledges the bytes and forwards none) would hold a
request for as long as it stalls. PostgreSQL's ``statement_timeout`` cannot help (the server
never sees the statement), and TCP keepalives or ``tcp_user_timeout`` do not fire while the
peer's kernel acknowledges. The driver has no time limit on a call of its own.

How: SQLAlchemy events mark a DBAPI connection busy when a call starts (before a cursor
executes, before a commit or rollback, before the pool resets a connection it takes back, and
around the check of a pooled connection at checkout, which :func:`bound_calls` runs in place
of ``pool_pre_ping``) and idle when it ends. One daemon thread, shared by every engine, sleeps
until the earliest deadline; a connection still waiting on the server then (libpq: a command
in progress) is cut: its socket is shut down, through a duplicate of its descriptor taken when
the call started, so that a descriptor number the driver closed and the process reused since
can never be hit. The blocked call returns at once with the driver's error, the connection is
invalidated (the pool opens a new one), and the caller gets
:class:`~ckptstore_core.errors.StorageUnavailable` (a 503), naming the timeout.

A call on a healthy server that runs past the timeout is cut the same way (the server ends
the statement, rolled back, when it next writes to the closed connection): the timeout must
stay far above the longest legitimate statement. A connection can opt out for its lifetime
with the execution option ``{NO_DEADLINE: True}`` (schema migrations: an index built on a
large table, or another replica's migration waited for, may rightly take minutes).
New connections are bounded by libpq's ``connect_timeout`` instead (see :mod:`.db`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, event
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.exc import InvalidatePoolError

from ckptstore_core.errors import StorageUnavailable

__all__ = ["NO_DEADLINE", "SETTING", "Watchdog", "bound_calls"]

log = logging.getLogger("ckptstore")

#: the execution option that exempts a connection's calls from the deadline
NO_DEADLINE = "ckptstore_no_deadline"
#: the setting named in errors and logs
SETTING = "CKPTSTORE_DATABASE_TIMEOUT_S"
_FRESH = "ckptstore_fresh"  # a pool record's info: connected, not yet checked out
_PQTRANS_ACTIVE = 1  # libpq's PQtransactionStatus: a command in progress


@dataclass
class _Call:
    """One call in progress on a connection."""

    what: str  # a few words for errors and logs
    timeout_s: float
    deadline: float  # time.monotonic()
    fd: int  # a duplicate of the connection's socket, owned here; -1 once closed
    cut: bool = False


class Watchdog:
    """Connections with a call in progress, and the thread that cuts those past their
    deadline. :meth:`start` and :meth:`stop` are cheap (a lock, a ``dup``, a ``close``)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy: dict[Any, _Call] = {}  # DBAPI connection -> its call
        self._wake_at = math.inf  # when the thread wakes next
        self._thread: threading.Thread | None = None

    def start(self, dbapi_conn: Any, timeout_s: float, what: str) -> None:
        """A call on ``dbapi_conn`` starts now: cut its connection if it is still waiting
        on the server after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            call = self._busy.get(dbapi_conn)
            if call is not None and not call.cut:  # a commit after a statement: same socket
                call.what, call.timeout_s, call.deadline = what, timeout_s, deadline
            else:
                try:
                    fd = os.dup(dbapi_conn.fileno())
                except Exception:  # closed already: the call fails at once by itself
                    return
                self._busy[dbapi_conn] = _Call(what, timeout_s, deadline, fd)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="ckptstore-db-deadline", daemon=True
                )
                self._thread.start()
            elif deadline < self._wake_at:
                self._cond.notify()

    def stop(self, dbapi_conn: Any) -> _Call | None:
        """The call on ``dbapi_conn`` ended (returned or failed); the call, if one was
        watched (its :attr:`_Call.cut` says whether this watchdog cut it)."""
        with self._cond:
            call = self._busy.pop(dbapi_conn, None)
            if call is not None:
                _close(call)
            return call

    @contextlib.contextmanager
    def watching(self, dbapi_conn: Any, timeout_s: float, what: str) -> Iterator[None]:
        """:meth:`start` and :meth:`stop` around a block."""
        self.start(dbapi_conn, timeout_s, what)
        try:
            yield
        finally:
            self.stop(dbapi_conn)

    def busy(self) -> int:
        """How many connections have a call watched now (for tests)."""
        with self._cond:
            return len(self._busy)

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for dbapi_conn, call in list(self._busy.items()):
                    if call.deadline <= now:
                        self._expire(dbapi_conn, call, now)
                self._wake_at = min((c.deadline for c in self._busy.values()), default=math.inf)
                self._cond.wait(None if self._wake_at == math.inf else self._wake_at - now)

    def _expire(self, dbapi_conn: Any, call: _Call, now: float) -> None:
        if call.cut or not _waiting(dbapi_conn):
            # the call is over (a commit that returned, with no event after it), or a
            # connection cut a while ago whose caller never said it saw the error
            del self._busy[dbapi_conn]
            _close(call)
            return
        call.cut = True
        call.deadline = now + call.timeout_s  # forgotten then, if nothing stops it first
        log.warning(
            "database call cut: no answer to %s within %g s (%s): its connection is closed, "
            "the call fails with 503 storage_unavailable",
            call.what,
            call.timeout_s,
            SETTING,
        )
        try:
            sock = socket.socket(fileno=call.fd)
        except OSError:  # not a socket (cannot happen with libpq): nothing to cut
            _close(call)
            return
        call.fd = -1  # sock owns it now
        with sock, contextlib.suppress(OSError):  # already disconnected
            sock.shutdown(socket.SHUT_RDWR)


def _close(call: _Call) -> None:
    if call.fd >= 0:
        with contextlib.suppress(OSError):
            os.close(call.fd)
        call.fd = -1


def _waiting(dbapi_conn: Any) -> bool:
    """Whether ``dbapi_conn`` waits on the server (psycopg, psycopg2: libpq says a command is
    in progress); True when it cannot tell."""
    try:
        return int(dbapi_conn.info.transaction_status) == _PQTRANS_ACTIVE
    except Exception:
        return True


#: the one watchdog of the process (its thread starts with the first call)
WATCHDOG = Watchdog()


def bound_calls(engine: Engine, timeout_s: float, watchdog: Watchdog = WATCHDOG) -> None:
    """Bound every call of ``engine``'s connections (PostgreSQL) to ``timeout_s`` (see the
    module's docstring). Replaces ``pool_pre_ping``: create the engine without it."""

    def dbapi_of(conn: Connection | None) -> Any:
        if conn is None or conn.get_execution_options().get(NO_DEADLINE):
            return None
        try:
            return conn.connection.dbapi_connection
        except Exception:  # invalidated or closed: nothing in progress to watch
            return None

    def start(conn: Connection, what: str) -> None:
        dbapi_conn = dbapi_of(conn)
        if dbapi_conn is not None:
            watchdog.start(dbapi_conn, timeout_s, what)

    @event.listens_for(engine, "before_cursor_execute")
    def _before(conn: Connection, _cursor: Any, statement: str, *_args: Any) -> None:
        verb = statement[:16].split(maxsplit=1)
        start(conn, f"a statement ({verb[0] if verb else '?'})")

    @event.listens_for(engine, "after_cursor_execute")
    def _after(conn: Connection, cursor: Any, *_args: Any) -> None:
        dbapi_conn = dbapi_of(conn)
        if dbapi_conn is not None:
            watchdog.stop(dbapi_conn)

    @event.listens_for(engine, "commit")
    def _commit(conn: Connection) -> None:
        start(conn, "a COMMIT")

    @event.listens_for(engine, "rollback")
    def _rollback(conn: Connection) -> None:
        start(conn, "a ROLLBACK")

    @event.listens_for(engine, "handle_error")
    def _error(context: ExceptionContext) -> None:
        dbapi_conn = dbapi_of(context.connection)
        call = None if dbapi_conn is None else watchdog.stop(dbapi_conn)
        if call is not None and call.cut:
            context.is_disconnect = True  # the pool drops the connection
            raise StorageUnavailable(
                f"database unavailable: no answer to {call.what} within {call.timeout_s:g} s "
                f"({SETTING}); the connection was closed"
            ) from context.original_exception

    @event.listens_for(engine, "connect")
    def _connect(_dbapi_conn: Any, record: Any) -> None:
        record.info[_FRESH] = True

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        # pool_pre_ping's check, watched: SQLAlchemy runs its own before any event fires
        if record.info.pop(_FRESH, False):
            return  # connected just now
        try:
            with watchdog.watching(dbapi_conn, timeout_s, "the pool's check of a connection"):
                engine.dialect.do_ping(dbapi_conn)
        except Exception as exc:
            # as pool_pre_ping does: this connection and every older one are replaced
            raise InvalidatePoolError(f"a pooled connection failed its check: {exc}") from exc

    @event.listens_for(engine, "reset")
    def _reset(dbapi_conn: Any, _record: Any, _state: Any) -> None:
        if dbapi_conn is not None:
            watchdog.start(dbapi_conn, timeout_s, "the ROLLBACK of a connection given back")

    @event.listens_for(engine, "checkin")
    def _checkin(dbapi_conn: Any, _record: Any) -> None:
        if dbapi_conn is not None:
            watchdog.stop(dbapi_conn)

    @event.listens_for(engine, "invalidate")
    def _invalidate(dbapi_conn: Any, _record: Any, _exc: Any) -> None:
        if dbapi_conn is not None:
            watchdog.stop(dbapi_conn)
