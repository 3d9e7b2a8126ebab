"""Where a save's time goes: a per-stage breakdown of ckptstore's saves on the bench's runs.

    .venv/bin/python bench/profile_save.py [--quick] [--runs ...] [--json out.json]
        [--in-process]

The checkpoints are bench.py's (bench/models.py, the same training runs), kept in
``--cache`` (default ``/tmp/ckptstore-profile-cache``) after the first training, so that a
second profile does not train again. The real service runs in a child process, set up as in
bench.py (one chain, no keyframe), with its save path instrumented: every stage below is
wrapped, in that process only, by a timer of the *calling thread's CPU time*
(``time.thread_time``, exclusive of the stages it calls), so the figures hold on a machine
that other work keeps busy, where wall times do not. Each thread's total CPU (from
``/proc``) is read too: what no stage claims is its "other". The client saves every
checkpoint in order, as the bench does; wall time per save comes from both sides: the
client's flatten and its POST, and the service's own log line of each save (body received
and encoded as it arrived, encode tail after the body's last byte, blob finish = the write
and fsync, commit).

The stages, in the order of a save:

===========================  ====================================================
receive (event loop)         the event loop thread: HTTP parsing, body pieces
parse (wire)                 ``StreamParser.feed``: header, tensor pieces
split copy                   ``Splitter.chunks``: pieces copied into chunk buffers
tensor hash                  multi-chunk tensors' xxh3-128 as they stream by
plan                         ``DeltaPlanner.plan``/``link``: each chunk's base
base read                    the parent's chunk from the base cache file
cache-file write             the chunk's raw bytes to the new base cache file
chunk checksum               each chunk's xxh3-128
ref compare                  a chunk against its base (unchanged: ``ref``)
choose on sample: planes     residuals of the sample, every mode
choose on sample: zstd       the sample's planes compressed, every mode
byte planes (full chunk)     the chosen mode's residual, split into byte planes
zero runs                    runs of unchanged elements, planes compacted
zstd (full chunk)            the chosen planes compressed (and sparse packing)
encode (other)               encode_chunk's own Python: sampling, packing, headers
blob write                   stored bytes to the blob's temp file (O_DIRECT)
fsync                        the blob's fsync and its folder's
commit                       the catalog transaction (rows, ``committed``)
===========================  ====================================================

``--in-process`` also runs the same saves through the service's save path alone
(``Saver.ingest`` in this process, uninstrumented: no HTTP, no client), and prints its
wall and CPU against the baseline: what no receive path or client could beat.

Nothing here is a pass/fail target: bench.py measures the speed against torch.save + zstd.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MB = 1e6

# -- the instrumented service (this file run with --serve) ---------------------------------

_tls = threading.local()
_lock = threading.Lock()
_spent: Counter[tuple[str, str]] = Counter()  # (thread name, stage) -> CPU seconds
_calls: Counter[str] = Counter()


def _enter() -> tuple[float, list[float]]:
    stack: list[float] = _tls.__dict__.setdefault("stack", [])
    stack.append(0.0)
    return time.thread_time(), stack


def _leave(stage: str, t0: float, stack: list[float]) -> None:
    elapsed = time.thread_time() - t0
    children = stack.pop()
    if stack:
        stack[-1] += elapsed
    key = (threading.current_thread().name, stage)
    with _lock:
        _spent[key] += elapsed - children
        _calls[stage] += 1


def _wrap(owner: Any, attr: str, stage: str | Callable[..., str]) -> None:
    """Time ``owner.attr`` (a function, or a generator function: each step of it) as
    ``stage`` (or the stage ``stage(*args)`` names)."""
    fn = getattr(owner, attr)
    name_of = stage if callable(stage) else (lambda *a, **k: stage)

    def timed(*args: Any, **kwargs: Any) -> Any:
        name = name_of(*args, **kwargs)
        t0, stack = _enter()
        try:
            out = fn(*args, **kwargs)
        finally:
            _leave(name, t0, stack)
        if isinstance(out, Iterator) and hasattr(out, "gi_frame"):
            return _timed_steps(out, name)
        return out

    setattr(owner, attr, timed)


def _timed_steps(gen: Iterator[Any], stage: str) -> Iterator[Any]:
    while True:
        t0, stack = _enter()
        try:
            item = next(gen)
        except StopIteration:
            return
        finally:
            _leave(stage, t0, stack)
        yield item


def _sampled(split: dict[str, Any], level: int, kinds: Any, gain: float) -> str:
    return "choose on sample: zstd" if kinds is None and gain != 1.0 else "zstd (full chunk)"


def _instrument() -> None:
    import ckptstore_service.save as save
    from ckptstore_core import codec, planes, wire
    from ckptstore_core.pipeline import chunks, encode, plan, split
    from ckptstore_service import catalog
    from ckptstore_service.catalog import locks
    from ckptstore_service.save import upload
    from ckptstore_service.storage import local, sink

    _wrap(wire.StreamParser, "feed", "parse (wire)")
    _wrap(split.Splitter, "chunks", "split copy")
    _wrap(split.TensorDigests, "update", "tensor hash")
    _wrap(plan.DeltaPlanner, "plan", "plan")
    _wrap(plan.DeltaPlanner, "link", "plan")
    _wrap(encode.FileBases, "read", "base read")
    _wrap(encode, "encode_job", "cache-file write")  # what encode_job does itself: pwrite
    _wrap(codec, "checksum", "chunk checksum")
    _wrap(codec, "_equal", "ref compare")
    _wrap(codec, "encode_chunk", "encode (other)")
    _wrap(codec, "_pack_planes", _sampled)
    _wrap(codec, "_zero_runs", "zero runs")
    _wrap(planes, "compact", "zero runs")
    _wrap(codec, "_scale_factor", "encode (other)")
    _wrap(codec, "cast_prediction", "cast prediction")
    _wrap(planes, "sparse_pack", "zstd (full chunk)")
    for split_fn in ("split", "split_nonzero"):
        _wrap(planes, split_fn, lambda raw, base, mode: f"byte planes ({len(raw)} elements)")
    _wrap(local._BlobFile, "write", "blob write")
    _wrap(local._BlobFile, "finish", "fsync")
    _wrap(local, "_fsync_dir", "fsync")
    _wrap(upload.UploadTransaction, "commit", "commit")
    _wrap(upload.UploadTransaction, "begin", "begin (writing row)")
    _wrap(locks._Rows, "write", "run lock (rows)")
    _wrap(locks._Rows, "drop", "run lock (rows)")
    for name in ("find", "get", "parent_of"):
        _wrap(catalog.Catalog, name, "catalog reads")
    _wrap(save, "planner_for", "base lookup (parent's rows)")
    _wrap(save, "wait_for_data", "header")
    _wrap(encode.EncodePipeline, "_submit", "pipeline bookkeeping")
    _wrap(encode.EncodePipeline, "_take", "pipeline bookkeeping")
    _wrap(chunks, "_stored_chunk", "pipeline bookkeeping")
    _wrap(sink.BlobSink, "write", "pipeline bookkeeping")


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each live thread, by name (from /proc: the threads that ended are
    not there: their stages are, in the totals)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for t in threading.enumerate():
        if t.native_id is None:
            continue
        try:
            stat = Path(f"/proc/self/task/{t.native_id}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[t.name] = out.get(t.name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _serve(argv: list[str]) -> int:
    out = Path(os.environ["CKPTSTORE_PROFILE_OUT"])
    _instrument()
    base: dict[str, float] = {}

    def reset(*_: object) -> None:
        with _lock:
            _spent.clear()
            _calls.clear()
        base.clear()
        base.update(_thread_cpu())

    def dump(*_: object) -> None:
        now = _thread_cpu()
        with _lock:
            stages = [[t, s, v] for (t, s), v in _spent.items()]
            calls = dict(_calls)
        threads = {k: v - base.get(k, 0.0) for k, v in now.items()}
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"stages": stages, "calls": calls, "threads": threads}))
        tmp.replace(out)

    signal.signal(signal.SIGUSR1, reset)
    signal.signal(signal.SIGUSR2, dump)
    from ckptstore_service.cli import main as service_main

    return service_main(argv)


# -- the profile -------------------------------------------------------------------------


_SAVED = re.compile(
    r"saved (?P<run>\S+)/(?P<step>\d+): (?P<raw>\d+) -> (?P<stored>\d+) bytes in "
    r"(?P<total>[\d.]+)s \(body (?P<body>[\d.]+)s, encode tail (?P<tail>[\d.]+)s, "
    r"blob finish (?P<finish>[\d.]+)s, commit (?P<commit>[\d.]+)s\)"
)


def _wait_for(path: Path, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            data: dict[str, Any] = json.loads(path.read_text())
            return data
        time.sleep(0.05)
    raise RuntimeError(f"the service wrote no profile to {path}")


def profile_run(name: str, ckpts: list[tuple[int, Any]], workdir: Path) -> dict[str, Any]:
    import torch

    from bench import proc_cpu_s, raw_bytes
    from ckptstore import CheckpointClient
    from ckptstore import state as state_mod

    depth = max(16, len(ckpts) + 1)
    data_dir = workdir / name
    prof = workdir / f"{name}.json"
    env = {
        "CKPTSTORE_KEYFRAME_INTERVAL": str(depth),
        "CKPTSTORE_MAX_CHAIN_DEPTH": str(depth),
        "CKPTSTORE_GARBAGE_GRACE_S": "0",
        "CKPTSTORE_TEST_LOG_LEVEL": "info",
        # no re-root during the saves: background work, not a save's
        "CKPTSTORE_REROOT_QUIET_S": "3600",
        "CKPTSTORE_PROFILE_OUT": str(prof),
    }
    svc = _ProfiledService(data_dir, env).start()
    spent: Counter[str] = Counter()
    originals = {f: getattr(state_mod, f) for f in ("flatten", "param_names")}

    def timed(fname: str) -> Any:
        fn = originals[fname]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[fname] += time.perf_counter() - t0

        return wrapper

    try:
        for fname in originals:
            setattr(state_mod, fname, timed(fname))
        with CheckpointClient(svc.url, timeout=600) as client:
            client.save(f"{name}-warm", 0, {"w": torch.zeros(1 << 20)})  # connections, jit
            spent.clear()
            os.kill(svc.pid, signal.SIGUSR1)  # reset the service's figures
            time.sleep(0.5)
            svc_cpu0, cpu0 = proc_cpu_s(svc.pid), time.process_time()
            save_s = []
            stored = 0
            for step, st in ckpts:
                t0 = time.perf_counter()
                info = client.save(name, step, st)
                save_s.append(time.perf_counter() - t0)
                stored += info.stored_bytes
            client_cpu = time.process_time() - cpu0
            svc_cpu = proc_cpu_s(svc.pid) - svc_cpu0
            os.kill(svc.pid, signal.SIGUSR2)
            service = _wait_for(prof)
    finally:
        for fname, fn in originals.items():
            setattr(state_mod, fname, fn)
        svc.stop()
    logged = [m.groupdict() for m in _SAVED.finditer(svc.log.read_text()) if m["run"] == name]
    raw = sum(raw_bytes(s) for _, s in ckpts)
    shutil.rmtree(data_dir, ignore_errors=True)
    return {
        "raw_bytes": raw,
        "stored_bytes": stored,
        "save_s": sum(save_s),
        "save_s_per_ckpt": save_s,
        "save_mb_s": raw / sum(save_s) / MB,
        "client_cpu_s": client_cpu,
        "service_cpu_s": svc_cpu,
        "client": dict(spent),
        "service_log": {
            k: sum(float(x[k]) for x in logged)
            for k in ("total", "body", "tail", "finish", "commit")
        },
        "service": service,
        "loadavg_1m": os.getloadavg()[0],
    }


class _ProfiledService:
    """support.serviceproc.Service, but this file's instrumented service as the process."""

    def __new__(cls, data_dir: Path, env: dict[str, str]) -> Any:
        from support.serviceproc import Service

        class Profiled(Service):
            program = (sys.executable, __file__, "--serve")

            def start(self, timeout: float = 120.0) -> Service:
                return super().start(timeout)

        return Profiled(data_dir, env)


