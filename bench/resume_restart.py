"""A resume after a service restart: ``latest`` loaded by a freshly started process on the
same data folder, with the cache file the last process installed taken back (the default:
checked against the catalog's checksums, then served) and without it (the cache folder
deleted first, as on a replica that never held it: the chain is decoded from storage).

    .venv/bin/python bench/resume_restart.py [--run gpt-scratch-fp32] [--quick] [--repeats 3]

The checkpoints are bench.py's (bench/models.py), trained once and kept where
bench/profile_save.py keeps them (``/tmp/ckptstore-profile-cache``); saved as bench.py does
(one chain). The two cases alternate, a restart before each load; the medians are printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import models  # noqa: E402
from ckptstore import CheckpointClient  # noqa: E402
from profile_save import checkpoints  # noqa: E402
from support.serviceproc import Service, forget_cache  # noqa: E402

ENV = {"CKPTSTORE_KEYFRAME_INTERVAL": "16", "CKPTSTORE_MAX_CHAIN_DEPTH": "16"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", choices=list(models.RUNS), default="gpt-scratch-fp32")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "ckptstore-profile-cache"
    )
    args = p.parse_args()
    ckpts = checkpoints(args.run, args.quick, 8 if args.quick else 9, 25, args.cache)
    data = Path(tempfile.mkdtemp(prefix="ckptstore-resume-")) / "data"
    svc = Service(data, ENV).start()
    with CheckpointClient(svc.url) as client:
        for step, state in ckpts:
            info = client.save(args.run, step, state)
    svc.stop()
    times: dict[str, list[float]] = {"file kept": [], "file gone": []}
    for _ in range(args.repeats):
        for case, seconds in times.items():
            if case == "file gone":
                forget_cache(data)
            svc = Service(data, ENV).start()
            with CheckpointClient(svc.url) as client:
                t0 = time.perf_counter()
                client.load(args.run)
                seconds.append(time.perf_counter() - t0)
            svc.stop()
    mb = info.raw_bytes / 1e6
    print(
        f"{args.run}: latest (step {info.step}, {mb:.1f} MB, "
        f"depth {info.chain_depth}) after a restart"
    )
    for case, seconds in times.items():
        median = statistics.median(seconds)
        runs = ", ".join(f"{s:.3f}" for s in seconds)
        print(f"  {case:9s}  median {median:.3f} s  {mb / median:6.0f} MB/s  ({runs})")


if __name__ == "__main__":
    main()
