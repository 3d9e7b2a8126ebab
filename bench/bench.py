"""ckptstore against torch.save + zstd and zipnn, on the same real training checkpoints.

    .venv/bin/python bench/bench.py [--quick] [--out bench/out]

For each training run (bench/models.py: a GPT from scratch in fp32, the same GPT in bf16 with
an fp32 master copy, and a BERT-like encoder fine-tuned after a self-made pretraining), the
checkpoints are first collected in memory (deep copies, training time not counted). Then every
method stores the very same states, in order, and loads some back:

ckptstore
    the real service in a child process (fresh data dir, keyframe interval and max chain depth
    above the number of checkpoints, so they form one chain); ``CheckpointClient.save`` per
    checkpoint, timed. Stored bytes: the sum of ``stored_bytes`` the service reports,
    cross-checked against the blob folder on disk. ``load latest``: the newest checkpoint, warm
    (the service serves it from its base cache). ``load deep``: the checkpoint with the deepest
    chain on a fresh replica (a restart with the base cache folder emptied: a restarted process
    would take back the latest's file, so every chunk is decoded from storage along its chain
    only without it; bench/resume_restart.py measures that case); the same for the first
    checkpoint and the one halfway (what each link of a chain costs; each prints its depth). The
    last saves set off a re-root in the background (the newest checkpoint is 8 deep, 9 with the
    bf16 copies' link: the chain's full checkpoint moves to its middle, once the run has gone 1
    s without a save, so the first checkpoint ends 4-5 deep and the halfway one is the root);
    the bench waits for it, reports its time apart, and measures the loads and the stored bytes
    after it. ``load every step``: each checkpoint loaded in order on a fresh replica (cold: a
    restart, the base cache folder emptied, nothing decoded kept), then the same loop again
    (warm), best of ``--repeats`` such sweeps (each step bit-exact). Peak service memory: VmHWM
    minus VmRSS before the first save (peak reset just before); likewise for the cold load.
torch.save+zstd3
    ``torch.save`` into a BytesIO, then zstd level 3 (one thread; and a 2-thread variant);
    load = decompress + ``torch.load(weights_only=False)``, of every checkpoint (the last one's
    is "latest" and "deep"). Kept in memory: no disk writes.
zipnn
    zipnn 0.5.4 per floating tensor of at least 1 KiB (byte mode, dtype given; it mutates its
    input, so it gets a copy, which is timed as the tensor-to-bytes step); everything else
    (small tensors, ints, RNG state, non-tensor leaves) via torch.save + zstd3. Load =
    decompress every tensor + rebuild the nested state.

Each baseline checkpoint is an independent blob, so its "latest" and "deep" loads are the same
operation (the last checkpoint) and are measured once. Every load is checked bit for bit
against the state that was saved. Throughputs are raw tensor bytes per wall second, MB = 1e6.
Timings on a shared machine drift, so every method is measured in two passes (``--passes``):
all methods once, then all of them again, and each keeps its fastest save sequence and its
fastest loads (every pass's totals are in the JSON). Loads are timed best of 3 per pass
(``--repeats``). A per-part breakdown (model, master, exp_avg,
exp_avg_sq, other) compares ckptstore (read from its SQLite catalog) with zipnn.

Output: a table, a "targets" section (PASS/FAIL with figures), bench/out/results.json (all
figures, per-checkpoint sizes, machine info, load averages) and bench/out/stored_bytes.png.
The script reports; it never fails on a missed target (exit status 0). About 11 minutes on two
idle cores, with the sweeps over every step (~2.1 GB peak memory); ``--quick`` (tiny models,
one pass) about 45 seconds.
Other work on the machine skews the timings; the load average is recorded next to them.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# torch's OpenMP threads spin-wait by default: with other work on the cores, training the
# bench's models ran about 20x slower (seen on this project's shared 2-core machine); it
# must be set before torch is imported
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
import zstandard

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import models  # noqa: E402
from ckptstore import CheckpointClient  # noqa: E402
from support.serviceproc import Service, forget_cache, wait_idle  # noqa: E402

MB = 1e6
ZSTD1 = "torch.save+zstd3"
ZSTD2 = "torch.save+zstd3 (2 thr)"
ZSTDF = "torch.save+zstd3 to file"
ZIPNN = "zipnn"
CKPT = "ckptstore"
METHODS = [CKPT, ZSTD1, ZSTD2, ZSTDF, ZIPNN]
ZIPNN_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
ZIPNN_MIN_BYTES = 1024

State = Any
Checkpoints = list[tuple[int, State]]

_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


# -- helpers ------------------------------------------------------------------------------


def group(name: str) -> str:
    """The part of the state a tensor belongs to, from its key path (ckptstore's or ours)."""
    name = name.lstrip("/")
    if name.startswith(("model/", "master/")):
        return name.split("/", 1)[0]
    if name.startswith("optimizer/") and name.endswith(("/exp_avg", "/exp_avg_sq")):
        return name.rsplit("/", 1)[1]
    return "other"


GROUPS = ["model", "master", "exp_avg", "exp_avg_sq", "other"]


def tensors(obj: object) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from tensors(v)


def raw_bytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(state))


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's raw bytes as a uint8 array (a view when it is contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def mismatch(a: object, b: object, path: str = "") -> str | None:
    """Where ``b`` differs from ``a`` (types, keys, tensor dtype/shape/bits), or None."""
    if type(a) is not type(b):
        return f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        return None if np.array_equal(as_bytes(a), as_bytes(b)) else f"{path}: bits differ"
    if isinstance(a, dict):
        assert isinstance(b, dict)
        if list(a) != list(b):
            return f"{path}: keys {list(a)[:5]} != {list(b)[:5]}"
        for k in a:
            found = mismatch(a[k], b[k], f"{path}/{k!r}")
            if found:
                return found
        return None
    if isinstance(a, list | tuple):
        assert isinstance(b, list | tuple)
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = mismatch(x, y, f"{path}/{i}")
            if found:
                return found
        return None
    return None if a == b else f"{path}: {a!r} != {b!r}"


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def proc_stat(pid: int, tid: int | None = None) -> tuple[float, int]:
    """user + system CPU seconds and minor page faults of a process (all its threads), or of
    its thread ``tid``."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])


def proc_cpu_s(pid: int) -> float:
    """user + system CPU seconds of a process (all its threads)."""
    return proc_stat(pid)[0]


def best_of(repeats: int, fn: Callable[[], State]) -> tuple[float, State]:
    """The shortest wall time of ``repeats`` calls, and the last call's result."""
    best, out = float("inf"), None
    for _ in range(repeats):
        out = None
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