def torch_zstd_s(ckpts: list[tuple[int, Any]]) -> float:
    """Wall seconds of bench.py's baseline on the same states: torch.save into memory,
    then zstd level 3 in one thread."""
    import io

    import torch
    import zstandard

    cctx = zstandard.ZstdCompressor(level=3)
    total = 0.0
    for _, state in ckpts:
        t0 = time.perf_counter()
        buf = io.BytesIO()
        torch.save(state, buf)
        cctx.compress(buf.getbuffer())
        total += time.perf_counter() - t0
    return total


def in_process(name: str, ckpts: list[tuple[int, Any]], workdir: Path) -> dict[str, Any]:
    """The service's save path alone (``Saver.ingest`` in this process, uninstrumented, the
    bench's settings): no HTTP, no client, each body built in memory first in the client's
    own pieces. Its wall and this process's CPU over the saves are what a save costs
    with no transport at all: the ceiling for any receive path. The ingest thread (this
    one) is timed apart: the rest of the CPU is the codec and blob writer threads'."""
    from ckptstore import state as state_mod
    from ckptstore.client import save_body
    from ckptstore_core.wire import FORMAT, encode_header
    from ckptstore_service.runtime import Runtime
    from ckptstore_service.settings import Settings

    depth = max(16, len(ckpts) + 1)
    settings = Settings(
        data_dir=workdir / f"{name}-in-process", keyframe_interval=depth, max_chain_depth=depth
    )
    rt = Runtime.open(settings)
    wall = cpu = ingest = 0.0
    raw = 0
    try:
        for step, state in ckpts:
            flat = state_mod.flatten(state)
            ordered = state_mod.upload_order(flat.tensors)
            specs = [(n, state_mod.dtype_to_wire(t.dtype), tuple(t.shape)) for n, t in ordered]
            prefix, header = encode_header(specs, {"format": FORMAT, "skeleton": flat.skeleton})
            body = list(save_body(prefix, (t for _, t in ordered)))
            c0, t0, i0 = time.process_time(), time.perf_counter(), time.thread_time()
            rt.saver.ingest(name, step, iter(body), header.total_len)
            ingest += time.thread_time() - i0
            wall += time.perf_counter() - t0
            cpu += time.process_time() - c0
            raw += header.total_len
    finally:
        rt.close()
    return {"wall_s": wall, "cpu_s": cpu, "ingest_cpu_s": ingest, "raw_bytes": raw}


