"""Where a load's time goes: a per-stage breakdown of loads of a deep step and of ``latest``.

    .venv/bin/python bench/profile_load.py [--quick] [--run gpt-scratch-fp32]
        [--states /tmp/states.pt] [--py-spy PATH]

The GPT of bench/models.py's from-scratch run with its AdamW state, 9 checkpoints 25 steps
apart (random gradients by default, seconds; ``--trained``: the bench's real training,
minutes; ``--states`` keeps the states in a file and reuses them), is saved into the real
service in a child process, with the bench's settings (one chain, re-rooted in the
background after the last save). Then:

1. **In process, one thread** (the service's own modules on its data folder, the service
   stopped), for the deepest checkpoint: *resolve* (the catalog's checkpoint, tensors and
   chunk tree), *blob read* (every link's stored bytes, cold window reader), *decode* (each
   chunk's chain, under cProfile: zstd, the plane kernels, the copy of a raw first link,
   the checksum), per chain link.
2. **In process, the codec pool** (2 threads): the whole checkpoint's ``ChainSource.stream``.
3. **End to end over HTTP**, each after a service restart (cold: empty caches) and then again
   on the same replica (warm): ``client.load``, and the same GET read into buffers without
   building tensors; ``latest`` (from the base cache) likewise. The client's own work on
   bytes received (checksums, tensors and the nested state) is timed apart, in process.
   ``--py-spy``: a py-spy profile of the service during the cold load of the deep step
   (its top functions by own time).
4. **A sweep**: every step in order on a fresh replica (cold), then again (warm), against
   zstd + torch.load of each step; ``--against DIR`` interleaves the same sweeps served by
   another checkout's code (before/after a change, in the same minutes: the ratios survive
   a busy machine). ``--sweeps-only``: only this.

Times are wall seconds (best of ``--repeats``) on a shared 2-core machine: compare the rows of
one run with each other, not with another day's.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import io
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import models  # noqa: E402
from ckptstore import CheckpointClient  # noqa: E402
from ckptstore.state import tensor_from_bytes, unflatten  # noqa: E402
from ckptstore.transport import checkpoint_path, digest, read_header, read_into  # noqa: E402
from ckptstore_core import codec, planes  # noqa: E402
from ckptstore_core.pipeline import Budget  # noqa: E402
from ckptstore_service.catalog import Catalog  # noqa: E402
from ckptstore_service.chains import ChainDecoder, ChainSource, DecodeStats  # noqa: E402
from ckptstore_service.storage import open_blob_store  # noqa: E402
from support.serviceproc import Service, forget_cache, wait_idle  # noqa: E402

MB = 1e6
CHUNK_BYTES = 4 << 20
# the functions whose cumulative time names a decode stage (cProfile's keys end with them)
STAGES = {
    "zstd": ("_decompress_all",),
    "planes": ("join", "join_runs", "sparse_unpack", "scale"),
    "checksum": ("checksum",),
    "parse": ("_parse_link",),
}


def _named(key: tuple[str, int, str], names: tuple[str, ...]) -> bool:
    filename, _, func = key
    return func in names and filename.endswith(("codec.py", "planes.py"))


def log(msg: str) -> None:
    print(msg, flush=True)


def best(repeats: int, fn: Callable[[], Any]) -> float:
    times = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def states(args: argparse.Namespace) -> list[tuple[int, Any]]:
    if args.states and args.states.exists():
        loaded: list[tuple[int, Any]] = torch.load(args.states, weights_only=False)
        return loaded
    size = models.SIZES["quick" if args.quick else "full"]
    trained = models.RUNS[args.run] if args.trained else None
    ckpts = trained(size, 9, 25, log).checkpoints if trained else synthetic(size)
    if args.states:
        torch.save(ckpts, args.states)
    return ckpts


def synthetic(size: models.Size) -> list[tuple[int, Any]]:
    """The GPT of the bench's from-scratch run, its AdamW state and schedule after 9 x 25
    steps of random gradients: the shapes, dtypes and optimizer dynamics of the real run in
    seconds (training it takes minutes on a busy machine), without its loss curve."""
    torch.manual_seed(1)
    model = models.Transformer(size, causal=True, out=size.vocab, dropout=0.1)
    opt = models.adamw(model, False, 0.1, lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, models.warmup_cosine(25, 225))
    ckpts = []
    for step in range(1, 226):
        for param in model.parameters():
            param.grad = torch.randn_like(param) * 1e-2
        opt.step()
        sched.step()
        if step % 25 == 0:
            ckpts.append((step, models._snapshot(models._state(model, opt, sched, step))))
    return ckpts


def env(depth: int) -> dict[str, str]:
    return {
        "CKPTSTORE_KEYFRAME_INTERVAL": str(depth),
        "CKPTSTORE_MAX_CHAIN_DEPTH": str(depth),
        "CKPTSTORE_GARBAGE_GRACE_S": "0",
        "CKPTSTORE_TEST_LOG_LEVEL": "info",
    }


def in_process(data_dir: Path, run: str, step: int, repeats: int) -> dict[str, float]:
    """Resolve, blob read, decode (by stage) and checksum of one checkpoint, one thread; then
    the same checkpoint through ChainSource in a pool of two codec threads."""
    catalog = Catalog(f"sqlite:///{data_dir / 'catalog.sqlite3'}")
    store = open_blob_store(f"file://{data_dir / 'blobs'}")
    planes.warm_up()
    catalog.warm_up()
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    info = catalog.get(run, step)
    tensors = catalog.tensors(info.id)
    own, closure = catalog.chunk_tree(info.id)
    out["resolve_s"] = time.perf_counter() - t0
    decoder = ChainDecoder(store, closure, 0)
    links = 0
    t0 = time.perf_counter()
    for c in own:
        deltas, bottom = decoder.chain(c)
        for link in (*deltas, bottom):
            links += 1
            bytes(decoder.fetch(link))  # touch the pages: a cold read, not a lazy map
    out["blob_read_s"] = time.perf_counter() - t0
    out["links"] = links
    out["chunks"] = len(own)
    out["raw_mb"] = sum(t.nbytes for t in tensors) / MB

    def decode_all() -> None:
        d = ChainDecoder(store, closure, 0)
        for c in own:
            d.decode(c)

    out["decode_1thread_s"] = best(repeats, decode_all)
    prof = cProfile.Profile()
    prof.enable()
    decode_all()
    prof.disable()
    raw = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    for stage, names in STAGES.items():
        # cumulative time of the functions that name the stage (zstd's is a C method)
        out[f"{stage}_s"] = sum(v[3] for k, v in raw.items() if _named(k, names))
    out["profiled_total_s"] = sum(v[2] for v in raw.values())
    out["checksum_raw_s"] = best(
        repeats,
        lambda: [codec.checksum(np.empty(c.raw_len, np.uint8).data) for c in own],
    )
    with ThreadPoolExecutor(2) as pool:
        source = ChainSource(catalog, store, pool, Budget(2, CHUNK_BYTES))

        def stream() -> None:
            for _ in source.stream(info, tensors, DecodeStats()):
                pass

        out["chainsource_2threads_s"] = best(repeats, stream)
    catalog.close()
    store.close()
    return out


def over_http(
    svc_factory: Callable[[], Service], run: str, step: int | str, repeats: int, spy: str | None
) -> dict[str, float]:
    """Cold (a restart before each) and warm ``client.load`` and plain GET of ``step``."""

    def raw_get(client: CheckpointClient) -> None:
        with client.transport.stream("GET", checkpoint_path(run, step)) as response:
            header = read_header(response)
            for spec in header.tensors:
                read_into(response, np.empty(spec.nbytes, np.uint8).data, lambda n: None)

    out: dict[str, float] = {}
    svc = svc_factory().start()
    try:  # the client's own work on bytes already received, in this process
        with (
            CheckpointClient(svc.url, timeout=600) as client,
            client.transport.stream("GET", checkpoint_path(run, step)) as response,
        ):
            header = read_header(response)
            buffers = [np.empty(t.nbytes, np.uint8).data for t in header.tensors]
            for buf in buffers:
                read_into(response, buf, lambda n: None)
    finally:
        svc.stop()
    out["client_checksums_s"] = best(repeats, lambda: [digest(b) for b in buffers])
    specs = list(zip(header.tensors, buffers, strict=True))

    def build() -> None:
        tensors = {t.name: tensor_from_bytes(b, t.dtype, t.shape) for t, b in specs}
        unflatten(header.metadata["skeleton"], tensors)

    out["client_tensors_unflatten_s"] = best(repeats, build)
    out.update({"load_cold_s": 1e9, "get_cold_s": 1e9, "get_warm_s": 1e9})
    out["load_warm_s"] = 1e9
    for _ in range(repeats):
        for kind in ("load", "get"):
            svc = svc_factory()
            forget_cache(svc.data_dir)  # cold: a restarted process would take back latest's file
            svc.start()
            try:
                with CheckpointClient(svc.url, timeout=600) as client:
                    fn = (
                        (lambda c=client: c.load(run, step))
                        if kind == "load"
                        else (lambda c=client: raw_get(c))
                    )
                    out[f"{kind}_cold_s"] = min(out[f"{kind}_cold_s"], best(1, fn))
                    out[f"{kind}_warm_s"] = min(out[f"{kind}_warm_s"], best(1, fn))
            finally:
                svc.stop()
    if spy:
        svc = svc_factory().start()
        try:
            with (
                CheckpointClient(svc.url, timeout=600) as client,
                tempfile.NamedTemporaryFile(suffix=".txt") as f,
            ):
                rec = subprocess.Popen(
                    [
                        spy,
                        "record",
                        "--pid",
                        str(svc.pid),
                        "--rate",
                        "1000",
                        "--format",
                        "raw",
                        "--threads",
                        "--nonblocking",
                        "-o",
                        f.name,
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                time.sleep(1.0)
                t0 = time.perf_counter()
                for _ in range(3):
                    client.load(run, step)
                log(f"  (py-spy: 3 loads in {time.perf_counter() - t0:.2f} s)")
                rec.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
                rec.wait()
                summarize_spy(Path(f.name))
        finally:
            svc.stop()
    return out


def summarize_spy(path: Path) -> None:
    """Top frames by own samples from py-spy's collapsed stacks (idle threads left out)."""
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        leaf = frames[-1]
        if any(w in leaf for w in ("wait (threading", "_worker (concurrent", "select (", "poll")):
            continue
        n = int(count)
        total += n
        own[leaf.split(" (")[0] + " (" + leaf.rsplit("/", 1)[-1]] += n
    log(f"  py-spy: {total} busy samples; top frames by own samples:")
    for frame, n in own.most_common(15):
        log(f"    {100 * n / total:5.1f}%  {frame}")