EVERY_STEP = ("load_every_s", "load_every_cold_s", "load_every_warm_s")


def every_step(
    ckpts: Checkpoints, repeats: int, load: Callable[[int], State]
) -> tuple[list[float], str | None]:
    """Each checkpoint's best load time of ``repeats`` (``load(i)``: the i-th checkpoint),
    and the first mismatch against the state saved (None: all bit-exact)."""
    times, wrong = [], None
    for i, (_, state) in enumerate(ckpts):
        s, back = best_of(repeats, lambda i=i: load(i))
        times.append(s)
        wrong = wrong or mismatch(state, back)
        del back
    return times, wrong


def measure(
    method: str, run: str, ckpts: Checkpoints, workdir: Path, repeats: int
) -> dict[str, Any]:
    if method == CKPT:
        return bench_ckptstore(run, ckpts, workdir, repeats)
    if method == ZSTD1:
        return bench_zstd(ckpts, 1, repeats)
    if method == ZSTD2:
        return bench_zstd(ckpts, 2, repeats)
    if method == ZSTDF:
        durable = workdir / f"{run}-zstd"
        durable.mkdir(parents=True, exist_ok=True)
        try:
            return bench_zstd(ckpts, 1, repeats, durable)
        finally:
            shutil.rmtree(durable, ignore_errors=True)
    return bench_zipnn(ckpts, repeats)


def best_pass(tries: list[dict[str, Any]]) -> dict[str, Any]:
    """The pass with the fastest saves, with the fastest loads of any pass; every pass's
    totals are kept alongside."""
    best = dict(min(tries, key=lambda m: m["save_s"]))
    for key in ("load_latest", "load_deep"):
        fastest = min(tries, key=lambda m: m[f"{key}_s"])
        best[f"{key}_s"], best[f"{key}_mb_s"] = fastest[f"{key}_s"], fastest[f"{key}_mb_s"]
    if "cold_load_by_depth" in best:
        best["cold_load_by_depth"] = [
            min(loads, key=lambda x: x["s"])
            for loads in zip(*(m["cold_load_by_depth"] for m in tries), strict=True)
        ]
    for key in EVERY_STEP:  # each step's fastest load of any pass
        if key in best:
            best[key] = [min(times) for times in zip(*(m[key] for m in tries), strict=True)]
    best["passes"] = [
        {k: m[k] for k in ("save_s", "load_latest_s", "load_deep_s", "loadavg_1m_after")}
        for m in tries
    ]
    return best


def summary(
    ckpts: Checkpoints,
    stored: list[int],
    save_s: list[float],
    save_cpu_s: float,
    load_latest_s: float,
    load_deep_s: float,
    deep_step: int,
    verified: str | None,
    **extra: Any,
) -> dict[str, Any]:
    raw = [raw_bytes(s) for _, s in ckpts]
    raw_at = dict(zip([st for st, _ in ckpts], raw, strict=True))
    return {
        "stored_bytes": sum(stored),
        "stored_per_ckpt": stored,
        "ratio": sum(raw) / sum(stored),
        "save_s": sum(save_s),
        "save_s_per_ckpt": save_s,
        "save_mb_s": sum(raw) / sum(save_s) / MB,
        "save_cpu_s": save_cpu_s,
        "load_latest_s": load_latest_s,
        "load_latest_mb_s": raw[-1] / load_latest_s / MB,
        "load_deep_s": load_deep_s,
        "load_deep_mb_s": raw_at[deep_step] / load_deep_s / MB,
        "deep_step": deep_step,
        "verified": verified or "bit-exact",
        **extra,
    }


