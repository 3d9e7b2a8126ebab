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

Then, with the default codec, the shape of the chain: which earlier checkpoint each one is a
delta of (checkpoint 0 is the keyframe):

* ``linear``: the previous one (what the service does);
* ``anchor 4``: checkpoint 4 a delta of 0, the others of the previous one (a chain at most
  5 deep over 9 checkpoints);
* ``anchors 4,6,8``: as ``anchor 4``, and 6 and 8 deltas of 4 and 6 (at most 3 deep);
* ``skip``: Subversion's skip-deltas, ``k`` a delta of ``k`` with its lowest set bit cleared
  (at most log2 deep);
* ``re-rooted at 4``: checkpoint 4 the keyframe, the ones before it deltas of the next one
  (backwards), the ones after it of the previous one: what a chain re-rooted at its middle
  after the fact would store (at most 4 deep).

It prints the bytes, and for the deepest checkpoint its depth, links and decode time: what a
shallower chain buys in restore work and costs in bytes, because a delta across several
checkpoints is larger than one across one.
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
from ckptstore.state import flatten
from ckptstore_core import codec, planes

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


def linear(k: int) -> int:
    """The checkpoint ``k`` is a delta of (-1: ``k`` is the keyframe)."""
    return k - 1


SHAPES: dict[str, Callable[[int], int]] = {
    "linear": linear,
    "anchor 4": lambda k: 0 if k == 4 else k - 1,
    "anchors 4,6,8": lambda k: 0 if k == 4 else k - 2 if k in (6, 8) else k - 1,
    "skip": lambda k: k & (k - 1) if k else -1,
    "re-rooted at 4": lambda k: k + 1 if k < 4 else k - 1 if k > 4 else -1,
}


def chain_of(k: int, parent: Callable[[int], int]) -> list[int]:
    """Checkpoint ``k``'s chain, from its keyframe to ``k``."""
    chain = [k]
    while parent(chain[-1]) >= 0:
        chain.append(parent(chain[-1]))
    return chain[::-1]


def measure(
    states: list[Chunks], min_gain: float, parent: Callable[[int], int] = linear
) -> tuple[int, list[int], int, float]:
    """Bytes stored; the chain, links and decode CPU seconds of the deepest checkpoint's
    restore (the latest of the deepest), each checkpoint a delta of ``parent(k)`` (the
    keyframe, -1, of none)."""
    stored = 0
    history: list[dict[tuple[str, int], codec.EncodedChunk]] = []
    for k, state in enumerate(states):
        delta = parent(k) >= 0
        prev = states[parent(k)] if delta else {}
        encoded = {}
        for key, (raw, itemsize) in state.items():
            base = prev.get(key, (None, 0))[0]
            enc = codec.encode_chunk(raw, base, itemsize, delta=delta, min_gain=min_gain)
            encoded[key] = enc
            stored += len(enc.payload)
        history.append(encoded)
    deep = chain_of(max(range(len(states)), key=lambda k: (len(chain_of(k, parent)), k)), parent)
    jobs = []
    for key, (raw, itemsize) in states[deep[-1]].items():
        links: list[tuple[str, bytes]] = []
        for k in reversed(deep):
            enc = history[k][key]
            if enc.codec == codec.REF:
                continue
            links.append((enc.codec, enc.payload))
            if not codec.is_delta(enc.codec):
                break
        jobs.append((links[::-1], itemsize, len(raw), history[deep[-1]][key].checksum))
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        for links, itemsize, raw_len, digest in jobs:
            codec.decode_chain(links, itemsize, raw_len, digest)
        best = min(best, time.process_time() - t0)
    return stored, deep, sum(len(j[0]) for j in jobs), best


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
        print(f"{'variant':14} {'stored MB':>10} {'deep links':>11} {'deep decode s':>14}")
        for name in ("final", "no scale", "every delta", "planes 5%"):
            with variant(name) as min_gain:
                stored, _, links, cpu = measure(states, min_gain)
            print(f"{name:14} {stored / 1e6:10.2f} {links:11d} {cpu:14.3f}")
        head = ("chain shape", "stored MB", "deepest", "depth", "links", "decode s")
        print("{:14} {:>10} {:>8} {:>6} {:>6} {:>9}".format(*head))
        for name, parent in SHAPES.items():
            stored, deep, links, cpu = measure(states, codec.DELTA_MIN_GAIN, parent)
            depth = len(deep) - 1
            print(f"{name:14} {stored / 1e6:10.2f} {deep[-1]:8d} {depth:6d} {links:6d} {cpu:9.3f}")


if __name__ == "__main__":
    main()
