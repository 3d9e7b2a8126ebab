"""What a fork saves a fine-tune, and what deleting its source then costs.

    .venv/bin/python bench/fork.py [--mb 64] [--steps 4] [--tune 3]

Starts a real service (``ckptstore-service serve``, SQLite and a local folder in a temp
directory, no re-roots), saves ``--steps`` checkpoints of a ~``--mb`` MB state that changes
slowly (the state of ``bench/delete.py``: fp32 weights, AdamW-like moments, a frozen table)
as the run ``base``, forks its newest into ``ft`` and saves ``--tune`` fine-tuning steps
there (the weights move on from the fork with another gradient stream). Prints: the fork's
time and the bytes it added to the blob store (none); each fine-tune save's stored bytes,
against the same first state saved as a new run's first checkpoint (what a fine-tune costs
without a fork) and against a delta in the source run; ``GET /v1/runs/ft``'s stored and
shared bytes; then the source run's delete: its time, the bytes it wrote for the fork
(the fork's chunks re-based off the source's), the stored bytes before and after the
collection, and that every fine-tune checkpoint still loads bit-exactly.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from ckptstore import CheckpointClient
from delete import _blobs, _serve, _states, _wait_idle


def _fine_tune(start: dict[str, torch.Tensor], steps: int) -> list[dict[str, torch.Tensor]]:
    """``steps`` states moving on from ``start``: other gradients, the same frozen table."""
    torch.manual_seed(1)
    w, m, v = (start[k].clone() for k in ("w", "m", "v"))
    n = m.numel()
    out = []
    for _ in range(steps):
        g = torch.randn(w.numel()) * 1e-2
        w -= 1e-3 * g
        m.mul_(0.9).add_(0.1 * g[:n])
        v.mul_(0.999).add_(1e-3 * g[:n] ** 2)
        out.append({"w": w.clone(), "m": m.clone(), "v": v.clone(), "frozen": start["frozen"]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tune", type=int, default=3)
    args = parser.parse_args()
    base = _states(args.mb, args.steps)
    last = args.steps - 1
    tuned = _fine_tune(base[last], args.tune)
    mb = 1e6
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _serve(tmp)
        root = Path(tmp) / "blobs"
        try:
            client = CheckpointClient(url)
            for step, state in enumerate(base):
                client.save("base", step, state)
            source = client.list("base")[-1]
            files = _blobs(root)
            t0 = time.perf_counter()
            fork = client.fork("base", last, "ft")
            fork_s = time.perf_counter() - t0
            added = sum(n for k, n in _blobs(root).items() if k not in files)
            saves = [client.save("ft", last + 1 + i, s) for i, s in enumerate(tuned)]
            whole = client.save("fresh", last + 1, tuned[0])
            client.delete_run("fresh")
            detail = client.run_info("ft")
            _wait_idle(url)
            files = _blobs(root)
            t0 = time.perf_counter()
            client.delete_run("base")
            delete_s = time.perf_counter() - t0
            written = sum(n for k, n in _blobs(root).items() if k not in files)
            _wait_idle(url)
            after = _blobs(root)
            later = client.run_info("ft")
            expected = {last: base[last]} | {last + 1 + i: s for i, s in enumerate(tuned)}
            for step, state in expected.items():
                got = client.load("ft", step)
                assert all(torch.equal(got[k], state[k]) for k in state), step
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"state: {source.raw_bytes / mb:.1f} MB raw; base: {args.steps} checkpoints")
    print(
        f"fork base@{last} -> ft@{last}: {fork_s * 1e3:.0f} ms, {added} bytes added to the "
        f"blob store, {fork.stored_bytes} stored"
    )
    for info in saves:
        print(f"  ft@{info.step}: {info.stored_bytes / mb:.2f} MB stored")
    print(
        f"first fine-tune save: {saves[0].stored_bytes / mb:.2f} MB on the fork, "
        f"{whole.stored_bytes / mb:.2f} MB as a new run's first checkpoint "
        f"({saves[0].stored_bytes / whole.stored_bytes:.2f}x); a delta in base: "
        f"{source.stored_bytes / mb:.2f} MB"
    )
    print(
        f"GET /v1/runs/ft: stored {detail.stored_bytes / mb:.2f} MB, shared "
        f"{detail.shared_bytes / mb:.2f} MB (base's chunks it rests on)"
    )
    print(
        f"delete_run base: {delete_s:.2f} s, {written / mb:.2f} MB written for ft (its chunks "
        f"re-based); blob store {sum(files.values()) / mb:.1f} MB -> "
        f"{sum(after.values()) / mb:.1f} MB after collection"
    )
    print(
        f"GET /v1/runs/ft after: stored {later.stored_bytes / mb:.2f} MB, shared "
        f"{later.shared_bytes / mb:.2f} MB; every ft checkpoint loads bit-exactly"
    )


if __name__ == "__main__":
    main()