# -- methods ------------------------------------------------------------------------------


def bench_zstd(
    ckpts: Checkpoints, threads: int, repeats: int, durable: Path | None = None
) -> dict[str, Any]:
    """``durable``: also write each compressed checkpoint to a file there and fsync it, as a
    real checkpoint must be (ckptstore's save figures include its durable writes)."""
    # zstandard: threads=0 compresses in the calling thread, threads=N uses N worker threads
    cctx = zstandard.ZstdCompressor(level=3, threads=threads if threads > 1 else 0)
    dctx = zstandard.ZstdDecompressor()
    blobs: list[bytes] = []
    save_s: list[float] = []
    serialize_s = 0.0
    cpu0 = time.process_time()
    for _, state in ckpts:
        t0 = time.perf_counter()
        buf = io.BytesIO()
        torch.save(state, buf)
        t1 = time.perf_counter()
        blobs.append(cctx.compress(buf.getbuffer()))
        del buf
        if durable is not None:
            with open(durable / f"ckpt-{len(blobs)}.pt.zst", "wb") as f:
                f.write(blobs[-1])
                f.flush()
                os.fsync(f.fileno())
        save_s.append(time.perf_counter() - t0)
        serialize_s += t1 - t0
    cpu = time.process_time() - cpu0

    def load(blob: bytes) -> State:
        return torch.load(io.BytesIO(dctx.decompress(blob)), weights_only=False)

    load_every_s, verified = every_step(ckpts, repeats, lambda i: load(blobs[i]))
    load_s = load_every_s[-1]
    return summary(
        ckpts,
        [len(b) for b in blobs],
        save_s,
        cpu,
        load_s,
        load_s,
        ckpts[-1][0],
        verified,
        torch_save_s=serialize_s,
        zstd_threads=threads,
        load_every_s=load_every_s,
    )


class _Slot(str):
    """Marks where a zipnn-compressed tensor sat in the pickled skeleton."""


def _split(obj: object, out: list[tuple[str, torch.Tensor]], path: str = "") -> object:
    """``obj`` with each tensor for zipnn replaced by a slot; ``out`` gets (path, tensor)."""
    if isinstance(obj, torch.Tensor):
        if obj.dtype in ZIPNN_DTYPES and obj.numel() * obj.element_size() >= ZIPNN_MIN_BYTES:
            out.append((path, obj))
            return _Slot(len(out) - 1)
        return obj
    if isinstance(obj, dict):
        return _like(obj, ((k, _split(v, out, f"{path}/{k}")) for k, v in obj.items()))
    if isinstance(obj, list | tuple):
        return type(obj)(_split(v, out, f"{path}/{i}") for i, v in enumerate(obj))
    return obj


def _like(obj: dict[Any, Any], items: Iterator[tuple[Any, Any]]) -> dict[Any, Any]:
    """A dict of ``obj``'s type with ``items``, keeping a state_dict's ``_metadata``."""
    new = type(obj)(items)
    if hasattr(obj, "_metadata"):
        new._metadata = obj._metadata  # type: ignore[attr-defined]
    return new


def _join(obj: object, values: list[torch.Tensor]) -> object:
    if isinstance(obj, _Slot):
        return values[int(obj)]
    if isinstance(obj, dict):
        return _like(obj, ((k, _join(v, values)) for k, v in obj.items()))
    if isinstance(obj, list | tuple):
        return type(obj)(_join(v, values) for v in obj)
    return obj


