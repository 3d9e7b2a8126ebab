"""Save and load throughput on each backend, with where the service spends the time.

    .venv/bin/python bench/backends.py [--mib 512] [--checkpoints 3]

Runs the real service (a child process) twice: on the embedded defaults (SQLite + a local
folder) and on the production backends (the machine's PostgreSQL + an S3 server: moto,
started on a free port). Each run saves a few checkpoints of a slowly drifting fp32 state
(the first is a keyframe, the next ones deltas), then loads the latest (base cache) and the
first one after a restart (decoded from storage). Phases come from the service's log.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ckptstore import CheckpointClient
from support.pg import pg_database
from support.s3server import fake_aws_credentials, start_moto
from support.serviceproc import Service

MB = 1e6


def state_stream(mib: int, count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` states of ``mib`` MiB (4 fp32 tensors), each a small step from the last."""
    g = torch.Generator().manual_seed(0)
    w = {f"layer{i}.weight": torch.randn((mib // 4) << 18, generator=g) for i in range(4)}
    states = []
    for _ in range(count):
        states.append({k: v.clone() for k, v in w.items()})
        for v in w.values():
            v.add_(torch.randn(v.shape, generator=g) * 1e-3)
    return states


def run(
    label: str, env: dict[str, str], data_dir: Path, states: list[dict[str, torch.Tensor]]
) -> None:
    raw = sum(t.numel() * 4 for t in states[0].values())
    env = {**env, "CKPTSTORE_TEST_LOG_LEVEL": "info"}
    svc = Service(data_dir, env).start()
    client = CheckpointClient(svc.url)
    print(f"\n== {label}: {len(states)} checkpoints of {raw / MB:.0f} MB")
    for i, state in enumerate(states):
        t = time.perf_counter()
        info = client.save("bench", i, state)
        dt = time.perf_counter() - t
        print(
            f"save {i}: {raw / dt / MB:6.0f} MB/s  stored {info.stored_bytes / MB:6.1f} MB "
            f"(ratio {raw / info.stored_bytes:.2f}, keyframe={info.keyframe})"
        )
    t = time.perf_counter()
    client.load("bench")
    print(f"load latest (base cache): {raw / (time.perf_counter() - t) / MB:6.0f} MB/s")
    svc.stop()
    svc = Service(data_dir, env).start()
    client = CheckpointClient(svc.url)
    last = len(states) - 1
    t = time.perf_counter()
    client.load("bench", last)
    rate = raw / (time.perf_counter() - t) / MB
    print(f"load {last} after restart (decode {last} deep): {rate:6.0f} MB/s")
    svc.stop()
    print("service phases (from its log):")
    for path in sorted(data_dir.glob("service-*.log")):
        for line in path.read_text().splitlines():
            m = re.search(r"(saved|loaded) .*", line)
            if m:
                print("  ", m.group(0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=512, help="checkpoint size in MiB")
    parser.add_argument("--checkpoints", type=int, default=3)
    args = parser.parse_args()
    states = state_stream(args.mib, args.checkpoints)
    root = Path(tempfile.mkdtemp(prefix="ckptstore-bench-"))
    try:
        run("SQLite + local folder", {}, root / "local", states)
        with fake_aws_credentials(), pg_database() as pg_url:
            url, stop = start_moto()
            try:
                env = {
                    "CKPTSTORE_DATABASE_URL": pg_url,
                    "CKPTSTORE_BLOB_URL": f"s3://bench-{uuid.uuid4().hex[:8]}/ckpt",
                    "CKPTSTORE_S3_ENDPOINT_URL": url,
                    "CKPTSTORE_S3_PATH_STYLE": "true",
                    "CKPTSTORE_S3_CREATE_BUCKET": "true",
                    "CKPTSTORE_S3_REGION": "us-east-1",
                }
                run("PostgreSQL + S3 (moto)", env, root / "s3", states)
            finally:
                stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
