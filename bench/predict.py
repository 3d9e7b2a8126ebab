"""Does predicting the next checkpoint from the two before it shrink the residual?

    .venv/bin/python bench/predict.py [--quick]

For every fp32 tensor of real consecutive checkpoints (bench/models.py: a GPT trained from
scratch, and an encoder being fine-tuned; AdamW; one checkpoint every 25 steps), the chunk
codec encodes checkpoint k against three bases and keeps its best mode (sub, xor or none):

* ``prev``: checkpoint k-1 (what ckptstore stores);
* ``linear``: the extrapolation 2*x[k-1] - x[k-2] computed in fp32 (exactly reproducible
  at decode time, so still lossless), which wins if updates keep their direction;
* ``int-linear``: the same extrapolation on the raw bit patterns as wrapping integers.

Prints stored bytes per tensor group (weights, exp_avg, exp_avg_sq) for each base.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models
from ckptstore.state import flatten
from ckptstore_core.codec import chunk_step, encode_chunk

CHUNK = 4 << 20


def group(name: str) -> str:
    for g in ("exp_avg_sq", "exp_avg"):
        if name.endswith(g):
            return g
    return "weights" if name.startswith("model/") else "other"


def encoded(raw: np.ndarray, base: np.ndarray | None) -> int:
    data, ref = raw.tobytes(), None if base is None else base.tobytes()
    step = chunk_step(4, CHUNK)
    total = 0
    for off in range(0, len(data), step):
        piece = None if ref is None else ref[off : off + step]
        total += len(encode_chunk(data[off : off + step], piece, 4, 1).payload)
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    size = models.SIZES["quick" if args.quick else "full"]
    runs = [
        models.run_gpt_fp32(size, 8, 25, lambda s: None),
        models.run_finetune(size, 8, 25, lambda s: None),
    ]
    for run in runs:
        flats = [
            {n: t.numpy().copy() for n, t in flatten(s).tensors if t.dtype == torch.float32}
            for _, s in run.checkpoints
        ]
        sizes: dict[tuple[str, str], int] = defaultdict(int)
        for k in range(2, len(flats)):
            for name, x in flats[k].items():
                x1, x2 = flats[k - 1].get(name), flats[k - 2].get(name)
                if x1 is None or x2 is None or x1.shape != x.shape or x2.shape != x.shape:
                    continue
                g = group(name)
                sizes[(g, "raw")] += x.nbytes
                sizes[(g, "prev")] += encoded(x, x1)
                sizes[(g, "linear")] += encoded(x, (2 * x1 - x2).astype(np.float32))
                b1, b2 = x1.view(np.uint32), x2.view(np.uint32)
                sizes[(g, "int-linear")] += encoded(x, (2 * b1 - b2).view(np.float32))
        print(f"\n{run.name}: checkpoints 2..{len(flats) - 1}, bytes stored per base")
        print(f"{'group':12} {'raw':>12} {'prev':>12} {'linear':>12} {'int-linear':>12}")
        for g in ("weights", "exp_avg", "exp_avg_sq", "other"):
            if (g, "raw") in sizes:
                row = [sizes[(g, m)] for m in ("raw", "prev", "linear", "int-linear")]
                print(f"{g:12} " + " ".join(f"{v:12,d}" for v in row))
        total = {
            m: sum(v for (_, mm), v in sizes.items() if mm == m)
            for m in ("raw", "prev", "linear", "int-linear")
        }
        print(f"{'total':12} " + " ".join(f"{total[m]:12,d}" for m in total))


if __name__ == "__main__":
    main()