def bench_zipnn(ckpts: Checkpoints, repeats: int) -> dict[str, Any]:
    from zipnn import ZipNN

    codecs = {
        dt: ZipNN(input_format="byte", bytearray_dtype=name) for dt, name in ZIPNN_DTYPES.items()
    }
    cctx = zstandard.ZstdCompressor(level=3)
    dctx = zstandard.ZstdDecompressor()
    saved: list[tuple[bytes, list[tuple[torch.dtype, tuple[int, ...], bytes]]]] = []
    stored: list[int] = []
    by_group: dict[str, dict[str, int]] = {}
    save_s: list[float] = []
    rest_bytes = 0
    cpu0 = time.process_time()
    for _, state in ckpts:
        t0 = time.perf_counter()
        big: list[tuple[str, torch.Tensor]] = []
        skeleton = _split(state, big)
        # zipnn 0.5.4 scrambles the buffer it is given: hand it a copy
        comp = [
            (t.dtype, tuple(t.shape), codecs[t.dtype].compress(bytearray(as_bytes(t))))
            for _, t in big
        ]
        buf = io.BytesIO()
        torch.save(skeleton, buf)
        rest = cctx.compress(buf.getbuffer())
        save_s.append(time.perf_counter() - t0)
        saved.append((rest, comp))
        stored.append(len(rest) + sum(len(c) for _, _, c in comp))
        rest_bytes += len(rest)
        for (name, t), (_, _, c) in zip(big, comp, strict=True):
            g = by_group.setdefault(group(name), {"raw": 0, "stored": 0})
            g["raw"] += t.numel() * t.element_size()
            g["stored"] += len(c)
        small = raw_bytes(state) - sum(t.numel() * t.element_size() for _, t in big)
        g = by_group.setdefault("other", {"raw": 0, "stored": 0})
        g["raw"] += small
        g["stored"] += len(rest)
    cpu = time.process_time() - cpu0

    rest, comp = saved[-1]

    def load() -> State:
        values = [
            torch.frombuffer(codecs[dt].decompress(c), dtype=dt).reshape(shape)
            for dt, shape, c in comp
        ]
        skeleton = torch.load(io.BytesIO(dctx.decompress(rest)), weights_only=False)
        return _join(skeleton, values)

    load_s, back = best_of(repeats, load)
    verified = mismatch(ckpts[-1][1], back)
    del back, saved
    return summary(
        ckpts,
        stored,
        save_s,
        cpu,
        load_s,
        load_s,
        ckpts[-1][0],
        verified,
        non_tensor_zstd_bytes=rest_bytes,
        groups=by_group,
        zipnn_version=importlib.metadata.version("zipnn"),
        zipnn_threads=codecs[torch.float32].threads,
    )


