"""A real S3 peer for tests: moto's standalone server on an ephemeral port.

    url, stop = start_moto()          # a child process (default) or a thread of this process
    try:
        with fake_aws_credentials():
            store = S3BlobStore("bucket", endpoint_url=url, path_style=True, create_bucket=True)
            ...
    finally:
        stop()

The child process is the default: it keeps moto's global state (and any ``mock_aws`` used by
other tests) apart, and does not compete with the code under test for this process's GIL. It
exits by itself when this process goes away, since it lives until its stdin closes.
Failure to start raises, so tests that depend on it fail rather than skip.

``s3_store(env)`` opens the store that a service started with ``env`` writes to, to look
at what it left in the bucket.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from ckptstore_service.storage.s3 import S3BlobStore

__all__ = ["fake_aws_credentials", "frozen", "s3_store", "start_moto", "start_moto_process"]

_CHILD = """
import logging, sys
logging.getLogger("werkzeug").setLevel(logging.ERROR)
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # returns at EOF: the parent stopped us or died
server.stop()
"""

_FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    # Keep the developer's ~/.aws (profiles, real keys, odd defaults) out of the tests.
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_PROFILE": None,
    "AWS_ENDPOINT_URL": None,
    "AWS_ENDPOINT_URL_S3": None,
}


def start_moto(
    *, in_process: bool = False, timeout_s: float = 60
) -> tuple[str, Callable[[], None]]:
    """Start a moto S3 server on 127.0.0.1 and a free port; returns ``(endpoint_url, stop)``."""
    if in_process:
        return _start_thread(timeout_s)
    url, stop, _ = start_moto_process(timeout_s)
    return url, stop


def start_moto_process(timeout_s: float = 60) -> tuple[str, Callable[[], None], int]:
    """``start_moto()``'s child process, with its pid (to freeze it: :func:`frozen`)."""
    stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
    )
    assert proc.stdin is not None and proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else b""
    if not line.strip().isdigit():
        proc.kill()
        proc.wait()
        stderr.seek(0)
        detail = stderr.read().decode(errors="replace")[-4000:]
        stderr.close()
        raise RuntimeError(f"moto server did not start (exit {proc.returncode}):\n{detail}")
    port = int(line)

    def stop() -> None:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        stderr.close()

    return f"http://127.0.0.1:{port}", stop, proc.pid


@contextmanager
def frozen(pid: int) -> Iterator[None]:
    """The server process ``pid`` stopped (SIGSTOP) inside: it accepts connections (the
    kernel does) but never answers, like a hung store; continued (SIGCONT) after, always."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _start_thread(timeout_s: float) -> tuple[str, Callable[[], None]]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    # start() waits forever if the socket cannot be bound; give it a deadline.
    starter = threading.Thread(target=server.start, daemon=True)
    starter.start()
    starter.join(timeout_s)
    if starter.is_alive():
        raise RuntimeError(f"moto server did not start within {timeout_s} s")
    _, port = server.get_host_and_port()
    return f"http://127.0.0.1:{port}", server.stop


@contextmanager
def fake_aws_credentials() -> Iterator[None]:
    """Dummy credentials and region in the environment (what moto accepts), restored after."""
    saved = {name: os.environ.get(name) for name in _FAKE_CREDENTIALS}
    try:
        for name, value in _FAKE_CREDENTIALS.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def s3_store(env: dict[str, str]) -> S3BlobStore:
    """The S3 store (bucket and prefix of ``CKPTSTORE_BLOB_URL``) that a service started
    with the settings ``env`` uses."""
    from ckptstore_service.storage.s3 import S3BlobStore

    url = urlsplit(env["CKPTSTORE_BLOB_URL"])
    assert url.scheme == "s3", url
    return S3BlobStore(
        url.netloc,
        url.path.strip("/"),
        endpoint_url=env["CKPTSTORE_S3_ENDPOINT_URL"],
        path_style=True,
        region=env.get("CKPTSTORE_S3_REGION", "us-east-1"),
    )