def stage_table(r: dict[str, Any]) -> list[tuple[str, float]]:
    """Service CPU seconds per stage (byte-plane splits of samples apart from full chunks),
    plus each thread's CPU that no stage claims."""
    stages: Counter[str] = Counter()
    claimed: Counter[str] = Counter()
    for thread, stage, v in r["service"]["stages"]:
        if stage.startswith("byte planes ("):
            n = int(stage.split("(")[1].split()[0])
            stage = "choose on sample: planes" if n <= 2 * 8192 else "byte planes (full chunk)"
        stages[stage] += v
        claimed[_thread_group(thread)] += v
    threads: Counter[str] = Counter()
    for thread, v in r["service"]["threads"].items():
        threads[_thread_group(thread)] += v
    for group, v in threads.items():
        rest = v - claimed.get(group, 0.0)
        if group == "event loop":
            stages["receive (event loop)"] += rest
        elif rest > 0.005:
            stages[f"other ({group})"] += rest
    return sorted(stages.items(), key=lambda kv: -kv[1])


def _thread_group(name: str) -> str:
    if name == "MainThread":
        return "event loop"
    if name.startswith("ckptstore-codec"):
        return "codec threads"
    if name.startswith("AnyIO worker"):
        return "ingest thread"
    if name.startswith("Thread-") and "_run" in name:
        return "blob writer"
    return name.split("_")[0]


