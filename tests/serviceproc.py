"""Run the real service (uvicorn) in a child process on a free port, for end-to-end tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

__all__ = ["Service", "eventually", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Service:
    """``ckptstore serve`` in a child process; ``env`` adds CKPTSTORE_* settings."""

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
                    sys.executable,
                    "-m",
                    "ckptstore_service.cli",
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
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"service exited early:\n{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"service did not start:\n{self.log.read_text()[-4000:]}")

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


def partial_upload(url: str, run: str, step: int, sent: bytes, total_len: int) -> socket.socket:
    """POST ``total_len`` bytes announced but only ``sent`` written; the socket stays open.

    Close it to simulate a client that disconnects mid-upload, or keep it open to hold the
    upload (and the run's lock) in progress.
    """
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        f"POST /v1/runs/{run}/checkpoints/{step} HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {total_len}\r\n\r\n".encode()
        + sent
    )
    return sock


def eventually(check: Callable[[], None], timeout: float = 5.0) -> None:
    """Retry ``check`` until it passes (the service notices a hang-up asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
