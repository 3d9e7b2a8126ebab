"""The control plane at many ranks, simulated: one checkpoint written by N ranks that encode
their own tiny shards (``direct=True``), through the real service on PostgreSQL, over real
HTTP.

    .venv/bin/python bench/control_plane.py [--ranks 1024] [--concurrency 64] [--steps 2]

Each rank is a task in a thread pool (``--concurrency`` at once): it asks for its plan
(``POST .../plan``), encodes its shard (``--shard`` fp32 elements in ``--tensors`` tensors,
their names its own) with the core's pipeline and sends it encoded (``PUT
.../parts/rank-R/encoded``); then one coordinator commits the N parts (``POST .../commit``).
Step 2 onwards diff against step 1 (each rank keeps its base file). Printed per step: the
wall time of all plans and parts, the commit's latency, requests per rank, the latency
percentiles of plan and part requests, and the catalog rows the checkpoint holds. Never
fails on a missed target."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
from sqlalchemy import create_engine, text

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from ckptstore.direct import DirectWriter, Sent, pieces_of  # noqa: E402
from ckptstore.transport import Transport  # noqa: E402
from ckptstore_core.wire import FORMAT  # noqa: E402
from support.pg import pg_database  # noqa: E402
from support.serviceproc import Service  # noqa: E402


class Rank:
    """One simulated rank: its own connection, its own direct writer (and base file)."""

    def __init__(self, url: str, rank: int, shard: int, tensors: int) -> None:
        self.transport = Transport(url, timeout=120)
        self.rank = rank
        self.shard = shard
        self.tensors = tensors
        self.direct = DirectWriter(workers=1)
        self.latency = 0.0

    def save(self, run: str, step: int) -> Sent:
        rng = np.random.default_rng(self.rank)
        n = self.shard // self.tensors
        arrays = [rng.standard_normal(n).astype(np.float32) for _ in range(self.tensors)]
        views = [memoryview((a + np.float32(1e-3 * step)).tobytes()) for a in arrays]
        path = f"/v1/runs/{run}/checkpoints/{step}"
        spec = [(f"w{t}.{self.rank}", "F32", (n,)) for t in range(self.tensors)]
        t0 = time.perf_counter()
        sent = self.direct.save_part(
            self.transport, path, run, f"rank-{self.rank}", spec, lambda: pieces_of(views)
        )
        self.latency = time.perf_counter() - t0
        return sent

    def close(self) -> None:
        self.direct.close()
        self.transport.close()


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--shard", type=int, default=4096, help="fp32 elements per rank")
    p.add_argument("--tensors", type=int, default=1, help="tensors (shards) per rank")
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    with pg_database() as db_url, tempfile.TemporaryDirectory() as tmp:
        env = {
            "CKPTSTORE_DATABASE_URL": db_url,
            "CKPTSTORE_VERIFY_INTERVAL_S": "3600",
            # every simulated rank has the same address: it may hold every upload slot
            "CKPTSTORE_MAX_UPLOADS_PER_CLIENT": str(args.concurrency),
            "CKPTSTORE_MAX_CONCURRENT_UPLOADS": str(args.concurrency),
        }
        svc = Service(Path(tmp), env).start()
        ranks = [Rank(svc.url, r, args.shard, args.tensors) for r in range(args.ranks)]
        try:
            with ThreadPoolExecutor(args.concurrency) as pool:
                for step in range(1, args.steps + 1):
                    t0 = time.perf_counter()
                    sent = list(pool.map(lambda r, s=step: r.save("scale", s), ranks))
                    t_parts = time.perf_counter() - t0
                    names = [f"rank-{r.rank}" for r in ranks]
                    t1 = time.perf_counter()
                    response = httpx.post(
                        f"{svc.url}/v1/runs/scale/checkpoints/{step}/commit",
                        json={"parts": names, "metadata": {"format": FORMAT}},
                        timeout=300,
                    )
                    t_commit = time.perf_counter() - t1
                    assert response.status_code == 201, response.text
                    for r, s in zip(ranks, sent, strict=True):
                        r.direct.keep(s)
                    parts = [r.latency for r in ranks]
                    info = response.json()
                    engine = create_engine(db_url)
                    with engine.connect() as conn:
                        rows = conn.execute(
                            text(
                                "SELECT (SELECT count(*) FROM chunks c JOIN checkpoints k "
                                "ON c.checkpoint_id = k.id WHERE k.step = :s), "
                                "(SELECT count(*) FROM tensors t JOIN checkpoints k "
                                "ON t.checkpoint_id = k.id WHERE k.step = :s)"
                            ),
                            {"s": step},
                        ).one()
                    engine.dispose()
                    print(
                        f"step {step}: {args.ranks} ranks ({args.concurrency} at once): plans + "
                        f"parts {t_parts:.2f} s, commit {t_commit:.3f} s; 3 requests per rank "
                        f"(plan, part, and the coordinator's one commit); a rank's plan + part "
                        f"p50/p99 {pct(parts, 50) * 1e3:.0f}/{pct(parts, 99) * 1e3:.0f} ms; "
                        f"catalog rows: {rows[0]} chunks, {rows[1]} tensors; stored "
                        f"{info['stored_bytes']} of {info['raw_bytes']} bytes",
                        flush=True,
                    )
        finally:
            for r in ranks:
                r.close()
            svc.stop()


if __name__ == "__main__":
    main()
