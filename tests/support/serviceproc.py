"""Run the real service (uvicorn) in a child process on a free port, for end-to-end tests."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from support.waiting import poll, wait_until

__all__ = ["Service", "cache_files", "forget_cache", "free_port", "maintenance_runs", "wait_idle"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Service:
    """``ckptstore-service serve`` in a child process; ``env`` adds CKPTSTORE_* settings.
    ``program`` is the command before ``serve`` (a profiling bench runs its own)."""

    program: tuple[str, ...] = (sys.executable, "-m", "ckptstore_service.cli")

    def __init__(self, data_dir: Path, env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.env = {**os.environ, "CKPTSTORE_DATA_DIR": str(data_dir), **(env or {})}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir / f"service-{self.port}.log"

    def start(self, timeout: float = 30.0) -> Service:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    *self.program,
                    "serve",
                    "--port",
                    str(self.port),
                    "--log-level",
                    self.env.get("CKPTSTORE_TEST_LOG_LEVEL", "warning"),
                ],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        if poll(self._up, timeout, interval=0.1):
            return self
        self.stop()
        raise RuntimeError(f"service did not start:\n{self.log.read_text()[-4000:]}")

    def _up(self) -> bool:
        """/healthz answers 200; RuntimeError if the process has exited."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"service exited early:\n{self.log.read_text()[-4000:]}")
        try:
            return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def rss_bytes(self, field: str = "VmRSS") -> int:
        """Resident memory (VmRSS) or its peak (VmHWM) of the service process."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"{field} not found")

    def reset_peak_rss(self) -> None:
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")

    def kill(self) -> None:
        """SIGKILL: a crash, no clean-up."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def __enter__(self) -> Service:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def forget_cache(data_dir: Path) -> None:
    """Delete the base cache a stopped service left in ``data_dir``: the next process there
    is a replica that never held the files (a restarted one takes back, once checked, the
    file of a run's latest that it finds: ``CachePolicy``), so its loads decode from storage."""
    shutil.rmtree(data_dir / "cache", ignore_errors=True)


def cache_files(data_dir: Path) -> list[Path]:
    """The checkpoint files the base cache in ``data_dir`` holds installed
    (``<checkpoint id>.bin``; spares and fills in progress live in each slot's ``tmp/``)."""
    return sorted((data_dir / "cache").glob("slot-*/*.bin"))


def wait_idle(url: str, timeout: float = 60.0) -> None:
    """Until the service at ``url`` reports no re-root pass queued or running (/healthz's
    ``maintenance``: the runs whose pass waits out its quiet time or runs)."""

    def idle() -> bool:
        return not httpx.get(f"{url}/healthz", timeout=30).json()["maintenance"]

    wait_until(idle, timeout, "the service's background maintenance finished", interval=0.02)


def maintenance_runs(url: str, outcome: str, task: str | None = None) -> float:
    """``ckptstore_maintenance_runs_total`` of the service at ``url`` with ``outcome``
    (``ok``, ``error``), of one ``task`` (``retention``, ``reroot``, ``garbage``...) or
    summed over all."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if not line.startswith("ckptstore_maintenance_runs_total{"):
            continue
        if f'outcome="{outcome}"' in line and (task is None or f'task="{task}"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def listing(url: str, run: str) -> dict[int, dict[str, Any]]:
    """The run's checkpoints as the service at ``url`` lists them, by step."""
    response = httpx.get(f"{url}/v1/runs/{run}/checkpoints")
    assert response.status_code == 200, response.text
    return {c["step"]: c for c in response.json()["checkpoints"]}


def verdicts(url: str, run: str) -> dict[int, dict[str, Any]]:
    """The run's listing once the verifier has judged every checkpoint it has to (none
    ``pending``)."""
    return wait_until(
        lambda: (
            (got := listing(url, run))
            and all(c["verification"] != "pending" for c in got.values())
            and got
        ),
        what=f"the verifier's verdicts on {run}",
    )
