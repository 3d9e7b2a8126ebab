"""Byte-plane shuffle and plane compression: ckptstore's kernels against numpy and blosc2.

    .venv/bin/python bench/shuffle.py

Prints MB/s and stored sizes for 4 MiB chunks of fp32 data: fresh weights (normal noise) and
the residual of a slowly drifting tensor. ckptstore computes the residual and shuffles in one
fused pass (numba; the numpy reference when numba is missing) and compresses each whole
plane, storing a plane raw when it does not compress; blosc2 shuffles in SIMD C and compresses
blocks with zstd.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import blosc2
import numpy as np

from ckptstore_core import planes as kernels
from ckptstore_core.codec import decode_chunk, encode_chunk

MiB = 1 << 20
N = 1 << 20  # fp32 elements per chunk (4 MiB)
REPS = 16


def rate(fn: Callable[[], object], nbytes: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(REPS):
        fn()
    return nbytes * REPS / (time.perf_counter() - t) / 1e6


def main() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal(N).astype(np.float32)
    w2 = (w + rng.standard_normal(N).astype(np.float32) * 1e-3).astype(np.float32)
    raw = w.tobytes()
    print(f"{'what':44} {'MB/s':>8} {'ratio':>7}")
    as_u8 = w.view(np.uint8)
    values = w.view(np.uint32)
    strided = rate(lambda: kernels.split_numpy(values, None, 0), len(raw))
    transposed = rate(lambda: as_u8.reshape(-1, 4).T.copy(), len(raw))
    print(f"{'numpy shuffle (strided copy per plane)':44} {strided:8.0f}")
    print(f"{'numpy shuffle (transposed copy)':44} {transposed:8.0f}")
    planes = as_u8.reshape(-1, 4).T.copy()
    out = np.empty((N, 4), np.uint8)
    base = (w2.view(np.uint32) ^ 1).astype(np.uint32)
    joined = base.copy()
    zsub = kernels.MODES["zsub"]
    residual = list(kernels.split(w2.view(np.uint32), base, zsub))
    if kernels.FUSED:
        fused_split = rate(lambda: kernels.split(w2.view(np.uint32), base, zsub), len(raw))
        fused_join = rate(lambda: kernels.join(residual, joined, zsub), len(raw))
        print(f"{'fused zigzag-delta + shuffle (numba)':44} {fused_split:8.0f}")
        print(f"{'fused unshuffle + unzigzag + add (numba)':44} {fused_join:8.0f}")
    numpy_split = rate(lambda: kernels.split_numpy(w2.view(np.uint32), base, zsub), len(raw))
    numpy_join = rate(lambda: kernels.join_numpy(residual, joined, zsub), len(raw))
    print(f"{'numpy zigzag-delta + shuffle':44} {numpy_split:8.0f}")
    print(f"{'numpy unshuffle + unzigzag + add':44} {numpy_join:8.0f}")

    def unshuffle_columns() -> None:
        for i in range(4):
            out[:, i] = planes[i]

    print(
        f"{'numpy unshuffle (strided column writes)':44} {rate(unshuffle_columns, len(raw)):8.0f}"
    )
    print(
        f"{'numpy unshuffle (transposed copy)':44} {rate(lambda: planes.T.copy(), len(raw)):8.0f}"
    )
    for name, data, base in (
        ("fresh weights", w2.tobytes(), None),
        ("drift vs base", w2.tobytes(), raw),
    ):
        for level in (1, 3):
            enc = encode_chunk(data, base, 4, level)
            r = rate(lambda: encode_chunk(data, base, 4, level), len(data))  # noqa: B023
            d = rate(
                lambda: decode_chunk(enc.codec, enc.payload, base, 4, len(data), enc.checksum),  # noqa: B023
                len(data),
            )
            label = f"ckptstore {name} zstd-{level} enc/dec"
            print(f"{label:44} {r:8.0f} {len(data) / len(enc.payload):7.3f}  dec {d:.0f}")
        src = (
            data
            if base is None
            else (np.frombuffer(data, np.uint32) - np.frombuffer(base, np.uint32)).tobytes()
        )
        for level in (1, 3):
            for threads in (1, 2):
                cp = {
                    "codec": blosc2.Codec.ZSTD,
                    "clevel": level,
                    "typesize": 4,
                    "filters": [blosc2.Filter.SHUFFLE],
                    "nthreads": threads,
                }
                packed = blosc2.compress2(src, **cp)
                r = rate(lambda: blosc2.compress2(src, **cp), len(src))  # noqa: B023
                d = rate(lambda: blosc2.decompress2(packed), len(src))  # noqa: B023
                label = f"blosc2 {name} zstd-{level} x{threads} enc/dec"
                print(f"{label:44} {r:8.0f} {len(src) / len(packed):7.3f}  dec {d:.0f}")


if __name__ == "__main__":
    main()