def report(name: str, r: dict[str, Any]) -> None:
    gb = r["raw_bytes"] / 1e9
    print(
        f"\n{name}: {r['raw_bytes'] / MB:.0f} MB raw -> {r['stored_bytes'] / MB:.1f} MB stored; "
        f"saves {r['save_s']:.2f} s wall ({r['save_mb_s']:.0f} MB/s, load average "
        f"{r['loadavg_1m']:.1f}); CPU: client {r['client_cpu_s']:.2f} s, service "
        f"{r['service_cpu_s']:.2f} s ({(r['client_cpu_s'] + r['service_cpu_s']) / gb:.2f} "
        "core-s/GB)"
    )
    c, s = r["client"], r["service_log"]
    z = r["torch_zstd3_s"]
    print(
        f"  torch.save+zstd3 of the same states: {z:.2f} s; ckptstore saves "
        f"{z / r['save_s']:.2f}x its speed"
    )
    print(
        f"  wall: client flatten {c.get('flatten', 0):.3f} s + param names "
        f"{c.get('param_names', 0):.3f} s; service (its log) {s['total']:.2f} s = body "
        f"{s['body']:.2f} + encode tail {s['tail']:.2f} + blob finish (fsync) "
        f"{s['finish']:.2f} + commit {s['commit']:.2f}; the rest (client send before the "
        f"body's first byte, lock, answer) {r['save_s'] - s['total'] - c.get('flatten', 0):.2f} s"
    )
    if "in_process" in r:
        ip = r["in_process"]
        print(
            f"  the save path alone, in process (no HTTP, no client): {ip['wall_s']:.2f} s "
            f"wall ({z / ip['wall_s']:.2f}x torch.save+zstd3), {ip['cpu_s']:.2f} s CPU "
            f"({ip['cpu_s'] / (ip['raw_bytes'] / 1e9):.2f} core-s/GB; on 2 cores kept busy "
            f"throughout, {ip['cpu_s'] / 2:.2f} s: {z / (ip['cpu_s'] / 2):.2f}x); the ingest "
            f"thread (parse, copy, hashes, plan, rows, commit) {ip['ingest_cpu_s']:.2f} s of "
            f"it, the codec and blob threads {ip['cpu_s'] - ip['ingest_cpu_s']:.2f} s; "
            f"{ip['cpu_s'] / ip['wall_s']:.2f} of the 2 cores in use"
        )
    table = stage_table(r)
    total = sum(v for _, v in table)
    print(f"  service CPU by stage (thread-seconds; {total / gb:.2f} core-s/GB):")
    for stage, v in table:
        print(f"    {stage:<30} {v:6.3f} s  {100 * v / total:5.1f}%  {v / gb:5.2f} s/GB")


