"""ExCP (Li et al., ICML 2024, arXiv 2406.11257), re-implemented from the paper for
bench/lossy.py to compare the lossy tier against.

Per parameter tensor (not per chunk), checkpoint ``t`` against checkpoint ``t-1``:

1. weight residual ``dW = W_t - W_{t-1}`` against the previous *original* checkpoint (the
   paper's setting: the compressor holds the previous checkpoint as saved; decoding adds the
   stored residuals up, so quantization errors accumulate along the chain);
2. weight residual pruning: keep ``|dW| > r_w`` with ``r_w = min(2.5, alpha / sqrt(mean(v)))
   * median(|dW|)`` (``v`` = ``exp_avg_sq``: the paper's ``alpha / sqrt(v) * median``, with
   the reference code's per-tensor mean and cap);
3. momentum pruning on the same positions: keep ``exp_avg`` and ``exp_avg_sq`` where
   ``|m| > beta * mean(|m|)`` and the weight residual was kept, 0 elsewhere;
4. non-uniform quantization of each of the three: 1-D k-means with ``2**bits - 1`` centres
   over the nonzero values plus index 0 for zero, fp32 codebooks (the reference code's fp16
   codebook underflows ``exp_avg_sq``: its values sit near 1e-10);
5. the dense 4-bit index arrays packed two per byte and entropy coded (zstd at the level the
   lossy tier uses, standing in for the paper's 7-zip).

The k-means is the lossy tier's (:func:`ckptstore_core.lossy._quantize`: quantile start, 12
fixed iterations, float64 means), repeated here for ``2**bits - 1`` centres, so the two differ
in what they keep and code, not in the clustering.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import zstandard

__all__ = ["ExCP", "encode_tensor"]

_CCTX = zstandard.ZstdCompressor(level=10)
_KMEANS_ITERS = 12


@dataclass(frozen=True)
class ExCP:
    alpha: float = 5e-5  # the reference code's default
    beta: float = 2.0
    bits: int = 4

    def label(self) -> str:
        return f"excp a={self.alpha:g} b={self.beta:g}"


def _kmeans(values: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """A float32 codebook of at most ``k`` entries (1-D k-means: quantile start, fixed
    iterations, float64 means) and each value's nearest entry (u8 indices)."""
    if not len(values):
        return np.zeros(0, np.float32), np.zeros(0, np.uint8)
    xs = np.sort(values.astype(np.float64))
    n = len(xs)
    centres = np.unique(xs)
    if len(centres) > k:
        centres = np.unique(xs[((np.arange(k) + 0.5) * n / k).astype(np.int64)])
        csum = np.concatenate([[0.0], np.cumsum(xs)])
        for _ in range(_KMEANS_ITERS):
            mids = (centres[1:] + centres[:-1]) / 2
            cuts = np.concatenate([[0], np.searchsorted(xs, mids), [n]])
            counts = np.diff(cuts)
            sums = csum[cuts[1:]] - csum[cuts[:-1]]
            filled = counts > 0
            centres = np.unique(sums[filled] / counts[filled])
    codebook = np.unique(centres.astype(np.float32))
    mids = (codebook[1:].astype(np.float64) + codebook[:-1]) / 2
    return codebook, np.searchsorted(mids, values.astype(np.float64)).astype(np.uint8)


def _quant_nonzero(x: np.ndarray, bits: int) -> tuple[np.ndarray, int]:
    """x with its nonzero values replaced by their k-means centre (2**bits - 1 of them;
    index 0 stands for 0), and the stored size: packed indices in zstd + fp32 codebook."""
    nz = x != 0
    codebook, idx = _kmeans(x[nz], (1 << bits) - 1)
    full = np.zeros(len(x), np.uint8)
    full[nz] = idx + 1
    out = np.zeros(len(x), np.float32)
    if len(codebook):
        out[nz] = codebook[idx]
    per_byte = 8 // bits
    pad = (-len(full)) % per_byte
    packed = np.concatenate([full, np.zeros(pad, np.uint8)]).reshape(-1, per_byte)
    value = np.zeros(len(packed), np.uint8)
    for i in range(per_byte):
        value |= packed[:, i] << np.uint8(bits * (per_byte - 1 - i))
    size = len(_CCTX.compress(value.tobytes())) + 4 * len(codebook)
    return out, size


def encode_tensor(
    w: np.ndarray,
    w_prev: np.ndarray,
    w_prev_recon: np.ndarray,
    m: np.ndarray | None,
    v: np.ndarray | None,
    p: ExCP,
) -> tuple[int, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(stored bytes, weights, exp_avg, exp_avg_sq as they load) for one parameter tensor
    (flat float32). Without moments, the weight residual is pruned at the cap (2.5 x median)."""
    r = w - w_prev
    factor = 2.5
    if v is not None:
        mean_v = float(np.mean(v, dtype=np.float64))
        factor = min(2.5, p.alpha / np.sqrt(mean_v)) if mean_v > 0 else 2.5
    thr = float(np.median(np.abs(r))) * factor
    r = np.where(np.abs(r) > thr, r, np.float32(0)).astype(np.float32)
    rq, size = _quant_nonzero(r, p.bits)
    w_out = (w_prev_recon + rq).astype(np.float32)
    if m is None or v is None:
        return size, w_out, None, None
    am = np.abs(m)
    keep = (am > p.beta * float(np.mean(am, dtype=np.float64))) & (r != 0)
    mq, size_m = _quant_nonzero(np.where(keep, m, np.float32(0)).astype(np.float32), p.bits)
    vq, size_v = _quant_nonzero(np.where(keep, v, np.float32(0)).astype(np.float32), p.bits)
    return size + size_m + size_v, w_out, mq, vq
