"""The client-side deadline on PostgreSQL calls (catalog.deadline): a call that gets no answer
within the timeout has its connection cut and fails with StorageUnavailable; a quick call,
a connection idle between calls, and a migration's connection are never cut. On the real
PostgreSQL, directly or through a fault-injecting proxy (support.faultproxy); the watchdog's
own logic on socket pairs.

The end-to-end case (a service whose database stalls) is in
tests/integration/test_faults.py."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from ckptstore_core.errors import StorageUnavailable
from ckptstore_service.catalog.db import Database
from ckptstore_service.catalog.deadline import NO_DEADLINE, WATCHDOG, Watchdog
from support.faultproxy import FaultProxy
from support.waiting import wait_until

pytestmark = pytest.mark.timing

TIMEOUT_S = 0.5
CONNECT_S = 2  # libpq's smallest connect_timeout, which the database is given
SLACK_S = 1.5  # a loaded 2-core machine


@pytest.fixture
def proxy(pg_url: str) -> Iterator[FaultProxy]:
    at = make_url(pg_url)
    assert at.host
    with FaultProxy(at.host, at.port or 5432) as p:
        yield p


@pytest.fixture
def proxied(pg_url: str, proxy: FaultProxy) -> Iterator[Database]:
    """The database of ``pg_url`` through ``proxy``, with TIMEOUT_S."""
    url = make_url(pg_url).set(host="127.0.0.1", port=proxy.port)
    db = Database(url.render_as_string(hide_password=False), timeout_s=TIMEOUT_S)
    yield db
    db.close()


@pytest.fixture
def direct(pg_url: str) -> Iterator[Database]:
    """The database of ``pg_url``, with TIMEOUT_S."""
    db = Database(pg_url, timeout_s=TIMEOUT_S)
    yield db
    db.close()


def _fails(call: object, within: float) -> StorageUnavailable:
    """``call()`` raises StorageUnavailable within ``within`` seconds; the error."""
    assert callable(call)
    start = time.monotonic()
    with pytest.raises(StorageUnavailable) as caught:
        call()
    took = time.monotonic() - start
    assert took < within, f"{took:.2f} s"
    return caught.value


def _select(db: Database, sql: str = "SELECT 1") -> object:
    with db.session() as s:
        return s.execute(text(sql)).scalar()


@pytest.mark.postgres
def test_a_stall_mid_transaction_fails_the_statement_then_the_commit(
    proxied: Database, proxy: FaultProxy
) -> None:
    """The database stalls between two statements of a transaction: the second is cut after
    the timeout, with an error that names it; the same for a COMMIT; once the stall ends the
    next call succeeds on a new connection."""
    with pytest.raises(StorageUnavailable) as caught, proxied.session() as s:
        s.execute(text("SELECT 1"))
        proxy.stall()
        start = time.monotonic()
        s.execute(text("SELECT 2"))
    took = time.monotonic() - start
    assert TIMEOUT_S <= took < TIMEOUT_S + SLACK_S, f"{took:.2f} s"
    assert "no answer to a statement (SELECT) within 0.5 s" in caught.value.message
    assert "CKPTSTORE_DATABASE_TIMEOUT_S" in caught.value.message
    proxy.resume()
    assert _select(proxied) == 1

    with pytest.raises(StorageUnavailable) as caught, proxied.session() as s:
        s.execute(text("SELECT 1"))
        proxy.stall()
        start = time.monotonic()
    took = time.monotonic() - start  # the COMMIT, as the block ends
    assert TIMEOUT_S <= took < TIMEOUT_S + SLACK_S, f"{took:.2f} s"
    assert "no answer to a COMMIT" in caught.value.message
    proxy.resume()
    assert _select(proxied) == 1


@pytest.mark.postgres
def test_a_stalled_database_fails_a_call_within_the_check_and_a_connect(
    proxied: Database, proxy: FaultProxy
) -> None:
    """A call that starts while the database stalls: the check of its pooled connection is
    cut after the timeout, then a new connection times out (connect_timeout): the bound of
    docs/operations.md. A second call, with no pooled connection left to check, fails after
    the connect timeout alone. Once the stall ends the next call succeeds."""
    assert _select(proxied) == 1  # a pooled connection, checked at the next checkout
    proxy.stall()
    _fails(lambda: _select(proxied), TIMEOUT_S + CONNECT_S + SLACK_S)
    _fails(lambda: _select(proxied), CONNECT_S + SLACK_S)
    proxy.resume()
    assert _select(proxied) == 1


@pytest.mark.postgres
def test_a_slow_statement_is_cut_a_quick_one_is_not(direct: Database) -> None:
    """On a healthy server too a statement that runs past the timeout is cut (the timeout
    must stay far above any legitimate statement): pg_sleep ten times as long fails after
    about the timeout; one shorter than it returns, on a new connection."""
    slow = f"SELECT 3 FROM pg_sleep({10 * TIMEOUT_S})"
    error = _fails(lambda: _select(direct, slow), TIMEOUT_S + SLACK_S)
    assert "no answer to a statement (SELECT) within 0.5 s" in error.message
    assert _select(direct, f"SELECT 3 FROM pg_sleep({TIMEOUT_S / 5})") == 3


@pytest.mark.postgres
def test_a_connection_idle_between_calls_is_not_cut(direct: Database) -> None:
    """The deadline counts while a call waits on the server, not while the caller holds a
    connection between calls (after a statement, after a commit); nothing stays watched
    once the connection is given back."""
    with direct.engine.connect() as conn:
        assert conn.execute(text("SELECT 1")).scalar() == 1
        time.sleep(3 * TIMEOUT_S)  # the caller busy elsewhere (simulated time, not a wait)
        conn.commit()
        time.sleep(3 * TIMEOUT_S)
        assert conn.execute(text("SELECT 2")).scalar() == 2
    assert WATCHDOG.busy() == 0


@pytest.mark.postgres
def test_a_connection_without_a_deadline_is_never_cut(direct: Database) -> None:
    """A connection with the NO_DEADLINE execution option (schema migrations) runs a
    statement longer than the timeout to its end."""
    with direct.engine.connect() as conn:
        conn.execution_options(**{NO_DEADLINE: True})
        slept = conn.execute(text(f"SELECT 4 FROM pg_sleep({3 * TIMEOUT_S})"))
        assert slept.scalar() == 4
    assert direct.revision() is None  # the connection is fine: no schema here yet


def test_a_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="> 0"):
        Database("sqlite://", timeout_s=0)


class _Conn:
    """A DBAPI connection as the watchdog sees it: its socket, and libpq's transaction
    status (1: a command in progress, 0: idle)."""

    def __init__(self, sock: socket.socket, status: int = 1) -> None:
        self.sock, self.info = sock, SimpleNamespace(transaction_status=status)

    def fileno(self) -> int:
        return self.sock.fileno()


def _cut(peer: socket.socket) -> bool:
    """Whether the other end of ``peer``'s pair was shut down (``peer`` reads its end)."""
    peer.settimeout(0.01)
    try:
        return peer.recv(1) == b""
    except TimeoutError:
        return False


