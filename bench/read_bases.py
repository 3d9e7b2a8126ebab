"""Direct saves of a process that holds no base of the run (it neither saved nor loaded
it: a job restarted from a local copy, another writer's run), with and without reading the
parent's tensors from the store as bases (``CheckpointClient(direct=True,
read_bases=...)``), on a real AdamW training state (fp32 weights, their bf16 copy, the
optimizer's moments, a frozen embedding), local backend.

    .venv/bin/python bench/read_bases.py [--width 4096] [--repeats 3] [--limit 1.5]
                                         [--out bench/out]

Each repeat, ``read_bases`` on and off interleaved (each in runs of its own): one process
saves step 1 of a run and steps 1..4 of another (a keyframe, then deltas); new processes
save step 2 of the first (the parent a keyframe) and step 5 of the other (the parent a
delta: its chain's chunks are read too). Measured per save: stored bytes (the listing), the
bytes read from the store (the ranged reads' lengths), the save's wall time and this
process's CPU seconds (``time.process_time``: the codec threads included; the service
runs in a process of its own). Output: a table and bench/out/read_bases-WIDTH-LIMIT.json."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import ckptstore.direct  # noqa: E402
import ckptstore.direct_load  # noqa: E402
from ckptstore import CheckpointClient  # noqa: E402
from support.serviceproc import Service  # noqa: E402

MB = 1e6


def training(width: int, n: int) -> list[dict[str, Any]]:
    """``n`` checkpoints of an MLP trained with AdamW, 5 steps apart."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, width), nn.GELU(), nn.Linear(width, 256))
    frozen = nn.Embedding(4096, 256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    states = []
    for step in range(n):
        for _ in range(5):
            loss = model(torch.randn(64, 256)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        states.append(
            {
                "model": {k: v.clone() for k, v in model.state_dict().items()},
                "half": {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()},
                "frozen": {k: v.clone() for k, v in frozen.state_dict().items()},
                "optimizer": _clone(opt.state_dict()),
                "step": step + 1,
            }
        )
    return states


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clone(v) for v in x]
    return x


def new_process() -> None:
    """The next direct save makes a writer of its own, holding no base."""
    if ckptstore.direct._shared is not None:
        ckptstore.direct._shared.close()
    ckptstore.direct._shared = None


class ReadCounter:
    """The bytes the ranged reads return (``_Ranges.view``)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._view = ckptstore.direct_load._Ranges.view
        counter = self

        def view(self: Any, key: str, start: int, end: int) -> Any:
            counter.bytes += end - start
            return counter._view(self, key, start, end)

        ckptstore.direct_load._Ranges.view = view  # type: ignore[method-assign]


def stored(url: str, run: str, step: int) -> int:
    doc = httpx.get(f"{url}/v1/runs/{run}/checkpoints").json()
    return next(c["stored_bytes"] for c in doc["checkpoints"] if c["step"] == step)


def timed_save(url: str, run: str, step: int, state: Any, read: bool, reads: ReadCounter) -> dict:
    new_process()
    before = reads.bytes
    with CheckpointClient(url, direct=True, read_bases=read) as client:
        wall, cpu = time.perf_counter(), time.process_time()
        client.save(run, step, state)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {
        "stored": stored(url, run, step),
        "read": reads.bytes - before,
        "wall_s": wall,
        "cpu_s": cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--limit", type=float, default=ckptstore.direct.READ_LIMIT)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = parser.parse_args()
    ckptstore.direct.READ_LIMIT = args.limit
    states = training(args.width, 5)
    raw = sum(t.numel() * t.element_size() for t in _tensors(states[0]))
    reads = ReadCounter()
    rows: dict[str, list[dict]] = {}
    env = {"CKPTSTORE_VERIFY_INTERVAL_S": "3600"}
    with tempfile.TemporaryDirectory() as tmp:
        service = Service(Path(tmp) / "svc", env).start()
        try:
            for r in range(args.repeats):
                for read in (True, False) if r % 2 == 0 else (False, True):
                    run = f"r{r}-{'read' if read else 'cold'}"
                    new_process()
                    with CheckpointClient(service.url, direct=True) as client:
                        client.save(run, 1, states[0])
                        for step in (1, 2, 3, 4):
                            client.save(run + "-chain", step, states[step - 1])
                    got = timed_save(service.url, run, 2, states[1], read, reads)
                    rows.setdefault(f"keyframe parent, read_bases={read}", []).append(got)
                    got = timed_save(service.url, run + "-chain", 5, states[4], read, reads)
                    rows.setdefault(f"delta parent, read_bases={read}", []).append(got)
                    rows.setdefault("keyframe (step 1)", []).append(
                        {"stored": stored(service.url, run, 1), "read": 0, "wall_s": 0, "cpu_s": 0}
                    )
        finally:
            new_process()
            service.stop()
    print(
        f"state: {raw / MB:.1f} MB raw (width {args.width}), read limit {args.limit}, "
        f"{args.repeats} repeats, medians"
    )
    print(f"{'case':38} {'stored MB':>10} {'read MB':>9} {'wall s':>8} {'cpu s':>7}")
    summary = {}
    for case, got in rows.items():
        med = {k: sorted(g[k] for g in got)[len(got) // 2] for k in got[0]}
        summary[case] = med
        print(
            f"{case:38} {med['stored'] / MB:10.2f} {med['read'] / MB:9.2f} "
            f"{med['wall_s']:8.2f} {med['cpu_s']:7.2f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    out = {"raw_bytes": raw, "width": args.width, "limit": args.limit, "cases": summary}
    (args.out / f"read_bases-{args.width}-{args.limit}.json").write_text(json.dumps(out, indent=1))


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, list):
        return [t for v in x for t in _tensors(v)]
    return []


if __name__ == "__main__":
    main()
