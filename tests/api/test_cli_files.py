"""``ckptstore pull`` / ``push`` / ``du`` / ``--json`` and the CLI's reach of the service,
against a real service.

Most commands run in-process through ``ckptstore.cli.main`` (the command's own entry point,
without a fresh interpreter importing torch each time); the unreachable-service message,
``CKPTSTORE_URL`` and memory are checked on the command as a user runs it, in a child process.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckptstore import CheckpointClient
from ckptstore.cli import main
from ckptstore.client import DEFAULT_URL
from support.serviceproc import Service, free_port
from support.states import assert_same_state

MiB = 1 << 20


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``ckptstore ARGS`` in this process: exit status, stdout, stderr."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def data_section(path: Path) -> bytes:
    """A safetensors file's tensor bytes (what follows its header)."""
    raw = path.read_bytes()
    return raw[8 + int.from_bytes(raw[:8], "little") :]


def mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(64, 33, generator=g),
        "half": torch.randn(7, generator=g).half(),
        "bf": torch.randn(5, 3, generator=g).bfloat16(),
        "ids": torch.arange(-4, 9, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "fp8": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4, dtype=torch.uint8),
    }


def test_a_safetensors_file_pushed_and_pulled_back_is_the_same(
    service: Service, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = ["--url", service.url]
    original = tmp_path / "model.safetensors"
    tensors = mixed_tensors()
    save_file(tensors, original, metadata={"format": "pt"})  # the safetensors library's file

    code, out, err = run_cli(capsys, "push", str(original), "st-run", "1", "--progress", *url)
    assert code == 0, err
    assert "st-run@1" in out and "push st-run/1" in err  # the bar, asked for

    pulled = tmp_path / "back.safetensors"
    code, out, err = run_cli(capsys, "pull", "st-run@1", "-o", str(pulled), *url)
    assert code == 0, err
    assert f"pulled st-run@1 to {pulled}" in out
    assert not (tmp_path / "back.safetensors.tmp").exists()
    back = load_file(pulled)
    assert_same_state(dict(sorted(tensors.items())), dict(sorted(back.items())))
    assert data_section(pulled) == data_section(original)  # the very bytes, in file order
    with safe_open(pulled, "pt") as f:
        assert f.metadata()["format"] == "pt"  # the file's metadata, kept

    # a pulled file pushed back is the same checkpoint (the response's checksums are not
    # part of it), and pushed elsewhere it pulls back as the very same file
    assert run_cli(capsys, "push", str(pulled), "st-run", "1", *url)[0] == 0
    assert run_cli(capsys, "push", str(pulled), "st-copy", "4", *url)[0] == 0
    again = tmp_path / "again.safetensors"
    assert run_cli(capsys, "pull", "st-copy", "-o", str(again), *url)[0] == 0
    assert again.read_bytes() == pulled.read_bytes()


def test_pt_files_and_latest(
    service: Service, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = ["--url", service.url]
    states = [
        {
            "model": {"w": torch.full((300,), float(step)), "b": torch.ones(3).bfloat16()},
            "optim": {"state": {0: {"step": torch.tensor(float(step))}}},
            "step": step,
        }
        for step in (1, 2)
    ]
    with CheckpointClient(service.url) as client:
        for step, state in enumerate(states, 1):
            client.save("pt-run", step, state)

    pt = tmp_path / "latest.pt"
    code, out, err = run_cli(capsys, "pull", "pt-run", "-o", str(pt), *url)
    assert code == 0, err
    assert "pt-run@2" in out  # latest, resolved
    assert_same_state(states[1], torch.load(pt, weights_only=True))

    code, out, err = run_cli(capsys, "push", str(pt), "pt-copy", "7", "--json", *url)
    assert code == 0, err
    assert json.loads(out)["step"] == 7 and json.loads(out)["run"] == "pt-copy"
    with CheckpointClient(service.url) as client:
        assert_same_state(states[1], client.load("pt-copy", 7))

    # a .pt holding what weights_only refuses: one line naming the file, nothing stored
    torch.save({"w": torch.ones(1), "obj": ValueError("x")}, tmp_path / "evil.pt")
    code, _, err = run_cli(capsys, "push", str(tmp_path / "evil.pt"), "pt-evil", "1", *url)
    assert code == 1 and "evil.pt: it holds a pickled exceptions.ValueError" in err
    assert len(err.strip().splitlines()) == 1


def test_json_listings_parse_and_match_the_client(
    service: Service, capsys: pytest.CaptureFixture[str]
) -> None:
    url = ["--url", service.url]
    with CheckpointClient(service.url) as client:
        for step in (10, 20, 30):
            client.save("json-a", step, {"w": torch.arange(4096.0) + step})
        client.save("json-b", 5, {"x": torch.zeros(100, dtype=torch.int32)})
        runs, listed = client.runs(), client.list("json-a")

    code, out, _ = run_cli(capsys, "runs", "--json", *url)
    assert code == 0 and json.loads(out) == {"runs": [r.to_json() for r in runs]}
    code, out, _ = run_cli(capsys, "ls", "json-a", "--json", *url)
    assert json.loads(out) == {"run": "json-a", "checkpoints": [c.to_json() for c in listed]}

    code, out, _ = run_cli(capsys, "du", "--json", *url)
    du = json.loads(out)
    assert du["runs"] == [r.to_json() for r in runs]
    assert du["total"] == {
        "runs": len(runs),
        "checkpoints": sum(r.checkpoints for r in runs),
        "raw_bytes": sum(r.raw_bytes for r in runs),
        "stored_bytes": sum(r.stored_bytes for r in runs),
    }
    code, out, _ = run_cli(capsys, "du", "json-a", "--json", *url)
    du_run = json.loads(out)
    assert du_run["checkpoints"] == [c.to_json() for c in listed]
    assert du_run["total"]["checkpoints"] == 3
    assert du_run["total"]["stored_bytes"] == sum(c.stored_bytes for c in listed)

    code, out, _ = run_cli(capsys, "du", "json-a", *url)  # the table: a row per step, a total
    rows = [line.split() for line in out.splitlines()[1:]]
    assert [row[0] for row in rows[:-1]] == ["10", "20", "30"]
    assert rows[-1][:3] == ["total", "(3", "checkpoints)"]


def test_failures_leave_files_and_the_store_as_they_were(
    service: Service, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = ["--url", service.url]
    kept = tmp_path / "kept.safetensors"
    kept.write_bytes(b"the previous download")
    code, _, err = run_cli(capsys, "pull", "no-such-run@3", "-o", str(kept), *url)
    assert code == 1 and "no-such-run" in err
    assert kept.read_bytes() == b"the previous download"
    assert not (tmp_path / "kept.safetensors.tmp").exists()

    # a local file error is the file's, not retried as if the network had failed
    nowhere = tmp_path / "missing" / "x.safetensors"
    code, _, err = run_cli(capsys, "pull", "no-such-run", "-o", str(nowhere), *url)
    assert code == 1 and err == f"ckptstore: {nowhere}.tmp: no such file or directory\n"

    renamed = tmp_path / "torch.safetensors"  # a torch.save file under the wrong name
    torch.save({"w": torch.ones(3)}, renamed)
    code, _, err = run_cli(capsys, "push", str(renamed), "bad-files", "1", *url)
    assert code == 1 and "is not a safetensors file" in err and "torch.save" in err

    cut = tmp_path / "cut.safetensors"
    save_file({"w": torch.ones(1000)}, cut)
    cut.write_bytes(cut.read_bytes()[:-10])
    code, _, err = run_cli(capsys, "push", str(cut), "bad-files", "1", *url)
    assert code == 1 and "is not a whole safetensors file" in err
    with CheckpointClient(service.url) as client:
        assert "bad-files" not in [r.name for r in client.runs()]

    with pytest.raises(SystemExit) as usage:  # argparse: status 2
        main(["pull", "x", "-o", str(tmp_path / "out.bin")])
    assert usage.value.code == 2
    assert ".safetensors" in capsys.readouterr().err


@pytest.mark.timing
def test_an_unreachable_service_is_reported_at_once() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptstore.cli", "runs", "--url", url],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stderr is not None
    first = proc.stderr.readline()
    first_after = time.perf_counter() - t0
    rest = proc.stderr.read()
    code = proc.wait(timeout=30)
    took = time.perf_counter() - t0
    assert first.startswith(f"ckptstore: cannot reach {url}: connection refused; retrying")
    assert first_after < 5, first_after  # about 0.3 s: the interpreter's start-up, then this
    assert code == 1 and took < 10, took  # few retries, short backoff (about 2 s in all)
    last = rest.splitlines()[-1]
    assert last.startswith(
        f"ckptstore: cannot reach the ckptstore service at {url}: connection refused. "
        "Nothing has answered there yet"
    )
    assert "CKPTSTORE_URL" in last


def test_ckptstore_url_is_honoured(service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    with CheckpointClient(service.url) as client:
        client.save("env-run", 1, {"w": torch.ones(2)})
    listing = subprocess.run(
        [sys.executable, "-m", "ckptstore.cli", "runs"],  # no --url
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CKPTSTORE_URL": service.url},
    )
    assert listing.returncode == 0, listing.stderr
    assert "env-run" in listing.stdout

    monkeypatch.setenv("CKPTSTORE_URL", service.url + "/")
    with CheckpointClient() as client:
        assert client.url == service.url
        assert client.list("env-run")[0].step == 1
    monkeypatch.delenv("CKPTSTORE_URL")
    assert CheckpointClient().url == DEFAULT_URL


# the command, then its peak resident memory (VmHWM: of this process image only; ru_maxrss
# would count the memory of the test process it was forked from)
_MEASURED = """
import re, sys
from pathlib import Path
from ckptstore.cli import main
code = main(sys.argv[1:])
status = Path("/proc/self/status").read_text()
print(int(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1)) * 1024)
sys.exit(code)
"""


def _peak_rss(args: list[str]) -> int:
    """Peak resident memory (bytes) of ``ckptstore ARGS`` in a child process."""
    done = subprocess.run(
        [sys.executable, "-c", _MEASURED, *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.splitlines()[-1])


def test_pull_and_push_stream_in_bounded_memory(service: Service, tmp_path: Path) -> None:
    size = 64 * MiB
    big: dict[str, Any] = {"a": torch.zeros(size // 8), "b": torch.ones(size // 8)}
    source = tmp_path / "big.safetensors"
    save_file(big, source)
    del big
    pushed_rss = _peak_rss(["push", str(source), "big-run", "1", "--url", service.url])
    pulled = tmp_path / "pulled.safetensors"
    pulled_rss = _peak_rss(["pull", "big-run", "-o", str(pulled), "--url", service.url])
    assert data_section(pulled) == data_section(source)
    # the interpreter with numpy and xxhash: ~45 MiB (measured); a whole checkpoint adds 64
    print(f"peak RSS: push {pushed_rss / MiB:.0f} MiB, pull {pulled_rss / MiB:.0f} MiB")
    assert pushed_rss < 80 * MiB and pulled_rss < 80 * MiB, (pushed_rss, pulled_rss)


class CuttingProxy:
    """A TCP proxy to ``127.0.0.1:port`` that closes its first connection after ``limit``
    bytes of the response: a service that fails mid-stream once, then answers."""

    def __init__(self, port: int, limit: int) -> None:
        self._port = port
        self._limit = limit
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self._server.accept()
            except OSError:  # closed
                return
            self.connections += 1
            upstream = socket.create_connection(("127.0.0.1", self._port))
            limit = self._limit if self.connections == 1 else None
            threading.Thread(target=_pipe, args=(downstream, upstream, None), daemon=True).start()
            threading.Thread(target=_pipe, args=(upstream, downstream, limit), daemon=True).start()

    def close(self) -> None:
        self._server.close()


def _pipe(src: socket.socket, dst: socket.socket, limit: int | None) -> None:
    """Copy ``src`` to ``dst`` (at most ``limit`` bytes), then close both."""
    sent = 0
    try:
        while data := src.recv(1 << 16):
            if limit is not None and sent + len(data) >= limit:
                dst.sendall(data[: limit - sent])
                break
            dst.sendall(data)
            sent += len(data)
    except OSError:
        pass
    finally:
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def test_a_pull_cut_short_is_retried_from_the_start(
    service: Service, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with CheckpointClient(service.url) as client:
        client.save("cut-run", 1, {"w": torch.randn(1 << 18), "b": torch.arange(1000)})
    direct = tmp_path / "direct.safetensors"
    assert run_cli(capsys, "pull", "cut-run", "-o", str(direct), "--url", service.url)[0] == 0

    proxy = CuttingProxy(service.port, limit=300_000)  # the response is ~1 MiB
    try:
        cut = tmp_path / "cut.safetensors"
        code, _, err = run_cli(capsys, "pull", "cut-run", "-o", str(cut), "--url", proxy.url)
    finally:
        proxy.close()
    assert code == 0, err
    assert f"ckptstore: {proxy.url} cut its response short; retrying" in err
    assert proxy.connections == 2
    assert cut.read_bytes() == direct.read_bytes()  # the retry rewrote the file from the start


def test_a_pickle_the_safe_loader_refuses(
    service: Service, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line that names the class and the ways out, no terminal escape codes (torch's
    message is a page with bold on); ``--unsafe-load`` for a file one trusts (a NumPy
    scalar, as trainers often record their best metric: refused by the safe loader,
    storable); a value the format cannot hold, one line naming it."""
    url = ["--url", service.url]
    best = tmp_path / "best.pt"
    torch.save({"w": torch.arange(4.0), "best": np.float64(0.25)}, best)
    code, _, err = run_cli(capsys, "push", str(best), "pt-best", "1", *url)
    assert code == 1
    assert len(err.strip().splitlines()) == 1 and "\x1b" not in err
    assert "best.pt: it holds a pickled numpy." in err
    assert "--unsafe-load" in err and ".safetensors" in err
    code, _, err = run_cli(capsys, "push", str(best), "pt-best", "1", "--unsafe-load", *url)
    assert code == 0, err
    with CheckpointClient(service.url) as client:
        loaded = client.load("pt-best", 1)
    assert_same_state(torch.arange(4.0), loaded["w"])
    assert float(loaded["best"]) == 0.25

    torch.save({"w": torch.ones(1), "error": ValueError("x")}, tmp_path / "odd.pt")
    args = ("push", str(tmp_path / "odd.pt"), "pt-odd", "1", "--unsafe-load", *url)
    code, _, err = run_cli(capsys, *args)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "odd.pt" in err and "ValueError" in err


def test_a_second_push_of_the_same_content_says_so(
    service: Service, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = ["--url", service.url]
    pt = tmp_path / "same.pt"
    torch.save({"w": torch.arange(8.0)}, pt)
    code, out, err = run_cli(capsys, "push", str(pt), "pt-again", "3", *url)
    assert code == 0 and out.startswith("pushed "), err
    code, out, err = run_cli(capsys, "push", str(pt), "pt-again", "3", *url)
    assert code == 0, err
    assert out.startswith("pt-again@3 already holds exactly this content") and "nothing" in out


def test_pt_files_without_torch_say_what_needs_it(
    service: Service,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client-only install (no torch): ``pull -o x.pt`` and ``push x.pt`` say that torch
    is needed and what works without it, not "No module named 'torch'"."""
    with CheckpointClient(service.url) as client:
        client.save("no-torch", 1, {"w": torch.ones(3)})
    torch.save({"w": torch.ones(3)}, tmp_path / "in.pt")
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    url = ["--url", service.url]
    code, _, err = run_cli(capsys, "pull", "no-torch", "-o", str(tmp_path / "x.pt"), *url)
    assert code == 1 and "needs torch" in err and "pull to FILE.safetensors" in err, err
    assert not (tmp_path / "x.pt").exists()
    code, _, err = run_cli(capsys, "push", str(tmp_path / "in.pt"), "no-torch", "2", *url)
    assert code == 1 and "needs torch" in err and "push a .safetensors file" in err, err
