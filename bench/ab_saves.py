"""Saves through HTTP, this checkout's service against another's, in interleaved rounds.

    .venv/bin/python bench/ab_saves.py --against /tmp/old [--runs NAME...] [--rounds 3]

``--against`` is another checkout of this repository (``git worktree add /tmp/old REV``);
its service runs with its ``core``, ``client`` and ``service`` first on ``PYTHONPATH``. Each
round starts a fresh service of one side, saves the run's checkpoints (bench.py's, trained
once and kept by ``bench/profile_save.py``'s cache) through this checkout's client a
first time (a warm-up: the service's first buffers, its compiled SQL) and then ``--saves``
more times under new run names, each pass timed; the sides alternate round by round, so a
busy spell of a shared machine hits both. Printed per side, the medians over the timed
passes: the wall time of the checkpoints' saves, the service's CPU time (all threads, and
its event loop thread's alone) and its minor page faults, which a VM that hands freed
memory back to its host charges for (docs/benchmarks.md). A whole bench run moves by up to
a third from one run to the next on such hosts; interleaved rounds are what tells a change
of a few percent.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import models  # noqa: E402
from bench import proc_stat  # noqa: E402
from ckptstore import CheckpointClient  # noqa: E402
from profile_save import checkpoints  # noqa: E402
from support.serviceproc import Service  # noqa: E402


def one_round(
    name: str, ckpts: list[tuple[int, Any]], env: dict[str, str], saves: int
) -> list[dict[str, float]]:
    """A fresh service; the checkpoints saved once untimed, then ``saves`` timed passes."""
    data = Path(tempfile.mkdtemp(prefix="ckptstore-ab-"))
    depth = str(max(16, len(ckpts) + 1))
    env = {
        **env,
        "CKPTSTORE_KEYFRAME_INTERVAL": depth,
        "CKPTSTORE_MAX_CHAIN_DEPTH": depth,
        "CKPTSTORE_REROOT_QUIET_S": "3600",  # no re-root between the passes
    }
    svc = Service(data, env).start(120)
    passes = []
    try:
        with CheckpointClient(svc.url, timeout=600) as client:
            for k in range(saves + 1):
                cpu0, faults0 = proc_stat(svc.pid)
                loop0, _ = proc_stat(svc.pid, svc.pid)
                t0 = time.perf_counter()
                for step, state in ckpts:
                    client.save(f"{name}-{k}", step, state)
                wall = time.perf_counter() - t0
                cpu1, faults1 = proc_stat(svc.pid)
                loop1, _ = proc_stat(svc.pid, svc.pid)
                if k:
                    passes.append(
                        {
                            "wall_s": wall,
                            "service_cpu_s": cpu1 - cpu0,
                            "event_loop_cpu_s": loop1 - loop0,
                            "faults_mb": (faults1 - faults0) * os.sysconf("SC_PAGE_SIZE") / 1e6,
                        }
                    )
    finally:
        svc.stop()
        shutil.rmtree(data, ignore_errors=True)
    return passes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--against", type=Path, required=True, help="the other checkout")
    p.add_argument("--runs", nargs="+", choices=list(models.RUNS), default=["finetune-fp32"])
    p.add_argument("--rounds", type=int, default=3, help="rounds per side")
    p.add_argument("--saves", type=int, default=2, help="timed passes per round")
    p.add_argument("--checkpoints", type=int, default=9)
    p.add_argument("--every", type=int, default=25)
    p.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "ckptstore-profile-cache"
    )
    args = p.parse_args()
    other = ":".join(str(args.against.resolve() / d) for d in ("core", "client", "service"))
    sides = {"this": {}, "against": {"PYTHONPATH": other}}
    for name in args.runs:
        ckpts = checkpoints(name, False, args.checkpoints, args.every, args.cache)
        got: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
        for r in range(args.rounds):
            for side, env in sides.items():
                got[side] += one_round(name, ckpts, env, args.saves)
                print(f"{name}: round {r + 1} of {args.rounds}, {side} done", flush=True)
        for side, passes in got.items():
            med = {k: statistics.median(x[k] for x in passes) for k in passes[0]}
            walls = " ".join(
                f"{x['wall_s']:.2f}" for x in sorted(passes, key=lambda x: x["wall_s"])
            )
            print(
                f"{name} {side:8s} wall {med['wall_s']:.3f} s (all: {walls}); service CPU "
                f"{med['service_cpu_s']:.2f} s, event loop {med['event_loop_cpu_s']:.2f} s, "
                f"page faults {med['faults_mb']:.0f} MB (medians of {len(passes)})"
            )


if __name__ == "__main__":
    main()
