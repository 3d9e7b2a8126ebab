"""Service-encoded saves and loads against direct ones (``CheckpointClient(direct=True)``), on
the same real training checkpoints (bench/models.py), one writer, one replica, on the local
backend (SQLite + a folder) or the production ones (``--backend s3``: PostgreSQL + moto).

    .venv/bin/python bench/direct.py [--quick] [--runs ...] [--backend local|s3] [--out bench/out]
        [--synthetic MIB [--ranks N ...]] [--modes service direct]

For each run, each mode saves the same checkpoints in order into a fresh service, then
loads every one back (a direct client decodes them itself) and compares it bit for bit.
Measured per mode: the service's CPU seconds per GB saved and per GB loaded (user + system
of its process, the verifier paused by a long ``CKPTSTORE_VERIFY_INTERVAL_S`` so the save
and load paths are measured alone; each service first takes two saves and a load of a
1 MiB run of its own, outside the clocks, whose CPU is reported apart as the warm-up:
``warm_up``), the client's CPU, save and load wall time, stored bytes,
the bytes the service read while saving (``rchar``: the request bodies, and on S3 nothing
else) and wrote while loading (``wchar``: the responses; with S3 a direct load's ranges come
from the bucket through presigned URLs, the service sends only their layout). Then the
verifier is let run (a restart with a short interval) and its CPU seconds per GB verified
are measured apart: direct saves move the encoding to the writer; decoding each
client-encoded checkpoint once stays on the service, in the background, within its CPU
share.

``--ranks 1 2 4`` (with ``--synthetic``): the same checkpoints as distributed saves and
loads of N ranks each, through one replica (:func:`measure_ranks`).

Output: a table and bench/out/direct[-s3].json (``--ranks``: direct-ranks[-s3].json).
Never fails on a missed target.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import backends  # noqa: E402
import models  # noqa: E402
from bench import mismatch, proc_cpu_s, raw_bytes  # noqa: E402
from ckptstore import CheckpointClient, parts  # noqa: E402
from ckptstore.state import dtype_to_wire, tensor_bytes  # noqa: E402
from support.pg import pg_database  # noqa: E402
from support.s3server import fake_aws_credentials, start_moto  # noqa: E402
from support.serviceproc import Service  # noqa: E402

GB = 1e9


def io_bytes(pid: int, field: str = "rchar") -> int:
    """Bytes the process read (``rchar``) or wrote (``wchar``) through sockets and files
    (/proc/PID/io)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def warm_up(client: CheckpointClient, run: str) -> None:
    """Two saves of a 1 MiB run of its own (a keyframe, then a delta against it), before
    the clocks: what a fresh service process pays once, whatever it serves next (lazy
    imports, the store client's API models, the catalog's compiled statements), measured
    apart (``service_warm_up_cpu_s``) so that the per-GB figures are a running replica's."""
    w = torch.arange(1 << 18, dtype=torch.float32)
    client.save(run + "-warm", 1, {"w": w})
    client.save(run + "-warm", 2, {"w": w + 1})


def bench_env(backend: dict[str, str], checkpoints: int) -> dict[str, str]:
    """The service's settings for a measured run: one chain (no keyframe, no re-root) and
    no verifier pass while the clocks run."""
    depth = str(max(16, checkpoints + 1))
    return {
        **backend,
        "CKPTSTORE_KEYFRAME_INTERVAL": depth,
        "CKPTSTORE_MAX_CHAIN_DEPTH": depth,
        "CKPTSTORE_VERIFY_INTERVAL_S": "3600",
        "CKPTSTORE_REROOT_QUIET_S": "3600",
    }


