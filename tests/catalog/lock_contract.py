"""The one behavioural suite every RunLocks backend passes (see catalog/locks.py's contract).

A backend's test module subclasses :class:`RunLocksContract` and provides the ``locks``
fixture (the backend over a fresh database or folder), and, where the backend reaches across
processes, ``other`` (a second instance over the same database or folder: another replica's
view) and :meth:`constructor` (the Python expression that builds such an instance in a child
process).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from ckptstore_service.catalog.locks import Purpose, RunLocks

RUN, REROOT = Purpose.RUN, Purpose.REROOT
# How long a test waits for something that should happen at once; only a failure waits it out.
PATIENCE_S = 20.0


def free(locks: RunLocks, purpose: Purpose, run: str) -> bool:
    """Whether ``locks`` could take lock ``(purpose, run)`` right now (and gives it back)."""
    with locks.hold(purpose, run, blocking=False) as held:
        return held


class RunLocksContract:
    @pytest.fixture
    def locks(self) -> Iterator[RunLocks]:
        raise NotImplementedError("a backend's test class provides its locks")

    @pytest.fixture
    def other(self, locks: RunLocks) -> Iterator[RunLocks]:
        """Another holder's locks: another replica's where the backend spans processes."""
        yield locks

    def constructor(self) -> str | None:
        """An expression building these locks in a child process; None: one process only."""
        return None

    def test_a_held_lock_is_refused_at_once(self, locks: RunLocks, other: RunLocks) -> None:
        with locks.hold(RUN, "r") as held:
            assert held
            assert not free(other, RUN, "r")
            assert not free(locks, RUN, "r")  # not re-entrant either
        assert free(other, RUN, "r")

    def test_a_blocking_hold_waits_for_the_holder(self, locks: RunLocks, other: RunLocks) -> None:
        order: list[str] = []
        holding, release, got = threading.Event(), threading.Event(), threading.Event()

        def holder() -> None:
            with locks.hold(RUN, "r"):
                holding.set()
                release.wait(PATIENCE_S)
                order.append("first")

        def waiter() -> None:
            with other.hold(RUN, "r") as held:
                assert held
                order.append("second")
                got.set()

        threads = [threading.Thread(target=holder)]
        threads[0].start()
        assert holding.wait(PATIENCE_S)
        threads.append(threading.Thread(target=waiter))
        threads[1].start()
        assert not got.wait(0.3)  # still waiting while the holder holds it
        release.set()
        assert got.wait(PATIENCE_S)
        for t in threads:
            t.join(PATIENCE_S)
        assert order == ["first", "second"]

    def test_only_one_holder_at_a_time(self, locks: RunLocks, other: RunLocks) -> None:
        inside: list[int] = []
        overlaps: list[int] = []

        def work(mine: RunLocks) -> None:
            for _ in range(20):
                with mine.hold(RUN, "r"):
                    inside.append(1)
                    if len(inside) != 1:
                        overlaps.append(len(inside))
                    inside.pop()

        threads = [threading.Thread(target=work, args=(x,)) for x in (locks, other) * 2]
        for t in threads:
            t.start()
        for t in threads:
            t.join(PATIENCE_S)
        assert not any(t.is_alive() for t in threads)
        assert overlaps == []

    def test_released_when_the_block_raises(self, locks: RunLocks, other: RunLocks) -> None:
        with pytest.raises(KeyboardInterrupt), locks.hold(RUN, "r"):  # not even an Exception
            raise KeyboardInterrupt
        assert free(other, RUN, "r")
        with pytest.raises(ValueError), locks.hold(REROOT, "r", blocking=False) as held:
            assert held
            raise ValueError("boom")
        assert free(other, REROOT, "r")

    def test_a_refused_try_holds_nothing(self, locks: RunLocks, other: RunLocks) -> None:
        with locks.hold(RUN, "r"), other.hold(RUN, "r", blocking=False) as held:
            assert not held
        # the refused try's exit released nothing it did not hold, and the holder's exit
        # released what it held
        assert free(other, RUN, "r")

    def test_runs_and_purposes_are_independent(self, locks: RunLocks, other: RunLocks) -> None:
        with locks.hold(RUN, "r"):
            assert free(other, REROOT, "r")  # a re-root of a run goes on beside its saves
            assert free(other, RUN, "s")
        with locks.hold(REROOT, "r"):
            assert free(other, RUN, "r")
            assert not free(other, REROOT, "r")

    @pytest.mark.parametrize("run", ["+reroot+r", "reroot", "reroot+r", "r.lock", "reroot.r"])
    def test_a_purpose_is_a_namespace_whatever_the_run_name(
        self, locks: RunLocks, other: RunLocks, run: str
    ) -> None:
        """Names that would collide if a purpose were a prefix or a folder of run names."""
        with locks.hold(REROOT, "r"):
            assert free(other, RUN, run)
        with locks.hold(RUN, run):
            assert free(other, REROOT, "r")

    def test_released_when_the_holder_dies(self, locks: RunLocks) -> None:
        build = self.constructor()
        if build is None:
            pytest.skip("these locks live in one process")
        code = (
            "import sys, time\n"
            "from pathlib import Path\n"
            "from ckptstore_service.catalog.locks import *\n"
            f"with ({build}).hold(Purpose.RUN, 'r') as held:\n"
            "    print('held' if held else 'refused', flush=True)\n"
            "    time.sleep(600)\n"
        )
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "held"
            assert not free(locks, RUN, "r")
        finally:
            child.kill()
            child.wait()
        got = threading.Event()

        def wait_for_it() -> None:  # the server may notice the lost connection a bit later
            with locks.hold(RUN, "r") as held:
                if held:
                    got.set()

        waiter = threading.Thread(target=wait_for_it, daemon=True)
        waiter.start()
        waiter.join(PATIENCE_S)  # and released again, before the database goes
        assert got.is_set()
