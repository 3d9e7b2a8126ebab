"""What deleting a checkpoint from the middle of a chain costs: time and bytes rewritten.

    .venv/bin/python bench/delete.py [--mb 64] [--steps 10] [--delete 5]

Starts a real service (``ckptstore-service serve``, SQLite and a local folder in a temp
directory, no re-roots: one chain from the keyframe at step 0), saves ``--steps``
checkpoints of a ~``--mb`` MB state that changes slowly (fp32 weights with small updates,
AdamW-like moments, a frozen embedding), then deletes checkpoint ``--delete`` and prints:
the DELETE's wall time, the blobs it wrote in place of others and their bytes (the new blob
files), the stored bytes before and after the collection, and that its neighbours still
load bit-exactly.

    .venv/bin/python bench/delete.py --curve 10,100,1000 [--service-path DIR]

The cost curve against run length (docs/lifecycle.md): for each length N, a run of N
checkpoints of a LoRA-like state (a frozen 8 MB table that every checkpoint refers to, a
1 MB weight and its moment that change), then: deleting its first checkpoint (the one that
stored the frozen table), deleting its middle one, and a retention pass keeping the last
checkpoint only (N - 1 deletes) while a thread keeps saving to the run. Prints each
delete's time and bytes written (from the service's log), and the longest save during the
pass. ``--service-path`` runs another checkout's service (``DIR/core:DIR/client:DIR/service``)
for a side-by-side comparison; ``--retention-max`` skips the pass on longer runs.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from ckptstore import CheckpointClient


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _blobs(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*.blob")}


def _states(mb: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """``steps`` states of about ``mb`` MB: weights (half), two moments, a frozen table."""
    torch.manual_seed(0)
    n = (mb << 20) // 4 // 8  # floats per eighth
    w = torch.randn(4 * n)
    m = torch.zeros(n)
    v = torch.zeros(n)
    frozen = torch.randn(2 * n)
    out = []
    for _ in range(steps):
        g = torch.randn(4 * n) * 1e-2
        w -= 1e-3 * g
        m.mul_(0.9).add_(0.1 * g[:n])
        v.mul_(0.999).add_(1e-3 * g[:n] ** 2)
        out.append({"w": w.clone(), "m": m.clone(), "v": v.clone(), "frozen": frozen.clone()})
    return out


def _wait_idle(url: str) -> None:
    """Until the maintenance passes are done (the collection, grace 0)."""
    for _ in range(600):
        if httpx.get(f"{url}/healthz", timeout=30).json()["maintenance"] == 0:
            return
        time.sleep(0.05)


def _serve(
    tmp: str, service_path: str | None = None, log: Path | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = {
        **os.environ,
        "CKPTSTORE_DATA_DIR": tmp,
        "CKPTSTORE_REROOT_DEPTH": "0",
        "CKPTSTORE_GARBAGE_GRACE_S": "0",
        "CKPTSTORE_REROOT_QUIET_S": "0",
    }
    if service_path:
        env["PYTHONPATH"] = os.pathsep.join([service_path, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "ckptstore_service.cli", "serve", "--port", str(port)]
    out = subprocess.DEVNULL if log is None else log.open("ab")
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    return proc, url


_DELETED = re.compile(r"deleted (\S+)/(\d+): .*\((\d+) bytes written\), in ([\d.]+)s")


def _deletes(log: Path) -> list[tuple[int, int, float]]:
    """``(step, bytes written, seconds)`` of every delete the service logged."""
    return [(int(m[2]), int(m[3]), float(m[4])) for m in _DELETED.finditer(log.read_text("utf-8"))]


def _lora(step: int) -> dict[str, torch.Tensor]:
    """A LoRA-like state at ``step``: a frozen 8 MB table, a 1 MB weight and its moment."""
    g = torch.Generator().manual_seed(step)
    frozen = torch.randn(2 << 20, generator=torch.Generator().manual_seed(12345))
    # the weight moves a little from one checkpoint to the next (deltas pay), the moment
    # does not (Adam's first moment gains nothing from a delta)
    w = torch.randn(256 << 10, generator=torch.Generator().manual_seed(1))
    w += 1e-4 * torch.randn(256 << 10, generator=g)
    m = 1e-3 * torch.randn(256 << 10, generator=g)
    return {"frozen": frozen, "lora.w": w, "lora.m": m}


def _curve_point(n: int, service_path: str | None, retention: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "service.log"
        proc, url = _serve(tmp, service_path, log)
        try:
            client = CheckpointClient(url)
            t0 = time.perf_counter()
            for step in range(n):
                client.save("lora", step, _lora(step))
            saving = time.perf_counter() - t0
            _wait_idle(url)
            stored = sum(i.stored_bytes for i in client.list("lora"))
            print(f"N={n}: saved in {saving:.1f} s, {stored / 1e6:.1f} MB stored", flush=True)
            for gone in (0, n // 2):
                x = {i.step: i for i in client.list("lora")}[gone]
                client.delete("lora", gone)
                _, written, took = _deletes(log)[-1]
                print(
                    f"  delete step {gone} ({x.stored_bytes / 1e6:.2f} MB stored): "
                    f"{took:.2f} s, {written / 1e6:.2f} MB written",
                    flush=True,
                )
            for step in (1, n - 1):
                got = client.load("lora", step)
                want = _lora(step)
                assert all(torch.equal(got[k], want[k]) for k in want), step
            if retention:
                _retention_pass(client, url, log, n)
        finally:
            proc.terminate()
            proc.wait(30)


def _retention_pass(client: CheckpointClient, url: str, log: Path, n: int) -> None:
    """keep_last=1 over the run (the N - 2 checkpoints left after the deletes above go; and
    those saved meanwhile but the newest), a thread saving to it meanwhile: the longest
    save."""
    before = len(_deletes(log))
    waits: list[float] = []
    done = threading.Event()

    def saver() -> None:
        step = n
        while not done.wait(0.25):  # a save every quarter second or so
            t = time.perf_counter()
            client.save("lora", step, _lora(step))
            waits.append(time.perf_counter() - t)
            step += 1

    t0 = time.perf_counter()
    client.set_retention("lora", keep_last=1)
    thread = threading.Thread(target=saver)
    thread.start()
    try:
        while client.list("lora")[0].step < n - 1:  # the N - 1 it had are gone
            time.sleep(0.2)
    finally:
        done.set()
        thread.join()
    _wait_idle(url)
    took = time.perf_counter() - t0
    deletes = _deletes(log)[before:]
    written = [w for _, w, _ in deletes]
    seconds = [t for _, _, t in deletes]
    latest = client.list("lora")[-1]
    got = client.load("lora", latest.step)
    assert all(torch.equal(got[k], v) for k, v in _lora(latest.step).items())
    print(
        f"  retention keep_last=1: {len(deletes)} deletes in {took:.1f} s, "
        f"{sum(written) / 1e6:.1f} MB written ({max(written, default=0) / 1e6:.2f} MB and "
        f"{max(seconds, default=0):.2f} s at most per delete); {len(waits)} saves meanwhile, "
        f"the longest {max(waits, default=0):.2f} s",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--delete", type=int, default=5)
    parser.add_argument("--curve", default="", help="run lengths, e.g. 10,100,1000")
    parser.add_argument(
        "--service-path", default=None, help="PYTHONPATH entries of another checkout's service"
    )
    parser.add_argument("--retention-max", type=int, default=1000)
    args = parser.parse_args()
    if args.curve:
        for n in (int(x) for x in args.curve.split(",")):
            _curve_point(n, args.service_path, n <= args.retention_max)
        return
    states = _states(args.mb, args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _serve(tmp)
        try:
            client = CheckpointClient(url)
            for step, state in enumerate(states):
                client.save("bench", step, state)
            before = {i.step: i for i in client.list("bench")}
            root = Path(tmp) / "blobs"
            files = _blobs(root)
            t0 = time.perf_counter()
            client.delete("bench", args.delete)
            took = time.perf_counter() - t0
            new = {k: n for k, n in _blobs(root).items() if k not in files}
            later = {i.step: i for i in client.list("bench")}
            _wait_idle(url)  # the run's maintenance pass collects (grace 0)
            after = _blobs(root)
            for step in (args.delete - 1, args.delete + 1):
                got = client.load("bench", step)
                assert all(torch.equal(got[k], states[step][k]) for k in states[step])
        finally:
            proc.terminate()
            proc.wait(30)
    x = before[args.delete]
    raw = x.raw_bytes
    print(f"state: {raw / 1e6:.1f} MB raw, {args.steps} checkpoints, one chain (keyframe 0)")
    print(f"deleted step {args.delete} ({x.stored_bytes / 1e6:.1f} MB stored) in {took:.2f} s")
    print(
        f"rewritten: {len(new)} blob(s), {sum(new.values()) / 1e6:.1f} MB "
        f"(steps whose chunks rested on it: their whole blob is written anew)"
    )
    for step, info in later.items():
        if info.stored_bytes != before[step].stored_bytes:
            print(
                f"  step {step}: {before[step].stored_bytes / 1e6:.2f} MB -> "
                f"{info.stored_bytes / 1e6:.2f} MB stored (a delta of step "
                f"{info.parent_step} now), chain depth {before[step].chain_depth} -> "
                f"{info.chain_depth}"
            )
    print(
        f"stored: {sum(files.values()) / 1e6:.1f} MB before, "
        f"{sum(after.values()) / 1e6:.1f} MB after collection"
    )
    print(f"steps {args.delete - 1} and {args.delete + 1} load bit-exactly")


if __name__ == "__main__":
    main()