def measure(
    run: str, ckpts: list[tuple[int, Any]], workdir: Path, direct: bool, backend: dict[str, str]
) -> dict[str, Any]:
    data_dir = workdir / f"{run}-{'direct' if direct else 'service'}"
    run = data_dir.name  # a run of its own: the production backends' catalog is shared
    env = bench_env(backend, len(ckpts))
    raw = sum(raw_bytes(s) for _, s in ckpts)
    svc = Service(data_dir, env).start()
    try:
        with CheckpointClient(svc.url, timeout=600, direct=direct) as client:
            cpu0 = proc_cpu_s(svc.pid)
            warm_up(client, run)
            warm_cpu = proc_cpu_s(svc.pid) - cpu0
            cpu0, rx0, mine0 = proc_cpu_s(svc.pid), io_bytes(svc.pid), time.process_time()
            t0 = time.perf_counter()
            for step, state in ckpts:
                client.save(run, step, state)
            save_s = time.perf_counter() - t0
            svc_cpu = proc_cpu_s(svc.pid) - cpu0
            received = io_bytes(svc.pid) - rx0
            client_cpu = time.process_time() - mine0
            stored = sum(c.stored_bytes for c in client.list(run))
    finally:
        svc.stop()
    verify_cpu = verify_s = 0.0
    if direct:  # the verifier's work, apart
        svc = Service(data_dir, {**env, "CKPTSTORE_VERIFY_INTERVAL_S": "0.2"}).start()
        try:
            with CheckpointClient(svc.url, timeout=600) as client:
                cpu0, t0 = proc_cpu_s(svc.pid), time.perf_counter()
                while any(c.verification == "pending" for c in client.list(run)):
                    time.sleep(0.2)
                verify_s = time.perf_counter() - t0
                verify_cpu = proc_cpu_s(svc.pid) - cpu0
                states = [c.verification for c in client.list(run)]
        finally:
            svc.stop()
        assert set(states) == {"verified"}, states
    svc = Service(data_dir, env).start()
    try:
        with CheckpointClient(svc.url, timeout=600, direct=direct) as client:
            client.list(run)  # the connection and the first query, before the clocks
            client.load(run + "-warm", 2)  # and a first load's set-up (see warm_up)
            cpu0, tx0, mine0 = proc_cpu_s(svc.pid), io_bytes(svc.pid, "wchar"), time.process_time()
            t0 = time.perf_counter()
            loaded = [(s, state, client.load(run, s)) for s, state in ckpts]
            load_s = time.perf_counter() - t0
            load_cpu = proc_cpu_s(svc.pid) - cpu0
            sent = io_bytes(svc.pid, "wchar") - tx0
            client_load_cpu = time.process_time() - mine0
            wrong = [s for s, state, got in loaded if mismatch(state, got)]
            del loaded
    finally:
        svc.stop()
    return {
        "raw_bytes": raw,
        "stored_bytes": stored,
        "save_s": save_s,
        "service_cpu_s_per_gb": svc_cpu / (raw / GB),
        "service_warm_up_cpu_s": warm_cpu,
        "client_cpu_s_per_gb": client_cpu / (raw / GB),
        "service_read_fraction": received / raw,
        "verify_cpu_s_per_gb": verify_cpu / (raw / GB),
        "load_s": load_s,
        "service_load_cpu_s_per_gb": load_cpu / (raw / GB),
        "client_load_cpu_s_per_gb": client_load_cpu / (raw / GB),
        "service_sent_fraction": sent / raw,
        "verify_s": verify_s,
        "mismatched_steps": wrong,
    }


def measure_ranks(
    run: str,
    ckpts: list[tuple[int, Any]],
    workdir: Path,
    direct: bool,
    backend: dict[str, str],
    ranks: int,
) -> dict[str, Any]:
    """The same checkpoints saved as a distributed save of ``ranks`` ranks (forked
    processes, one torch thread each, rank r holding every ``ranks``-th tensor as its part,
    the parent committing), then loaded back rank by rank (each its own tensors:
    ``parts.select``), through one replica: wall time of the saves (from the ranks' start to
    the commit's answer) and of the loads (to the slowest rank's last byte), and the
    service's CPU per GB of each."""
    data_dir = workdir / f"{run}-{'direct' if direct else 'service'}-{ranks}ranks"
    run = data_dir.name
    env = bench_env(backend, len(ckpts))
    raw = sum(raw_bytes(s) for _, s in ckpts)
    names = list(ckpts[0][1])
    ctx = multiprocessing.get_context("fork")  # the ranks share the parent's states
    go, done = ctx.Barrier(ranks + 1), ctx.Barrier(ranks + 1)
    wrong: Any = ctx.Queue()
    svc = Service(data_dir, env).start()
    try:
        with CheckpointClient(svc.url, timeout=600, direct=direct) as client:
            warm_up(client, run)
            procs = [
                ctx.Process(
                    target=_rank,
                    args=(svc.url, run, ckpts, names[r::ranks], r, direct, go, done, wrong),
                )
                for r in range(ranks)
            ]
            for proc in procs:
                proc.start()
            save_s = load_s = 0.0
            cpu0 = proc_cpu_s(svc.pid)
            for step, _ in ckpts:
                go.wait()
                t0 = time.perf_counter()
                done.wait()
                parts.commit(client, run, step, [f"rank-{r}" for r in range(ranks)], {})
                save_s += time.perf_counter() - t0
            save_cpu = proc_cpu_s(svc.pid) - cpu0
            cpu0 = proc_cpu_s(svc.pid)
            for _ in ckpts:
                go.wait()
                t0 = time.perf_counter()
                done.wait()
                load_s += time.perf_counter() - t0
            load_cpu = proc_cpu_s(svc.pid) - cpu0
            for proc in procs:
                proc.join()
            stored = sum(c.stored_bytes for c in client.list(run))
    finally:
        svc.stop()
    mismatched = sorted({wrong.get() for _ in range(wrong.qsize())})
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return {
        "ranks": ranks,
        "raw_bytes": raw,
        "stored_bytes": stored,
        "save_s": save_s,
        "service_cpu_s_per_gb": save_cpu / (raw / GB),
        "load_s": load_s,
        "service_load_cpu_s_per_gb": load_cpu / (raw / GB),
        "mismatched_steps": mismatched,
    }


