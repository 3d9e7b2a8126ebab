"""What the codec's choices cost in bytes, and in work for a restore deep in a chain.

    .venv/bin/python bench/chains.py [--quick]

For the fp32 runs of bench/models.py (a GPT trained from scratch, an encoder being
fine-tuned; AdamW; one checkpoint every 25 steps), every tensor of every checkpoint is encoded
chunk by chunk the way the service does (against the same chunk of the previous checkpoint,
the first checkpoint on its own, chunks of 4 MiB of fp32), once per codec variant:

* ``final``: the defaults;
* ``no scale``: without the ``scale`` mode (rows that only decayed);
* ``every delta``: a delta is kept whenever it is smaller at all (``min_gain=0``), not only
  when it saves 5%;
* ``planes 5%``: a plane is compressed when zstd saves 5% of it, not 15%.

For each it prints the bytes stored over the run, and for the last checkpoint (the deepest
in its chain) the links a restore decodes and the CPU time of decoding them on one thread
(best of 3). Run on an idle machine: the times are single-thread CPU seconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models
from ckptstore import codec, planes
from ckptstore.state import flatten

CHUNK = 4 << 20
Chunks = dict[tuple[str, int], tuple[bytes, int]]


def chunks(state: models.State) -> Chunks:
    out: Chunks = {}
    for name, t in flatten(state).tensors:
        data = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        step = codec.chunk_step(t.element_size(), CHUNK)
        for off in range(0, max(len(data), 1), step):
            out[(name, off)] = (data[off : off + step], t.element_size())
    return out


@contextmanager
def variant(name: str) -> Iterator[float]:
    """Patch the codec for one variant; yields the ``min_gain`` to encode with."""
    saved = codec._scale_factor, codec._PLANE_GAIN
    if name == "no scale":
        codec._scale_factor = lambda raw, base: None
    elif name == "planes 5%":
        codec._PLANE_GAIN = 0.95
    try:
        yield 0.0 if name == "every delta" else codec.DELTA_MIN_GAIN
    finally:
        codec._scale_factor, codec._PLANE_GAIN = saved


def measure(states: list[Chunks], min_gain: float) -> tuple[int, int, float]:
    """Bytes stored; links and decode CPU seconds of the last checkpoint's restore."""
    stored = 0
    history: list[dict[tuple[str, int], codec.EncodedChunk]] = []
    for k, state in enumerate(states):
        prev = states[k - 1] if k else {}
        encoded = {}
        for key, (raw, itemsize) in state.items():
            base = prev.get(key, (None, 0))[0]
            enc = codec.encode_chunk(raw, base, itemsize, delta=k > 0, min_gain=min_gain)
            encoded[key] = enc
            stored += len(enc.payload)
        history.append(encoded)
    jobs = []
    for key, (raw, itemsize) in states[-1].items():
        links: list[tuple[str, bytes]] = []
        for k in range(len(history) - 1, -1, -1):
            enc = history[k][key]
            if enc.codec == codec.REF:
                continue
            links.append((enc.codec, enc.payload))
            if not codec.is_delta(enc.codec):
                break
        jobs.append((links[::-1], itemsize, len(raw), history[-1][key].checksum))
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        for links, itemsize, raw_len, digest in jobs:
            codec.decode_chain(links, itemsize, raw_len, digest)
        best = min(best, time.process_time() - t0)
    return stored, sum(len(j[0]) for j in jobs), best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="small models: a smoke run")
    args = p.parse_args()
    size = models.SIZES["quick" if args.quick else "full"]
    planes.warm_up()
    runs: list[Callable[..., models.RunResult]] = [models.run_gpt_fp32, models.run_finetune]
    for make in runs:
        run = make(size, 9, 25, lambda s: None)
        states = [chunks(s) for _, s in run.checkpoints]
        raw = sum(len(r) for s in states for r, _ in s.values())
        print(f"\n{run.name}: {len(states)} checkpoints, {raw / 1e6:.1f} MB raw")
        print(f"{'variant':12} {'stored MB':>10} {'deep links':>11} {'deep decode s':>14}")
        for name in ("final", "no scale", "every delta", "planes 5%"):
            with variant(name) as min_gain:
                stored, links, cpu = measure(states, min_gain)
            print(f"{name:12} {stored / 1e6:10.2f} {links:11d} {cpu:14.3f}")


if __name__ == "__main__":
    main()