def bench_ckptstore(run: str, ckpts: Checkpoints, workdir: Path, repeats: int) -> dict[str, Any]:
    data_dir = workdir / run
    depth = max(16, len(ckpts) + 1)
    env = {
        "CKPTSTORE_KEYFRAME_INTERVAL": str(depth),
        "CKPTSTORE_MAX_CHAIN_DEPTH": str(depth),
        # the blobs a re-root replaces go at once (no load reads them): the blob folder
        # then holds exactly what the catalog reports
        "CKPTSTORE_GARBAGE_GRACE_S": "0",
    }
    svc = Service(data_dir, env).start()
    try:
        with CheckpointClient(svc.url, timeout=600) as client:
            baseline = svc.rss_bytes()
            svc.reset_peak_rss()
            svc_cpu0, cpu0 = proc_cpu_s(svc.pid), time.process_time()
            infos, save_s = [], []
            for step, state in ckpts:
                t0 = time.perf_counter()
                infos.append(client.save(run, step, state))
                save_s.append(time.perf_counter() - t0)
            save_cpu = time.process_time() - cpu0
            svc_cpu = proc_cpu_s(svc.pid) - svc_cpu0
            peak_save = svc.rss_bytes("VmHWM") - baseline
            # the re-root that the last save may have set off, in the background: its wall
            # and CPU time, apart from the saves' (a trainer would be training meanwhile)
            t0 = time.perf_counter()
            wait_idle(svc.url, timeout=600)
            reroot_s = time.perf_counter() - t0
            reroot_cpu = proc_cpu_s(svc.pid) - svc_cpu0 - svc_cpu
            peak_save = max(peak_save, svc.rss_bytes("VmHWM") - baseline)
            listing = client.list(run)
            latest_s, back = best_of(repeats, lambda: client.load(run, "latest"))
            verified_latest = mismatch(ckpts[-1][1], back)
            del back
    finally:
        svc.stop()

    def cold_load(step: int) -> tuple[float, int, str | None]:
        """Best wall time, peak service memory growth and any mismatch of loading ``step``
        on a fresh replica (restarted, its base cache emptied), so every chunk is decoded
        from storage along its chain."""
        best, peak, wrong = float("inf"), 0, None
        for _ in range(repeats):
            forget_cache(data_dir)
            svc = Service(data_dir, env).start()
            try:
                with CheckpointClient(svc.url, timeout=600) as client:
                    baseline_load = svc.rss_bytes()
                    svc.reset_peak_rss()
                    gc.collect()
                    t0 = time.perf_counter()
                    back = client.load(run, step)
                    best = min(best, time.perf_counter() - t0)
                    peak = max(peak, svc.rss_bytes("VmHWM") - baseline_load)
                    wrong = wrong or mismatch(dict(ckpts)[step], back)
                    del back
            finally:
                svc.stop()
        return best, peak, wrong

    deep = max(listing, key=lambda c: (c.chain_depth, c.step))
    deep_s, peak_load, verified_deep = cold_load(deep.step)
    # the same for the first checkpoint (the keyframe) and one halfway: what each link costs
    by_depth = []
    for shallow in (listing[0], listing[len(listing) // 2]):
        s, _, wrong = cold_load(shallow.step)
        verified_deep = verified_deep or wrong
        raw = raw_bytes(dict(ckpts)[shallow.step])
        by_depth.append(
            {"depth": shallow.chain_depth, "step": shallow.step, "s": s, "mb_s": raw / s / MB}
        )

    every_cold, every_warm, peak_sweep, wrong = sweeps(run, ckpts, data_dir, env, repeats)
    verified_deep = verified_deep or wrong

    groups = catalog_breakdown(data_dir / "catalog.sqlite3")
    blob_dir = dir_bytes(data_dir / "blobs")
    catalog = dir_bytes(data_dir) - blob_dir - dir_bytes(data_dir / "cache")
    catalog -= sum(p.stat().st_size for p in data_dir.glob("service-*.log"))
    shutil.rmtree(data_dir, ignore_errors=True)
    verified = verified_latest or verified_deep
    return summary(
        ckpts,
        [i.stored_bytes for i in listing],
        save_s,
        save_cpu + svc_cpu,
        latest_s,
        deep_s,
        deep.step,
        verified,
        client_cpu_s=save_cpu,
        service_cpu_s=svc_cpu,
        peak_service_mem_bytes=peak_save,
        peak_service_mem_load_bytes=peak_load,
        service_rss_before_bytes=baseline,
        blob_dir_bytes=blob_dir,
        catalog_bytes=catalog,
        deep_chain_depth=deep.chain_depth,
        stored_before_reroot=sum(i.stored_bytes for i in infos),
        reroot_wait_s=reroot_s,
        reroot_service_cpu_s=reroot_cpu,
        cold_load_by_depth=by_depth,
        load_every_cold_s=every_cold,
        load_every_warm_s=every_warm,
        peak_service_mem_sweep_bytes=peak_sweep,
        chain=[
            {
                "step": c.step,
                "parent": c.parent_step,
                "keyframe": c.keyframe,
                "depth": c.chain_depth,
                "stored": c.stored_bytes,
            }
            for c in listing
        ],
        groups=groups,
        keyframe_interval=depth,
        max_chain_depth=depth,
    )


def sweeps(
    run: str, ckpts: Checkpoints, data_dir: Path, env: dict[str, str], repeats: int
) -> tuple[list[float], list[float], int, str | None]:
    """Every step loaded in order on a fresh replica (cold: a restart with the base cache
    emptied, nothing decoded kept), then again on the same replica (warm); each step's best
    time of ``repeats`` such sweeps, the service's peak memory growth over a sweep, and the
    first mismatch (None: all bit-exact)."""
    cold = [float("inf")] * len(ckpts)
    warm = list(cold)
    peak, wrong = 0, None
    for _ in range(repeats):
        forget_cache(data_dir)
        svc = Service(data_dir, env).start()
        try:
            with CheckpointClient(svc.url, timeout=600) as client:
                baseline = svc.rss_bytes()
                svc.reset_peak_rss()
                for times in (cold, warm):
                    for i, (step, state) in enumerate(ckpts):
                        gc.collect()
                        t0 = time.perf_counter()
                        back = client.load(run, step)
                        times[i] = min(times[i], time.perf_counter() - t0)
                        wrong = wrong or mismatch(state, back)
                        del back
                peak = max(peak, svc.rss_bytes("VmHWM") - baseline)
        finally:
            svc.stop()
    return cold, warm, peak, wrong


def catalog_breakdown(db: Path) -> dict[str, dict[str, Any]]:
    """Raw and stored bytes per part of the state (keyframes apart), and the codecs chosen,
    read straight from the service's SQLite catalog (diagnostics only: {} if that fails)."""
    import sqlite3

    try:
        con = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
        try:
            rows = con.execute(
                "SELECT c.keyframe, t.name, ch.raw_len, ch.stored_len, ch.codec "
                "FROM chunks ch JOIN checkpoints c ON c.id = ch.checkpoint_id "
                "JOIN tensors t ON t.checkpoint_id = ch.checkpoint_id AND t.idx = ch.tensor_idx "
                "WHERE c.status = 'committed'"
            ).fetchall()
        finally:
            con.close()
    except sqlite3.Error as exc:
        log(f"  (no per-group breakdown: {exc})")
        return {}
    out: dict[str, dict[str, Any]] = {}
    for keyframe, name, raw, stored, codec in rows:
        g = out.setdefault(
            group(name),
            {"raw": 0, "stored": 0, "raw_delta": 0, "stored_delta": 0, "codecs": {}},
        )
        g["raw"] += raw
        g["stored"] += stored
        if not keyframe:
            g["raw_delta"] += raw
            g["stored_delta"] += stored
            g["codecs"][codec] = g["codecs"].get(codec, 0) + 1
    return out


# -- report -------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    cpu = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = Path("/proc/meminfo").read_text().split("\n", 1)[0].split()[1]
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    versions = {}
    for dist in ("ckptstore", "zipnn", "matplotlib", "httpx"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return {
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "mem_total_bytes": int(mem) * 1024,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "numpy": np.__version__,
        "zstandard": zstandard.__version__,
        **versions,
        "git": commit,
        "loadavg_start": os.getloadavg(),
    }


HEAD = (
    f"{'run':<17} {'method':<24} {'raw MB':>8} {'stored MB':>9} {'ratio':>6} "
    f"{'save MB/s':>9} {'save s':>7} {'load latest':>11} {'load deep':>9} {'peak svc':>8}"
)


def row(run: str, method: str, raw: int, m: dict[str, Any]) -> str:
    peak = m.get("peak_service_mem_bytes")
    peak_s = f"{peak / MB:6.0f}MB" if peak is not None else f"{'-':>8}"
    ok = "" if m["verified"] == "bit-exact" else f"  NOT BIT-EXACT: {m['verified']}"
    return (
        f"{run:<17} {method:<24} {raw / MB:8.1f} {m['stored_bytes'] / MB:9.2f} "
        f"{m['ratio']:6.2f} {m['save_mb_s']:9.1f} {m['save_s']:7.2f} "
        f"{m['load_latest_mb_s']:7.0f}MB/s {m['load_deep_mb_s']:5.0f}MB/s {peak_s}{ok}"
    )


def targets(runs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []

    def check(name: str, ok: bool, figures: str) -> None:
        out.append({"target": name, "pass": ok, "figures": figures})

    for run, r in runs.items():
        m = r["methods"]
        c, z, zn = m[CKPT], m[ZSTD1], m[ZIPNN]
        check(
            f"{run}: ckptstore stored < zipnn",
            c["stored_bytes"] < zn["stored_bytes"],
            f"{c['stored_bytes'] / MB:.2f} MB vs {zn['stored_bytes'] / MB:.2f} MB "
            f"({zn['stored_bytes'] / c['stored_bytes']:.2f}x fewer)",
        )
        check(
            f"{run}: ckptstore stored < torch.save+zstd3",
            c["stored_bytes"] < z["stored_bytes"],
            f"{c['stored_bytes'] / MB:.2f} MB vs {z['stored_bytes'] / MB:.2f} MB "
            f"({z['stored_bytes'] / c['stored_bytes']:.2f}x fewer)",
        )
        if run == "finetune-fp32":
            gain = z["stored_bytes"] / c["stored_bytes"]
            check(
                f"{run}: ckptstore >= 1.5x fewer bytes than torch.save+zstd3",
                gain >= 1.5,
                f"{gain:.2f}x",
            )
        check(
            f"{run}: ckptstore save wall <= torch.save+zstd3 (1 thread)",
            c["save_s"] <= z["save_s"],
            f"{c['save_s']:.2f} s vs {z['save_s']:.2f} s "
            f"({c['save_mb_s']:.0f} vs {z['save_mb_s']:.0f} MB/s)",
        )
        check(
            f"{run}: ckptstore save >= 2x as fast as torch.save+zstd3 (1 thread)",
            2 * c["save_s"] <= z["save_s"],
            f"{z['save_s'] / c['save_s']:.2f}x ({c['save_s']:.2f} s vs {z['save_s']:.2f} s)",
        )
        zf = m[ZSTDF]
        check(
            f"{run}: ckptstore save wall <= torch.save+zstd3 written to a file and fsynced",
            c["save_s"] <= zf["save_s"],
            f"{c['save_s']:.2f} s vs {zf['save_s']:.2f} s "
            f"({c['save_mb_s']:.0f} vs {zf['save_mb_s']:.0f} MB/s)",
        )
        check(
            f"{run}: ckptstore load latest >= zstd decompress + torch.load",
            c["load_latest_mb_s"] >= z["load_latest_mb_s"],
            f"{c['load_latest_mb_s']:.0f} vs {z['load_latest_mb_s']:.0f} MB/s",
        )
        check(
            f"{run}: ckptstore load deep (cold cache, depth {c['deep_chain_depth']}) "
            ">= half of zstd decompress + torch.load",
            c["load_deep_mb_s"] >= 0.5 * z["load_latest_mb_s"],
            f"{c['load_deep_mb_s']:.0f} vs {0.5 * z['load_latest_mb_s']:.0f} MB/s "
            f"(half of {z['load_latest_mb_s']:.0f})",
        )
        for kind in ("cold", "warm"):
            ratios = every_step_ratios(c, z, kind)
            worst = min(ratios, key=lambda x: x[1])
            check(
                f"{run}: ckptstore load of every step ({kind} replica) >= 2x zstd decompress "
                "+ torch.load",
                worst[1] >= 2.0,
                f"worst step {worst[0]}: {worst[1]:.2f}x; all "
                + " ".join(f"{r:.2f}" for _, r in ratios),
            )
        check(
            f"{run}: ckptstore load latest >= 1.5 GB/s",
            c["load_latest_mb_s"] >= 1500,
            f"{c['load_latest_mb_s']:.0f} MB/s",
        )
    return out


def every_step_ratios(c: dict[str, Any], z: dict[str, Any], kind: str) -> list[tuple[int, float]]:
    """(step, how many times faster ckptstore loads it than zstd + torch.load), per step."""
    return [
        (x["step"], zs / cs)
        for x, zs, cs in zip(c["chain"], z["load_every_s"], c[f"load_every_{kind}_s"], strict=True)
    ]


def _ratio(raw: int, stored: int) -> str:
    return f"{raw / stored:.2f}x" if stored else "-"


def plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4.2), squeeze=False)
    for ax, (run, r) in zip(axes[0], runs.items(), strict=True):
        steps = r["steps"]
        ax.plot(steps, [b / MB for b in r["raw_per_ckpt"]], "k--", label="raw tensors")
        for method in METHODS:
            m = r["methods"][method]
            # the two zstd variants store the same bytes: dash one so both show
            style = {"ls": "--", "marker": "x"} if method == ZSTD2 else {"marker": "o"}
            ax.plot(steps, [b / MB for b in m["stored_per_ckpt"]], ms=3, label=method, **style)
        values = [b for m in r["methods"].values() for b in m["stored_per_ckpt"]]
        if max(r["raw_per_ckpt"]) / min(values) > 4:  # log only where the spread needs it
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        ax.set_title(f"{run} ({r['params'] / 1e6:.1f}M params)")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("stored MB per checkpoint")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main ---------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="small models: a smoke run")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    p.add_argument("--runs", nargs="+", choices=list(models.RUNS), default=list(models.RUNS))
    p.add_argument("--checkpoints", type=int, default=None, help="per run (default 9; quick 8)")
    p.add_argument("--every", type=int, default=25, help="optimizer steps between checkpoints")
    p.add_argument("--repeats", type=int, default=None, help="loads timed, best kept")
    p.add_argument(
        "--passes", type=int, default=None, help="passes over all methods, best kept (default 2)"
    )
    args = p.parse_args()

    torch.set_num_threads(2)
    size = models.SIZES["quick" if args.quick else "full"]
    n_ckpt = args.checkpoints or (8 if args.quick else 9)
    repeats = args.repeats or (1 if args.quick else 3)
    passes = args.passes or (1 if args.quick else 2)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "machine": machine_info(),
        "config": {
            "quick": args.quick,
            "size": vars(size),
            "checkpoints_per_run": n_ckpt,
            "every": args.every,
            "load_repeats": repeats,
            "passes": passes,
            "mb": MB,
        },
        "runs": {},
    }
    rows = []
    workdir = Path(tempfile.mkdtemp(prefix="ckptstore-bench-"))
    try:
        for name in args.runs:
            log(f"{name}: training ({n_ckpt} checkpoints, one every {args.every} steps)")
            t0 = time.perf_counter()
            res = models.RUNS[name](size, n_ckpt, args.every, log)
            train_s = time.perf_counter() - t0
            ckpts = res.checkpoints
            raw = [raw_bytes(s) for _, s in ckpts]
            log(
                f"{name}: {res.params / 1e6:.2f}M params, {sum(raw) / MB:.0f} MB raw, "
                f"trained in {train_s:.0f} s"
            )
            entry: dict[str, Any] = {
                "params": res.params,
                "steps": [s for s, _ in ckpts],
                "raw_per_ckpt": raw,
                "raw_bytes": sum(raw),
                "train_s": train_s,
                "loss_first": sum(res.losses[: args.every]) / args.every,
                "loss_last": sum(res.losses[-args.every :]) / args.every,
                "methods": {},
            }
            # every method in turn, then all of them again: a busy spell on the machine
            # hits every method, and each keeps its best pass
            tries: dict[str, list[dict[str, Any]]] = {method: [] for method in METHODS}
            for n_pass in range(passes):
                for method in METHODS:
                    gc.collect()
                    log(f"{name}: {method} (pass {n_pass + 1} of {passes})")
                    m = measure(method, name, ckpts, workdir, repeats)
                    # other work on the machine skews timings: keep a trace of it
                    m["loadavg_1m_after"] = os.getloadavg()[0]
                    tries[method].append(m)
            for method in METHODS:
                m = best_pass(tries[method])
                entry["methods"][method] = m
                rows.append(row(name, method, sum(raw), m))
                log("  " + rows[-1])
            results["runs"][name] = entry
            del ckpts, res
            gc.collect()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    results["machine"]["loadavg_end"] = os.getloadavg()
    results["targets"] = targets(results["runs"]) if set(args.runs) == set(models.RUNS) else []
    results["wall_s"] = time.perf_counter() - _T0
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results["runs"], args.out / "stored_bytes.png")

    mi = results["machine"]
    print()
    print(
        f"machine: {mi['cores']} cores ({mi['cpu']}), python {mi['python']}, torch {mi['torch']}, "
        f"numpy {mi['numpy']}, zstandard {mi['zstandard']}, zipnn {mi['zipnn']}; "
        f"load average {mi['loadavg_start'][0]:.1f} at start, {mi['loadavg_end'][0]:.1f} at end"
    )
    print(
        f"{n_ckpt} checkpoints per run, one every {args.every} steps; best of {passes} passes "
        f"over all methods; loads best of {repeats} per pass; "
        "MB = 1e6 bytes of raw tensors; 'load deep' = deepest chain checkpoint after a "
        "service restart (baselines: the same last checkpoint)"
    )
    print()
    print(HEAD)
    print("-" * len(HEAD))
    for line in rows:
        print(line)
    print()
    for name, r in results["runs"].items():
        c = r["methods"][CKPT]
        chain = " ".join(
            f"{x['step']}{'K' if x['keyframe'] else ''}:{x['stored'] / MB:.2f}" for x in c["chain"]
        )
        print(
            f"{name}: loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}; ckptstore chain "
            f"(step[K=keyframe]:stored MB) {chain}; blob dir {c['blob_dir_bytes'] / MB:.2f} MB "
            f"(reported {c['stored_bytes'] / MB:.2f}), catalog {c['catalog_bytes'] / MB:.2f} MB; "
            f"save CPU {c['save_cpu_s']:.1f} s (client {c['client_cpu_s']:.1f} + service "
            f"{c['service_cpu_s']:.1f}) vs zstd3 {r['methods'][ZSTD1]['save_cpu_s']:.1f} s; "
            f"peak service memory on cold load {c['peak_service_mem_load_bytes'] / MB:.0f} MB; "
            f"re-root after the last save (background, from the save's end, 1 s quiet time "
            f"included): {c['reroot_wait_s']:.2f} s, service CPU "
            f"{c['reroot_service_cpu_s']:.2f} s, stored {c['stored_before_reroot'] / MB:.2f} -> "
            f"{c['stored_bytes'] / MB:.2f} MB"
        )
    print()
    print("stored MB per checkpoint, in order")
    for name, r in results["runs"].items():
        for method, m in r["methods"].items():
            per = " ".join(f"{b / MB:6.2f}" for b in m["stored_per_ckpt"])
            print(f"  {name:17} {method:26} {per}")
    print()
    print(
        "compression ratio by part of the state (raw/stored; ckptstore: all checkpoints and "
        "delta checkpoints only, from its catalog; zipnn: all checkpoints; top delta codec)"
    )
    for name, r in results["runs"].items():
        cg = r["methods"][CKPT].get("groups") or {}
        zg = r["methods"][ZIPNN]["groups"]
        for g in GROUPS:
            if g not in zg and g not in cg:
                continue
            c = cg.get(g)
            z = zg.get(g)
            top = max(c["codecs"].items(), key=lambda kv: kv[1])[0] if c and c["codecs"] else "-"
            print(
                f"  {name:<17} {g:<11} raw {(z or c or {}).get('raw', 0) / MB:7.1f} MB  "
                + (
                    f"ckptstore {_ratio(c['raw'], c['stored']):>6} "
                    f"(deltas {_ratio(c['raw_delta'], c['stored_delta']):>6})  "
                    if c
                    else f"{'':34}"
                )
                + f"zipnn {_ratio(z['raw'], z['stored']) if z else '-':>6}  {top}"
            )
    print()
    print("ckptstore cold loads by chain depth (a restart before each; against the deep line)")
    for name, r in results["runs"].items():
        c, z = r["methods"][CKPT], r["methods"][ZSTD1]
        loads = c["cold_load_by_depth"] + [
            {"depth": c["deep_chain_depth"], "s": c["load_deep_s"], "mb_s": c["load_deep_mb_s"]}
        ]
        figures = ", ".join(
            f"depth {x['depth']} {x['s']:.3f} s {x['mb_s']:.0f} MB/s" for x in loads
        )
        print(f"  {name:<17} {figures}; line {0.5 * z['load_latest_mb_s']:.0f} MB/s")
    print()
    print(
        "loads of every step, in order, MB/s (cold: a fresh replica, the first sweep; warm: "
        "the same sweep again): ckptstore cold / warm vs zstd decompress + torch.load"
    )
    for name, r in results["runs"].items():
        c, z = r["methods"][CKPT], r["methods"][ZSTD1]
        raw_at = r["raw_per_ckpt"]
        figures = "  ".join(
            f"{x['step']}:{raw / cs / MB:.0f}/{raw / ws / MB:.0f} vs {raw / zs / MB:.0f}"
            for x, raw, cs, ws, zs in zip(
                c["chain"],
                raw_at,
                c["load_every_cold_s"],
                c["load_every_warm_s"],
                z["load_every_s"],
                strict=True,
            )
        )
        print(
            f"  {name:<17} {figures}; sweep totals: cold {sum(c['load_every_cold_s']):.2f} s, "
            f"warm {sum(c['load_every_warm_s']):.2f} s, zstd {sum(z['load_every_s']):.2f} s; "
            f"peak service memory over a sweep {c['peak_service_mem_sweep_bytes'] / MB:.0f} MB"
        )
    if results["targets"]:
        print()
        print("targets")
        for t in results["targets"]:
            print(f"  {'PASS' if t['pass'] else 'FAIL'}  {t['target']}: {t['figures']}")
        passed = sum(t["pass"] for t in results["targets"])
        print(f"  {passed}/{len(results['targets'])} passed")
    print()
    print(f"wrote {args.out / 'results.json'} and {args.out / 'stored_bytes.png'}")
    print(f"total wall time {results['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