def _rank(
    url: str,
    run: str,
    ckpts: list[tuple[int, Any]],
    names: list[str],
    rank: int,
    direct: bool,
    go: Any,
    done: Any,
    wrong: Any,
) -> None:
    """One rank of :func:`measure_ranks`: each save, its part; then each load, its tensors
    (compared with what it saved once the load's clock stopped)."""
    torch.set_num_threads(1)
    with CheckpointClient(url, timeout=600, direct=direct) as client:
        for step, state in ckpts:
            specs = [(n, dtype_to_wire(state[n].dtype), tuple(state[n].shape)) for n in names]
            go.wait()
            parts.put_part(
                client,
                run,
                step,
                f"rank-{rank}",
                specs,
                lambda state=state: (tensor_bytes(state[n]) for n in names),
                direct=direct,
            )
            done.wait()
        for step, state in ckpts:
            got: dict[str, bytes] = {}
            go.wait()
            parts.select(
                client,
                run,
                step,
                names,
                lambda spec, data, got=got: got.__setitem__(spec.name, bytes(data)),
                direct=direct,
            )
            done.wait()
            if any(got[n] != bytes(tensor_bytes(state[n])) for n in names):
                wrong.put(step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="small models: a smoke run")
    p.add_argument("--runs", nargs="+", choices=list(models.RUNS), default=list(models.RUNS))
    p.add_argument("--checkpoints", type=int, default=None, help="per run (default 9; quick 4)")
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--backend", choices=["local", "s3"], default="local")
    p.add_argument(
        "--synthetic",
        type=int,
        metavar="MIB",
        help="instead of the training runs: checkpoints of MIB MiB of slowly drifting fp32 "
        "weights (bench/backends.py's states; no training, so per-GB figures in minutes)",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        choices=["service", "direct"],
        default=["service", "direct"],
        help="which saves and loads to measure (default both, side by side)",
    )
    p.add_argument(
        "--ranks",
        type=int,
        nargs="+",
        metavar="N",
        help="instead of one writer: distributed saves and loads of N ranks each (processes), "
        "through one replica; wall time and service CPU per mode (with --synthetic)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = p.parse_args()
    with contextlib.ExitStack() as stack:
        backend = {} if args.backend == "local" else stack.enter_context(production())
        bench(args, backend)


@contextlib.contextmanager
def production() -> Iterator[dict[str, str]]:
    """The service's settings for PostgreSQL (a fresh database) and a moto S3 server."""
    with fake_aws_credentials(), pg_database() as pg_url:
        url, stop = start_moto()
        try:
            yield {
                "CKPTSTORE_DATABASE_URL": pg_url,
                "CKPTSTORE_BLOB_URL": f"s3://bench-{uuid.uuid4().hex[:8]}/ckpt",
                "CKPTSTORE_S3_ENDPOINT_URL": url,
                "CKPTSTORE_S3_PATH_STYLE": "true",
                "CKPTSTORE_S3_CREATE_BUCKET": "true",
                "CKPTSTORE_S3_REGION": "us-east-1",
            }
        finally:
            stop()


def bench(args: argparse.Namespace, backend: dict[str, str]) -> None:
    torch.set_num_threads(2)
    size = models.SIZES["quick" if args.quick else "full"]
    n_ckpt = args.checkpoints or (4 if args.quick else 9)
    if args.ranks:
        bench_ranks(args, backend, n_ckpt)
        return
    out: dict[str, Any] = {"quick": args.quick, "backend": args.backend, "runs": {}}
    workdir = Path(tempfile.mkdtemp(prefix="ckptstore-direct-"))
    print(
        f"{'run':18} {'mode':8} {'raw MB':>8} {'stored':>8} {'save s':>7} {'svc s/GB':>9} "
        f"{'cli s/GB':>9} {'rx/raw':>7} {'verify s/GB':>12} {'load s':>7} {'svc ld s/GB':>11} "
        f"{'cli ld s/GB':>11} {'tx/raw':>7} {'warm-up s':>9} exact"
    )
    names = ["synthetic"] if args.synthetic else args.runs
    for name in names:
        if args.synthetic:
            ckpts = list(enumerate(backends.state_stream(args.synthetic, n_ckpt), start=1))
        else:
            ckpts = models.RUNS[name](size, n_ckpt, args.every, lambda _: None).checkpoints
        for direct in [mode == "direct" for mode in args.modes]:
            m = measure(name, ckpts, workdir, direct, backend)
            out["runs"].setdefault(name, {})["direct" if direct else "service"] = m
            print(
                f"{name:18} {'direct' if direct else 'service':8} {m['raw_bytes'] / 1e6:8.1f} "
                f"{m['stored_bytes'] / 1e6:8.1f} {m['save_s']:7.2f} "
                f"{m['service_cpu_s_per_gb']:9.3f} {m['client_cpu_s_per_gb']:9.3f} "
                f"{m['service_read_fraction']:7.3f} {m['verify_cpu_s_per_gb']:12.3f} "
                f"{m['load_s']:7.2f} {m['service_load_cpu_s_per_gb']:11.3f} "
                f"{m['client_load_cpu_s_per_gb']:11.3f} {m['service_sent_fraction']:7.4f} "
                f"{m['service_warm_up_cpu_s']:9.2f} "
                f"{'yes' if not m['mismatched_steps'] else m['mismatched_steps']}",
                flush=True,
            )
        both = out["runs"][name]
        if len(both) == 2:
            ratio = both["direct"]["stored_bytes"] / both["service"]["stored_bytes"]
            print(f"{name:18} stored direct / service: {ratio:.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.backend == "local" else f"-{args.backend}"
    (args.out / f"direct{suffix}.json").write_text(json.dumps(out, indent=1))


def bench_ranks(args: argparse.Namespace, backend: dict[str, str], n_ckpt: int) -> None:
    """``--ranks``: :func:`measure_ranks` per rank count and mode, on synthetic states."""
    if not args.synthetic:
        raise SystemExit("--ranks needs --synthetic MIB")
    ckpts = list(enumerate(backends.state_stream(args.synthetic, n_ckpt), start=1))
    workdir = Path(tempfile.mkdtemp(prefix="ckptstore-direct-"))
    out: dict[str, Any] = {"backend": args.backend, "ranks": {}}
    print(
        f"{'ranks':>5} {'mode':8} {'raw MB':>8} {'stored':>8} {'save s':>7} {'svc s/GB':>9} "
        f"{'load s':>7} {'svc ld s/GB':>11} exact"
    )
    for n in args.ranks:
        for direct in [mode == "direct" for mode in args.modes]:
            m = measure_ranks("ranks", ckpts, workdir, direct, backend, n)
            out["ranks"].setdefault(str(n), {})["direct" if direct else "service"] = m
            print(
                f"{n:5d} {'direct' if direct else 'service':8} {m['raw_bytes'] / 1e6:8.1f} "
                f"{m['stored_bytes'] / 1e6:8.1f} {m['save_s']:7.2f} "
                f"{m['service_cpu_s_per_gb']:9.3f} {m['load_s']:7.2f} "
                f"{m['service_load_cpu_s_per_gb']:11.3f} "
                f"{'yes' if not m['mismatched_steps'] else m['mismatched_steps']}",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.backend == "local" else f"-{args.backend}"
    (args.out / f"direct-ranks{suffix}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
