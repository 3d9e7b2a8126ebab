"""What deleting a checkpoint from the middle of a chain costs: time and bytes rewritten.

    .venv/bin/python bench/delete.py [--mb 64] [--steps 10] [--delete 5]

Starts a real service (``ckptstore-service serve``, SQLite and a local folder in a temp
directory, no re-roots: one chain from the keyframe at step 0), saves ``--steps``
checkpoints of a ~``--mb`` MB state that changes slowly (fp32 weights with small updates,
AdamW-like moments, a frozen embedding), then deletes checkpoint ``--delete`` and prints:
the DELETE's wall time, the blobs it wrote in place of others and their bytes (the new blob
files), the stored bytes before and after the collection, and that its neighbours still
load bit-exactly.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
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


def _serve(tmp: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = {
        **os.environ,
        "CKPTSTORE_DATA_DIR": tmp,
        "CKPTSTORE_REROOT_DEPTH": "0",
        "CKPTSTORE_GARBAGE_GRACE_S": "0",
        "CKPTSTORE_REROOT_QUIET_S": "0",
    }
    cmd = [sys.executable, "-m", "ckptstore_service.cli", "serve", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    return proc, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--delete", type=int, default=5)
    args = parser.parse_args()
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