def test_the_watchdog_cuts_only_a_call_still_waiting_past_its_deadline() -> None:
    """Of three calls with a short deadline: one still waiting on the server is cut (its
    peer reads the end of the stream) and :meth:`stop` says so; one whose connection went
    idle (a commit that returned: no event ends it) is forgotten, not cut; one stopped in
    time is never cut. The socket cut is the connection's own even when the connection
    closed its descriptor and the number went to another socket meanwhile."""
    dog = Watchdog()
    pairs = [socket.socketpair() for _ in range(3)]
    waiting, idle, quick = (_Conn(pairs[0][0]), _Conn(pairs[1][0], 0), _Conn(pairs[2][0]))
    for conn in (waiting, idle, quick):
        dog.start(conn, 0.2, "a test call")
    assert dog.stop(quick) is not None
    pairs[0][0].close()  # the driver closes its descriptor; another socket takes the number
    reused, reused_peer = socket.socketpair()
    try:
        wait_until(lambda: _cut(pairs[0][1]), 10, "the waiting call's connection cut")
        wait_until(lambda: dog.busy() == 1, 10, "the idle connection forgotten")
        call = dog.stop(waiting)
        assert call is not None and call.cut
        assert dog.busy() == 0
        assert not _cut(pairs[1][1]) and not _cut(pairs[2][1])
        reused_peer.sendall(b"x")
        assert reused.recv(1) == b"x"  # untouched
    finally:
        reused.close()
        reused_peer.close()
        for a, b in pairs:
            a.close()
            b.close()