def checkpoints(name: str, quick: bool, n: int, every: int, cache: Path) -> list[tuple[int, Any]]:
    """The run's checkpoints, trained once and kept in ``cache``."""
    import torch

    import models
    from bench import log

    path = cache / f"{name}-{'quick' if quick else 'full'}-{n}-{every}.pt"
    if path.exists():
        return list(torch.load(path, weights_only=False))
    size = models.SIZES["quick" if quick else "full"]
    res = models.RUNS[name](size, n, every, log)
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(res.checkpoints, path)
    return list(res.checkpoints)


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        sys.exit(_serve(sys.argv[2:]))
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "bench"))
    import torch

    import models
    from bench import log

    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--runs", nargs="+", choices=list(models.RUNS), default=list(models.RUNS))
    p.add_argument("--checkpoints", type=int, default=None, help="per run (default 9; quick 8)")
    p.add_argument("--every", type=int, default=25)
    p.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "ckptstore-profile-cache"
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument(
        "--in-process",
        action="store_true",
        help="also the save path alone in this process (no HTTP, no client)",
    )
    args = p.parse_args()
    torch.set_num_threads(2)
    n = args.checkpoints or (8 if args.quick else 9)
    results = {}
    workdir = Path(tempfile.mkdtemp(prefix="ckptstore-profile-"))
    try:
        for name in args.runs:
            log(f"{name}: checkpoints")
            ckpts = checkpoints(name, args.quick, n, args.every, args.cache)
            log(f"{name}: saves")
            results[name] = profile_run(name, ckpts, workdir)
            results[name]["torch_zstd3_s"] = torch_zstd_s(ckpts)
            if args.in_process:
                results[name]["in_process"] = in_process(name, ckpts, workdir)
            report(name, results[name])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