def sweep(svc: Service, run: str, steps: list[int]) -> tuple[list[float], list[float]]:
    """Each step's load time in order on ``svc`` (started fresh: cold), then again (warm)."""
    out: tuple[list[float], list[float]] = ([], [])
    try:
        with CheckpointClient(svc.start().url, timeout=600) as client:
            for times in out:
                for step in steps:
                    gc.collect()
                    t0 = time.perf_counter()
                    client.load(run, step)
                    times.append(time.perf_counter() - t0)
    finally:
        svc.stop()
    return out


def sweeps(
    args: argparse.Namespace,
    ckpts: list[tuple[int, Any]],
    listing: list[Any],
    data_dir: Path,
    e: dict[str, str],
) -> None:
    """Every step in order, cold then warm, best of ``--repeats``; interleaved with the same
    sweep served by the checkout ``--against`` (its core and service on the service's
    path), and with zstd + torch.load of the same states."""
    steps = [c.step for c in listing]
    sides = {"this": e}
    if args.against:
        path = ":".join(str(args.against / d) for d in ("core", "client", "service"))
        sides = {"against": {**e, "PYTHONPATH": path}, **sides}
    best_s: dict[str, list[list[float]]] = {}
    for _ in range(args.repeats):
        for side, env_side in sides.items():
            cold, warm = sweep(Service(data_dir, env_side), args.run, steps)
            for kind, times in (("cold", cold), ("warm", warm)):
                prev = best_s.get(f"{side} {kind}", [[1e9] * len(steps)])[0]
                best_s[f"{side} {kind}"] = [[min(a, b) for a, b in zip(prev, times, strict=True)]]
    cctx, dctx = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    zstd = []
    for _, state in ckpts:
        buf = io.BytesIO()
        torch.save(state, buf)
        blob = cctx.compress(buf.getbuffer())
        zstd.append(
            best(
                args.repeats,
                lambda b=blob: torch.load(io.BytesIO(dctx.decompress(b)), weights_only=False),
            )
        )
    best_s["zstd + torch.load"] = [zstd]
    raw = [c.raw_bytes / MB for c in listing]
    log("every step in order (ms; MB/s over the sweep):")
    for name, (times,) in best_s.items():
        log(
            f"  {name:<18} {sum(raw) / sum(times):6.0f} MB/s  "
            + " ".join(f"{t * 1000:5.0f}" for t in times)
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--run", choices=list(models.RUNS), default="gpt-scratch-fp32")
    p.add_argument("--trained", action="store_true", help="train the run (slow), not synthetic")
    p.add_argument("--states", type=Path, default=None, help="trained states kept here")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--py-spy", dest="spy", default=None, help="py-spy binary: profile too")
    p.add_argument(
        "--against", type=Path, default=None, help="a checkout to compare the sweeps with"
    )
    p.add_argument("--sweeps-only", action="store_true", help="skip the stage breakdown")
    args = p.parse_args()
    torch.set_num_threads(2)
    ckpts = states(args)
    work = Path(tempfile.mkdtemp(prefix="ckptstore-profile-"))
    data_dir = work / "data"
    e = env(max(16, len(ckpts) + 1))
    svc = Service(data_dir, e).start()
    try:
        with CheckpointClient(svc.url, timeout=600) as client:
            for step, state in ckpts:
                client.save(args.run, step, state)
            wait_idle(svc.url, timeout=600)
            listing = client.list(args.run)
    finally:
        svc.stop()
    deep = max(listing, key=lambda c: (c.chain_depth, c.step))
    raw_mb = deep.raw_bytes / MB
    log(
        f"{args.run}: {len(listing)} checkpoints of {raw_mb:.1f} MB; chain depths "
        + " ".join(f"{c.step}:{c.chain_depth}" for c in listing)
    )
    if args.sweeps_only:
        sweeps(args, ckpts, listing, data_dir, e)
        return
    log(f"deep step {deep.step} (depth {deep.chain_depth}), in process:")
    stages = in_process(data_dir, args.run, deep.step, args.repeats)
    for k, v in stages.items():
        log(f"  {k:<26} {v:9.4f}")
    for step in (deep.step, "latest"):
        log(f"over HTTP, step {step}:")
        res = over_http(
            lambda: Service(data_dir, e),
            args.run,
            step,
            args.repeats,
            args.spy if step == deep.step else None,
        )
        for k, v in res.items():
            log(f"  {k:<26} {v:9.4f} s  {raw_mb / v:7.0f} MB/s")
        logs = sorted(data_dir.glob("service-*.log"))
        lines = [x for f in logs for x in f.read_text().splitlines() if "loaded " in x]
        for line in lines[-2:]:
            log("  service: " + line.split("loaded ", 1)[1])

    sweeps(args, ckpts, listing, data_dir, e)


if __name__ == "__main__":
    main()
