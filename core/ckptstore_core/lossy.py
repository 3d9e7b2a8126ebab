"""Lossy archival encoding of fp32 weights and their Adam moments (issue 23, after ExCP).

Opt-in and never silent: a chunk stored this way is a chain link with codec :data:`LOSSY`,
decoded against its base (the parent checkpoint's chunk *as it loads*, i.e. its
reconstruction) by :func:`decode`, and checksummed like any chunk: the checksum is the one of
the reconstruction. Decoding is bit-exact and machine-independent: it only converts integer
indices to float32 (exact: under 2**15) or gathers codebook values, and applies IEEE-754
float32 ``+``, ``*``, ``sqrt`` and ``max``, each correctly rounded, one operation at a time
(no fused multiply-add, no transcendental functions), so every load on any machine gives
the same bytes. :func:`encode` returns the reconstruction it computed with the very same
routine.

What is stored, per chunk (``role``):

* ``weight`` -- the residual ``raw - base`` against the parent's reconstruction (errors do
  not pile up: what one checkpoint drops, the next one's residual still holds). Its elements
  are ranked by importance ``|r| / sqrt(v_prev + eps)`` (``v_prev``: the parent's
  reconstructed ``exp_avg_sq``; ``|r|`` without one) and the lowest ``weight_prune`` share of
  the nonzero residuals is dropped: those elements load as their base, bit for bit. The rest
  is quantized: uniformly (``step``: to the nearest multiple of ``step`` times the mean
  magnitude of the kept values) or, with ``step=None``, to a ``2**bits``-entry fp32
  codebook (1-D k-means, fixed iterations). The moments below are quantized the same way.
* ``exp_avg`` -- the values themselves (the first moment forgets its past within tens of
  steps, a residual gains nothing), ranked by ``|m| / sqrt(v_prev + eps)`` (the Adam step
  they would cause); the lowest ``moment_prune`` share is set to 0, the rest quantized.
* ``exp_avg_sq`` -- the residual in the square-root domain, ``sqrt(v) - sqrt(base)``,
  ranked by ``|du| / (sqrt(base) + eps)`` (relative change); the lowest ``moment_prune``
  share loads as its base (never 0: Adam divides by its square root), the rest quantized
  and squared back, never below 0.

With ``exact_moments`` the moments are not encoded here (``encode`` returns None: the caller
stores them losslessly). Chunks under :data:`MIN_ELEMENTS`, chunks holding a NaN or an
infinity, and chunks that need a base and have none stay lossless too.

Payload (``lossy/1``), little-endian. Version 2 (uniform): ``u8 version (2), u8 kind,
u8 width, u8 flags, u32 n, u32 kept, f32 step``, then the keep mask and the index frames as
below, the indices zigzag-coded, one byte each (``width`` 1) or two byte planes (low bytes,
then high bytes; ``width`` 2); a kept value is ``float32(q) * step``. Version 1 (codebook):
``u8 version (1), u8 kind, u8 bits, u8 flags, u32 n, u32 kept, u16 codebook size`` then the
fp32 codebook. Both then hold ``u32 length`` + a zstd frame of the keep mask
(``np.packbits``, little bit order; absent when every element is kept or none is) and
``u32 length`` + a zstd frame of the kept elements' indices (version 1: u8 each). Kinds:
1 ``add`` (``out = base``; kept: ``base + value``), 2 ``set`` (``out = 0``; kept:
``value``; no base needed), 3 ``sqrt-add`` (``out = base``; kept:
``max(sqrt(base) + value, 0) ** 2``).

numpy + zstandard only (the service imports this; it never imports torch).
"""

from __future__ import annotations

import json
import math
import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import zstandard

from ckptstore_core.errors import CorruptData, InvalidRequest

__all__ = [
    "LOSSY",
    "MIN_ELEMENTS",
    "Lossy",
    "Pair",
    "Pairing",
    "ParamNames",
    "Role",
    "STEP",
    "decode",
    "encode",
    "pair_tensors",
    "pairing",
]

#: Codec spec of a lossy chain link.
LOSSY = "lossy/1"
#: Chunks with fewer elements stay lossless: biases and norms cost little and matter much.
MIN_ELEMENTS = 4096
#: The default uniform quantization step, relative to the mean magnitude of what is
#: quantized (bench/lossy.py), and the largest step accepted.
STEP = 2.5
MAX_STEP = 16.0

Role = Literal["weight", "exp_avg", "exp_avg_sq"]
Buffer = bytes | bytearray | memoryview

_CODEBOOK, _UNIFORM = 1, 2  # payload versions
_ADD, _SET, _SQRT_ADD = 1, 2, 3
_HEAD = struct.Struct("<BBBBIIH")
_HEAD2 = struct.Struct("<BBBBIIf")
_MAX_INDEX = 1 << 15  # uniform indices: |q| < 2**15, zigzag-coded in two bytes
_LEN = struct.Struct("<I")
_LEVEL = 10  # zstd level of the mask and index frames (small: a few hundred KiB per chunk)
_EPS = np.float32(1e-8)  # Adam's eps scale: the floor of v in the importance
_SQRT_EPS = np.float32(1e-6)
_KMEANS_ITERS = 12

_local = threading.local()


def _cctx() -> zstandard.ZstdCompressor:
    ctx: zstandard.ZstdCompressor | None = _local.__dict__.get("c")
    if ctx is None:
        ctx = _local.c = zstandard.ZstdCompressor(level=_LEVEL)
    return ctx


def _dctx() -> zstandard.ZstdDecompressor:
    ctx: zstandard.ZstdDecompressor | None = _local.__dict__.get("d")
    if ctx is None:
        ctx = _local.d = zstandard.ZstdDecompressor()
    return ctx


# -- parameters ------------------------------------------------------------------------


@dataclass(frozen=True)
class Lossy:
    """Parameters of a lossy save (JSON: :meth:`to_json` / :meth:`from_json`).

    ``weight_prune``: the share (0 <= x < 1) of each chunk's nonzero weight residuals dropped
    (lowest importance first); ``moment_prune``: the same for ``exp_avg`` (set to 0) and
    ``exp_avg_sq`` (kept at the base); ``step``: the uniform quantization step relative to
    the mean magnitude of the kept values (0 < x <= 16), or None for the k-means codebook
    of ``bits`` index bits (1-8; ``2**bits`` fp32 entries per chunk); ``exact_moments``:
    the moments stay lossless (only weights are lossy).

    The defaults are the archival setting bench/lossy.py measured (docs/lossy.md#benchmark),
    for checkpoints kept to evaluate: every weight residual kept (dropping half of them cost
    +2.4% and +23% eval loss on the two bench runs) and quantized uniformly at 2.5 times the
    mean magnitude, 99.9% of the moments pruned (the eval loss never sees them): >= 40x
    fewer bytes than the raw fp32 state with every checkpoint within +0.5% of its original's
    eval loss on both runs. Training resumed from such a checkpoint drifts (about 2%):
    :attr:`RESUMABLE` is the setting it resumed within 1% from.
    """

    #: The resume-safe preset: a finer step and 80% of the moments pruned, from which
    #: training resumed within 1% of the uninterrupted run on both bench runs, at 14x-22x.
    RESUMABLE: ClassVar[Lossy]

    weight_prune: float = 0.0
    moment_prune: float = 0.999
    bits: int = 4
    exact_moments: bool = False
    step: float | None = STEP

    def __post_init__(self) -> None:
        for field in ("weight_prune", "moment_prune"):
            value = getattr(self, field)
            if type(value) not in (int, float) or not 0.0 <= value < 1.0:
                raise InvalidRequest(f"lossy {field} must be a number in [0, 1), got {value!r}")
            object.__setattr__(self, field, float(value))
        if type(self.bits) is not int or not 1 <= self.bits <= 8:
            raise InvalidRequest(f"lossy bits must be an integer in 1..8, got {self.bits!r}")
        if type(self.exact_moments) is not bool:
            raise InvalidRequest(
                f"lossy exact_moments must be true or false, got {self.exact_moments!r}"
            )
        if self.step is not None:
            if type(self.step) not in (int, float) or not 0.0 < self.step <= MAX_STEP:
                raise InvalidRequest(
                    f"lossy step must be null or a number in (0, {MAX_STEP:g}], got {self.step!r}"
                )
            object.__setattr__(self, "step", float(self.step))

    def to_json(self) -> dict[str, object]:
        return {
            "weight_prune": self.weight_prune,
            "moment_prune": self.moment_prune,
            "bits": self.bits,
            "exact_moments": self.exact_moments,
            "step": self.step,
        }

    @classmethod
    def from_json(cls, obj: object) -> Lossy:
        """``True`` -> the defaults; an object with any of the fields (the others default);
        a JSON text of either. Anything else: :class:`InvalidRequest`."""
        if isinstance(obj, str | bytes):
            try:
                obj = json.loads(obj)
            except ValueError as exc:
                raise InvalidRequest(f"lossy parameters are not JSON: {exc}") from None
        if obj is True:
            return cls()
        if isinstance(obj, Lossy):
            return obj
        if not isinstance(obj, Mapping):
            raise InvalidRequest(f"lossy must be true or an object of parameters, got {obj!r}")
        known = {"weight_prune", "moment_prune", "bits", "exact_moments", "step"}
        unknown = sorted(str(k) for k in obj if k not in known)
        if unknown:
            raise InvalidRequest(f"unknown lossy parameter(s) {unknown}; known: {sorted(known)}")
        return cls(**{str(k): v for k, v in obj.items()})


Lossy.RESUMABLE = Lossy(moment_prune=0.8, step=0.5)


# -- chunks ----------------------------------------------------------------------------


def encode(
    role: Role,
    raw: np.ndarray,
    base: np.ndarray | None,
    v_prev: np.ndarray | None,
    params: Lossy,
) -> tuple[bytes, np.ndarray] | None:
    """One chunk (float32 1-D arrays, same length). ``raw``: this checkpoint's exact values.
    ``base``: the same chunk (same tensor, same elements) of the parent checkpoint as it
    loads (its reconstruction). ``v_prev``: the parent's reconstructed ``exp_avg_sq`` of the
    paired parameter over the same elements (importance), None when unknown.

    Returns ``(payload, reconstruction)`` or None: store this chunk losslessly (exact
    moments, a chunk too small, non-finite values, or no base where one is needed).
    ``decode(payload, base, len(raw))`` gives exactly ``reconstruction``, bit for bit.
    """
    raw = _f32(raw, "raw")
    n = len(raw)
    if base is not None:
        base = _f32(base, "base")
        if len(base) != n:
            raise ValueError("base chunk length differs from the chunk")
    if v_prev is not None:
        v_prev = _f32(v_prev, "v_prev")
        if len(v_prev) != n or not np.isfinite(v_prev).all():
            v_prev = None
    if role not in ("weight", "exp_avg", "exp_avg_sq"):
        raise ValueError(f"unknown role {role!r}")
    if role != "weight" and params.exact_moments:
        return None
    if n < MIN_ELEMENTS or base is None or not np.isfinite(raw).all():
        return None
    if not np.isfinite(base).all():
        return None
    if role == "weight":
        kind, values = _ADD, raw - base
        if not np.isfinite(values).all():
            return None
        imp = np.abs(values)
        if v_prev is not None:
            imp = imp / np.sqrt(np.maximum(v_prev, np.float32(0)) + _EPS)
        prune = params.weight_prune
    elif role == "exp_avg":
        kind, values = _SET, raw
        imp = np.abs(values)
        if v_prev is not None:
            imp = imp / np.sqrt(np.maximum(v_prev, np.float32(0)) + _EPS)
        prune = params.moment_prune
    else:
        if (raw < 0).any() or (base < 0).any():
            return None  # not a second moment
        root = np.sqrt(base)
        kind, values = _SQRT_ADD, np.sqrt(raw) - root
        imp = np.abs(values) / (root + _SQRT_EPS)
        prune = params.moment_prune
    mask = _keep(imp, prune)
    kept = values[mask]
    if params.step is None:
        codebook, idx = _quantize(kept, params.bits)
        payload = _pack(kind, params.bits, n, mask, codebook, idx)
        return payload, _apply(kind, base, mask, codebook[idx], n)
    step, q = _quantize_uniform(kept, params.step)
    payload = _pack_uniform(kind, n, mask, step, q)
    return payload, _apply(kind, base, mask, _levels(step, q), n)


def decode(payload: Buffer, base: Buffer | np.ndarray | None, n: int) -> np.ndarray:
    """The chunk a :func:`encode` payload stands for: float32, ``n`` elements, a new array.
    :class:`CorruptData` for a payload that does not parse or does not fit ``n``/``base``."""
    kind, mask, values = _unpack(payload, n)
    b: np.ndarray | None = None
    if base is not None:
        b = np.frombuffer(base, np.float32) if not isinstance(base, np.ndarray) else base
        if b.dtype != np.float32 or b.ndim != 1 or len(b) != n:
            raise CorruptData(f"lossy chunk of {n} elements on a base of another size")
    if b is None and kind != _SET:
        raise CorruptData("lossy chunk without its base")
    return _apply(kind, b, mask, values, n)


def _f32(a: np.ndarray, what: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != np.float32 or a.ndim != 1:
        raise ValueError(f"{what} must be a 1-D float32 array")
    return a


def _keep(imp: np.ndarray, prune: float) -> np.ndarray:
    """The elements to keep: the ``1 - prune`` share of the nonzero importances, largest
    first (a tie at the threshold keeps all its elements)."""
    nonzero = imp > 0
    count = int(np.count_nonzero(nonzero))
    k = math.ceil((1.0 - prune) * count)
    if k <= 0:
        return np.zeros(len(imp), bool)
    if k >= count:
        return nonzero
    threshold = np.partition(imp[nonzero], count - k)[count - k]
    keep: np.ndarray = imp >= threshold
    return keep


def _quantize(
    values: np.ndarray, bits: int, levels: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """A float32 codebook of at most ``levels`` (default ``2**bits``) entries (1-D k-means:
    quantile start, fixed iterations, float64 means) and each value's nearest entry (u8)."""
    k = levels or 1 << bits
    if not len(values):
        return np.zeros(0, np.float32), np.zeros(0, np.uint8)
    xs = np.sort(values.astype(np.float64))
    n = len(xs)
    distinct = np.unique(xs)
    if len(distinct) <= k:
        centres = distinct
    else:
        centres = np.unique(xs[((np.arange(k) + 0.5) * n / k).astype(np.int64)])
        csum = np.concatenate([[0.0], np.cumsum(xs)])
        for _ in range(_KMEANS_ITERS):
            cuts = np.concatenate([[0], np.searchsorted(xs, (centres[1:] + centres[:-1]) / 2), [n]])
            counts = np.diff(cuts)
            sums = csum[cuts[1:]] - csum[cuts[:-1]]
            filled = counts > 0
            centres = np.unique(sums[filled] / counts[filled])
    codebook = np.unique(centres.astype(np.float32))
    mids = (codebook[1:].astype(np.float64) + codebook[:-1]) / 2
    idx = np.searchsorted(mids, values.astype(np.float64)).astype(np.uint8)
    return codebook, idx


def _quantize_uniform(values: np.ndarray, rel: float) -> tuple[np.float32, np.ndarray]:
    """Uniform scalar quantization: the step ``rel * mean(|values|)`` (float32), doubled
    until every index fits :data:`_MAX_INDEX`, and each value's nearest multiple of it
    (int64 indices). The entropy coder (zstd) then spends few bits on the many small
    indices: at equal bytes far less error than a fixed-size codebook on the heavy-tailed
    residuals of training."""
    if not len(values):
        return np.float32(1), np.zeros(0, np.int64)
    xs = values.astype(np.float64)
    mean = float(np.abs(xs).mean())
    step = np.float32(rel * mean) if mean > 0 else np.float32(1)
    if not np.isfinite(step) or step <= 0:  # underflow of a tiny mean
        step = np.float32(np.finfo(np.float32).tiny)
    top = float(np.abs(xs).max())
    while top / float(step) > _MAX_INDEX - 1:
        step = np.float32(step * 2)
    q = np.rint(xs / np.float64(step)).astype(np.int64)
    return step, q


def _levels(step: np.float32, q: np.ndarray) -> np.ndarray:
    """The values uniform indices stand for: ``float32(q) * step``, one correctly rounded
    float32 product each (``q`` is exact in float32: ``|q| <= 2**15``)."""
    out: np.ndarray = q.astype(np.float32) * np.float32(step)
    return out


def _apply(
    kind: int, base: np.ndarray | None, mask: np.ndarray | None, values: np.ndarray, n: int
) -> np.ndarray:
    """The reconstruction: the one routine both encode and decode use. ``mask`` None means
    every element is kept."""
    if kind == _SET:
        out = np.zeros(n, np.float32)
        if mask is None:
            out[:] = values
        else:
            out[mask] = values
        return out
    assert base is not None
    out = base.astype(np.float32, copy=True)
    b = out if mask is None else out[mask]
    if kind == _ADD:
        new = b + values
    else:
        new = np.sqrt(b) + values
        new = np.maximum(new, np.float32(0))
        new = new * new
    if mask is None:
        out[:] = new
    else:
        out[mask] = new
    return out


def _pack(
    kind: int, bits: int, n: int, mask: np.ndarray, codebook: np.ndarray, idx: np.ndarray
) -> bytes:
    kept = len(idx)
    parts = [_HEAD.pack(_CODEBOOK, kind, bits, 0, n, kept, len(codebook))]
    parts.append(codebook.astype("<f4").tobytes())
    parts += _mask_and_index_frames(mask, kept, n, idx.tobytes())
    return b"".join(parts)


def _mask_and_index_frames(mask: np.ndarray, kept: int, n: int, index: bytes) -> list[bytes]:
    cctx = _cctx()
    mask_frame = (
        b"" if kept in (0, n) else cctx.compress(np.packbits(mask, bitorder="little").tobytes())
    )
    idx_frame = cctx.compress(index) if kept else b""
    return [_LEN.pack(len(mask_frame)), mask_frame, _LEN.pack(len(idx_frame)), idx_frame]


def _pack_uniform(kind: int, n: int, mask: np.ndarray, step: np.float32, q: np.ndarray) -> bytes:
    """Version 2: the step instead of a codebook; indices zigzag-coded (0, -1, 1, -2, ...
    -> 0, 1, 2, 3, ...), one byte each when they fit, else two byte planes (low bytes of
    all, then high bytes: zstd finds the high plane mostly zeros)."""
    zz = np.where(q >= 0, 2 * q, -2 * q - 1)
    width = 1 if not len(zz) or int(zz.max()) < 256 else 2
    if width == 1:
        index = zz.astype(np.uint8).tobytes()
    else:
        index = np.ascontiguousarray(zz.astype("<u2").view(np.uint8).reshape(-1, 2).T).tobytes()
    head = _HEAD2.pack(_UNIFORM, kind, width, 0, n, len(q), float(step))
    return b"".join([head, *_mask_and_index_frames(mask, len(q), n, index)])


def _frame(body: memoryview, pos: int, size: int, what: str) -> tuple[bytes, int]:
    if pos + _LEN.size > len(body):
        raise CorruptData(f"lossy chunk: truncated {what} length")
    (length,) = _LEN.unpack_from(body, pos)
    pos += _LEN.size
    frame = body[pos : pos + length]
    if len(frame) != length:
        raise CorruptData(f"lossy chunk: truncated {what}")
    if not length:
        return b"", pos
    try:
        if zstandard.frame_content_size(frame) != size:
            raise CorruptData(f"lossy chunk: the {what} does not hold {size} bytes")
        data = _dctx().decompress(frame, allow_extra_data=False)
    except (zstandard.ZstdError, ValueError) as exc:
        raise CorruptData(f"lossy chunk: the {what} does not decode: {exc}") from exc
    if len(data) != size:
        raise CorruptData(f"lossy chunk: the {what} does not hold {size} bytes")
    return data, pos + length


def _unpack(payload: Buffer, n: int) -> tuple[int, np.ndarray | None, np.ndarray]:
    """(kind, keep mask or None for all, the kept elements' values), every field checked."""
    body = memoryview(payload).cast("B")
    if len(body) < 1:
        raise CorruptData("lossy chunk: truncated header")
    if body[0] == _CODEBOOK:
        kind, kept, pos, width, values_of = _codebook_head(body, n)
    elif body[0] == _UNIFORM:
        kind, kept, pos, width, values_of = _uniform_head(body, n)
    else:
        raise CorruptData(f"lossy chunk: unknown version {body[0]}")
    mask_data, pos = _frame(body, pos, (n + 7) // 8 if 0 < kept < n else 0, "keep mask")
    idx_data, pos = _frame(body, pos, kept * width, "index stream")
    if pos != len(body):
        raise CorruptData(f"lossy chunk: {len(body) - pos} bytes after the index stream")
    if 0 < kept < n:
        if not mask_data:
            raise CorruptData("lossy chunk: missing keep mask")
        bits_ = np.unpackbits(np.frombuffer(mask_data, np.uint8), count=n, bitorder="little")
        mask: np.ndarray | None = bits_.view(bool)
        if int(np.count_nonzero(bits_)) != kept:
            raise CorruptData("lossy chunk: the keep mask does not hold its count")
    else:
        mask = None if kept == n else np.zeros(n, bool)
    if kept and not idx_data:
        raise CorruptData("lossy chunk: missing index stream")
    if not kept:
        return kind, mask, np.zeros(0, np.float32)
    return kind, mask, values_of(np.frombuffer(idx_data, np.uint8))


#: a payload's header, read: (kind, kept, position after it, bytes per index, the function
#: from the index stream to the kept elements' values)
_Head = tuple[int, int, int, int, Callable[[np.ndarray], np.ndarray]]


def _codebook_head(body: memoryview, n: int) -> _Head:
    """Version 1's header and codebook."""
    if len(body) < _HEAD.size:
        raise CorruptData("lossy chunk: truncated header")
    _, kind, bits, flags, count, kept, size = _HEAD.unpack_from(body)
    if kind not in (_ADD, _SET, _SQRT_ADD) or flags:
        raise CorruptData(f"lossy chunk: unknown kind/flags {kind}/{flags}")
    if count != n or kept > n or not 1 <= bits <= 8 or size > (1 << bits):
        raise CorruptData(f"lossy chunk header ({count}, {kept}, {bits}, {size}) for {n} elements")
    if (kept > 0) != (size > 0):
        raise CorruptData("lossy chunk: kept elements without a codebook or vice versa")
    pos = _HEAD.size
    cb = np.frombuffer(body[pos : pos + 4 * size], "<f4")
    if len(cb) != size:
        raise CorruptData("lossy chunk: truncated codebook")
    if not np.isfinite(cb).all():
        raise CorruptData("lossy chunk: non-finite codebook entry")
    levels = cb.astype(np.float32)

    def values_of(idx: np.ndarray) -> np.ndarray:
        if int(idx.max()) >= len(levels):
            raise CorruptData("lossy chunk: index past the codebook")
        out: np.ndarray = levels[idx]
        return out

    return kind, kept, pos + 4 * size, 1, values_of


def _uniform_head(body: memoryview, n: int) -> _Head:
    """Version 2's header."""
    if len(body) < _HEAD2.size:
        raise CorruptData("lossy chunk: truncated header")
    _, kind, width, flags, count, kept, step = _HEAD2.unpack_from(body)
    if kind not in (_ADD, _SET, _SQRT_ADD) or flags or width not in (1, 2):
        raise CorruptData(f"lossy chunk: unknown kind/width/flags {kind}/{width}/{flags}")
    if count != n or kept > n:
        raise CorruptData(f"lossy chunk header ({count}, {kept}) for {n} elements")
    if not math.isfinite(step) or step <= 0:
        raise CorruptData(f"lossy chunk: step {step!r}")

    def values_of(planes: np.ndarray) -> np.ndarray:
        zz = planes.astype(np.int64)
        if width == 2:
            zz = zz[:kept] + (zz[kept:] << 8)
        return _levels(np.float32(step), np.where(zz & 1, -(zz >> 1) - 1, zz >> 1))

    return kind, kept, _HEAD2.size, width, values_of


# -- pairing ---------------------------------------------------------------------------
#
# Which fp32 tensor is the weight whose Adam moments ``optimizer/state/<key>`` holds. A wrong
# pairing must be impossible and a missed one visible (issue 30): a weight is paired only
# where the state (or the caller) proves which one it is, every other fp32 weight stays
# exact and is counted as such in the checkpoint's listing (:class:`Pairing`).
#
# What proves it, per optimizer ``state_dict`` found in the state:
#
# * FQN keys (``torch.distributed.checkpoint.state_dict``): the key names the parameter;
# * integer ids with ``param_names`` in the ``param_groups`` (torch records them for an
#   optimizer built from ``named_parameters()``): id -> name, exact;
# * integer ids named by the caller (``ckptstore.param_names`` in the header's metadata,
#   :class:`ParamNames`, computed by the client from the live model and optimizer): the
#   same, for the one optimizer of the state whose groups have the sizes named;
# * integer ids alone: a parameter whose moments' shape no other parameter of that
#   optimizer has, and that exactly one fp32 weight of the state has. Order is no proof:
#   groups (decay/no-decay, per layer) list the ids in any order.
#
# A name is matched to the fp32 tensor under that key in the mapping that holds every name
# of the optimizer (the model's ``state_dict``), if exactly one mapping does; else to the one
# tensor under that key in the whole state, if there is one. A weight two optimizers claim,
# or whose moments do not have its shape, stays exact.

#: Buffers that sit among a module's fp32 parameters in ``model.state_dict()`` and are
#: not parameters (BatchNorm's running statistics): never weights, never lossy.
_BUFFER_NAMES = ("running_mean", "running_var")
_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Pair:
    """A weight and its Adam moments (tensor names); moments None: weights-only pruning."""

    weight: str
    exp_avg: str | None
    exp_avg_sq: str | None


@dataclass(frozen=True)
class ParamNames:
    """What the caller says about the state's parameters (``ckptstore.param_names``): per
    optimizer, per param group, the name (``named_parameters()``) of each parameter in
    ``params`` order (None: not the model's), every parameter name of the model (its
    weights without moments: frozen parameters), and the tensor (its name in the save) that
    is the parameter itself, where the state holds the live parameter (then no other
    mapping holding the same names, an EMA copy say, makes it ambiguous). JSON:
    ``{"optimizers": [[[name|null, ...], ...], ...], "params": [name, ...],
    "tensors": {name: tensor name}}``."""

    optimizers: tuple[tuple[tuple[str | None, ...], ...], ...] = ()
    params: tuple[str, ...] = ()
    tensors: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> dict[str, object]:
        return {
            "optimizers": [[list(g) for g in groups] for groups in self.optimizers],
            "params": list(self.params),
            "tensors": dict(self.tensors),
        }

    @classmethod
    def from_json(cls, text: str | bytes) -> ParamNames:
        """Parsed from the metadata's text; InvalidRequest for anything else."""
        bad = InvalidRequest(
            'ckptstore.param_names must be {"optimizers": [[[name|null, ...], ...], ...], '
            '"params": [name, ...], "tensors": {name: tensor name}}'
        )
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):
            raise bad from None
        if not isinstance(obj, dict) or not set(obj) <= {"optimizers", "params", "tensors"}:
            raise bad
        optimizers, params = obj.get("optimizers", []), obj.get("params", [])
        tensors = obj.get("tensors", {})
        if not isinstance(tensors, dict) or not all(isinstance(t, str) for t in tensors.values()):
            raise bad
        if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
            raise bad
        if not isinstance(optimizers, list):
            raise bad
        out = []
        for groups in optimizers:
            if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
                raise bad
            if not all(n is None or isinstance(n, str) for g in groups for n in g):
                raise bad
            out.append(tuple(tuple(g) for g in groups))
        return cls(tuple(out), tuple(params), tuple(tensors.items()))


@dataclass(frozen=True)
class Pairing:
    """What :func:`pairing` found: the paired weights (with their moments, or without:
    weights-only pruning), the fp32 weights left exact, and how the state was read
    (``layout``, for the checkpoint's listing and the warning of a save that paired
    nothing)."""

    pairs: list[Pair]
    exact: list[str]
    layout: str
    optimizer: bool  # the state holds an optimizer state_dict
    nbytes: Mapping[str, int]  # of each weight named above

    def summary(self) -> dict[str, object]:
        """The listing's ``pairing``: how many weights (and their bytes) were paired with
        moments, paired without, and left exact, the layout, and whether the state holds
        an optimizer."""
        with_m = [p.weight for p in self.pairs if p.exp_avg is not None]
        without = [p.weight for p in self.pairs if p.exp_avg is None]
        out: dict[str, object] = {}
        for key, names in (("with_moments", with_m), ("without_moments", without)):
            out[key] = len(names)
            out[f"{key}_bytes"] = sum(self.nbytes[n] for n in names)
        out["exact"] = len(self.exact)
        out["exact_bytes"] = sum(self.nbytes[n] for n in self.exact)
        out["layout"] = self.layout
        out["optimizer"] = self.optimizer
        return out

    @property
    def paired_nothing(self) -> bool:
        """An optimizer is there, yet no weight was paired with its moments."""
        return self.optimizer and not any(p.exp_avg is not None for p in self.pairs)


@dataclass
class _Leaf:
    name: str  # the tensor's name
    key: object  # its key in the mapping that holds it (None in a list)
    parent: int  # id of the mapping holding it (its index in the walk)
    inside: tuple[int, ...]  # the mappings on its path (walk indices)


@dataclass
class _Optimizer:
    index: int  # walk index of the optimizer's mapping
    path: str  # where it sits in the state (keys joined with "/")
    groups: list[list[object]]  # each param group's "params", in order (ints or FQNs)
    names: list[list[str | None]] | None  # each group's "param_names", where all have them
    state: dict[object, dict[str, str]]  # key -> {"exp_avg": name, "exp_avg_sq": name, ...}

    @property
    def params(self) -> list[object]:
        return [p for g in self.groups for p in g]


def _items(node: object) -> list[tuple[object, object]] | None:
    """A tagged mapping's (key, value) pairs (keys decoded where plain), else None."""
    if isinstance(node, dict) and node.get("t") in ("dict", "odict", "counter"):
        items = node.get("v")
        if isinstance(items, list):
            return [(kv[0], kv[1]) for kv in items if isinstance(kv, list) and len(kv) == 2]
    return None


def _sequence(node: object) -> list[object] | None:
    if isinstance(node, list):
        return node
    if isinstance(node, dict) and node.get("t") == "tuple" and isinstance(node.get("v"), list):
        out: list[object] = node["v"]
        return out
    return None


def _tensor_name(node: object) -> str | None:
    if isinstance(node, dict) and node.get("t") in ("tensor", "ndarray"):
        name = node.get("n")
        return name if isinstance(name, str) else None
    return None


def _key(key: object) -> object:
    """A skeleton key as the state had it: ints stay ints (``{"t": "int"}`` beyond 2**53
    is no parameter id)."""
    return key if isinstance(key, str | int) and not isinstance(key, bool) else None


class _Walk:
    """The skeleton's tensor leaves in order, and its optimizer ``state_dict``s."""

    def __init__(self, root: object) -> None:
        self.leaves: list[_Leaf] = []
        self.optimizers: list[_Optimizer] = []
        self._count = 0
        self._visit(root, None, -1, (), "")

    def _visit(
        self, node: object, key: object, parent: int, inside: tuple[int, ...], path: str
    ) -> None:
        name = _tensor_name(node)
        if name is not None:
            self.leaves.append(_Leaf(name, key, parent, inside))
            return
        items = _items(node)
        if items is not None:
            index = self._count
            self._count += 1
            opt = _optimizer(index, path, items)
            if opt is not None:
                self.optimizers.append(opt)
            for k, v in items:
                self._visit(v, _key(k), index, (*inside, index), f"{path}/{k}".lstrip("/"))
            return
        seq = _sequence(node)
        if seq is not None:
            for i, v in enumerate(seq):
                self._visit(v, None, parent, inside, f"{path}/{i}".lstrip("/"))


def _fields(node: object) -> dict[str, object] | None:
    items = _items(node)
    return None if items is None else {k: v for k, v in items if isinstance(k, str)}


def _optimizer(index: int, path: str, items: list[tuple[object, object]]) -> _Optimizer | None:
    """An optimizer's ``state_dict`` (a mapping with ``state`` and ``param_groups``)."""
    fields = {k: v for k, v in items if isinstance(k, str)}
    state_items = _items(fields.get("state"))
    groups = _sequence(fields.get("param_groups"))
    if state_items is None or groups is None:
        return None
    params: list[list[object]] = []
    names: list[list[str | None]] | None = []
    for group in groups:
        g = _fields(group)
        ids = None if g is None else _sequence(g.get("params"))
        if g is None or ids is None:
            return None
        params.append([_key(p) for p in ids])
        group_names = _sequence(g.get("param_names"))
        if names is not None and group_names is not None and len(group_names) == len(ids):
            names.append([n if isinstance(n, str) else None for n in group_names])
        else:
            names = None
    state: dict[object, dict[str, str]] = {}
    for key, entry in state_items:
        entry_items = _items(entry)
        if entry_items is None:
            continue
        found = {k: _tensor_name(v) for k, v in entry_items if isinstance(k, str)}
        state[_key(key)] = {k: n for k, n in found.items() if n is not None}
    return _Optimizer(index, path, params, names if groups else None, state)


class _Pairer:
    """One :func:`pairing` (see the comment above :class:`Pair`)."""

    def __init__(
        self,
        tensors: Sequence[tuple[str, str, tuple[int, ...]]],
        walk: _Walk,
        names: ParamNames | None,
    ) -> None:
        self.info = {name: (dtype, tuple(shape)) for name, dtype, shape in tensors}
        self.walk = walk
        self.names = names or ParamNames()
        inside = {o.index for o in walk.optimizers}
        seen: set[str] = set()
        #: fp32 weights outside every optimizer (first mention), in state order
        self.weights: list[_Leaf] = []
        for leaf in walk.leaves:
            if leaf.name in seen or any(i in inside for i in leaf.inside):
                continue
            seen.add(leaf.name)
            key = leaf.key if isinstance(leaf.key, str) else ""
            if self.f32(leaf.name) and not key.endswith(_BUFFER_NAMES):
                self.weights.append(leaf)
        self.by_tensor = {leaf.name: leaf for leaf in self.weights}
        self.caller = self._caller_names()

    def f32(self, name: str | None) -> bool:
        return name is not None and self.info.get(name, ("", ()))[0] == "F32"

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info[name][1]

    def _caller_names(self) -> dict[int, list[list[str | None]]]:
        """The caller's names per optimizer (walk index): for each named optimizer, the one
        integer-keyed optimizer of the state whose groups have its sizes, if only one has."""
        out: dict[int, list[list[str | None]]] = {}
        for groups in self.names.optimizers:
            sizes = [len(g) for g in groups]
            fits = [
                o
                for o in self.walk.optimizers
                if [len(g) for g in o.groups] == sizes and all(isinstance(p, int) for p in o.params)
            ]
            if len(fits) == 1 and fits[0].index not in out:
                out[fits[0].index] = [list(g) for g in groups]
        return out

    def _by_name(self, names: list[str]) -> dict[str, _Leaf]:
        """Each name's weight: the tensor the caller says is that parameter; else the one
        under that key in the mapping holding all the names found, if one mapping does; else
        the one under that key in the whole state, if only one."""
        told = {n: self.by_tensor[t] for n, t in self.names.tensors if t in self.by_tensor}
        holders: dict[str, list[_Leaf]] = {}
        for leaf in self.weights:
            if isinstance(leaf.key, str):
                holders.setdefault(leaf.key, []).append(leaf)
        wanted = [n for n in names if n in holders and n not in told]
        out = {n: told[n] for n in names if n in told}
        if not wanted:
            return out
        common = set.intersection(*({leaf.parent for leaf in holders[n]} for n in wanted))
        if len(common) == 1:
            (parent,) = common
            out |= {n: next(x for x in holders[n] if x.parent == parent) for n in wanted}
        else:
            out |= {n: holders[n][0] for n in wanted if len(holders[n]) == 1}
        return out

    def _by_shape(self, opt: _Optimizer) -> dict[object, _Leaf]:
        """Integer ids alone: the ids whose moments' shape is the optimizer's only one of
        that shape, matched to the state's only fp32 weight of that shape."""
        ids: dict[tuple[int, ...], list[object]] = {}
        for key in opt.params:
            m = opt.state.get(key, {}).get("exp_avg")
            if m is not None and m in self.info:
                ids.setdefault(self.shape(m), []).append(key)
        leaves: dict[tuple[int, ...], list[_Leaf]] = {}
        for leaf in self.weights:
            leaves.setdefault(self.shape(leaf.name), []).append(leaf)
        return {
            keys[0]: leaves[shape][0]
            for shape, keys in ids.items()
            if len(keys) == 1 and len(leaves.get(shape, [])) == 1
        }

    def match(self, opt: _Optimizer) -> tuple[dict[object, _Leaf], str]:
        """The optimizer's parameters (their keys in ``state``) matched to weights, and how."""
        where = f"optimizer {opt.path or '(the root)'!r}"
        groups = f"{len(opt.groups)} param group{'s' * (len(opt.groups) != 1)}"
        keys = opt.params
        if keys and all(isinstance(k, str) for k in keys):
            found = self._by_name([str(k) for k in keys])
            return {k: found[k] for k in keys if isinstance(k, str) and k in found}, (
                f"{where}: FQN keys, {groups}"
            )
        named = opt.names
        how = "integer ids with param_names"
        if named is None and opt.index in self.caller:
            named, how = self.caller[opt.index], "integer ids named by the caller"
        if named is not None:
            by_id = {
                k: n
                for ids, ns in zip(opt.groups, named, strict=True)
                for k, n in zip(ids, ns, strict=True)
                if n is not None
            }
            found = self._by_name(list(by_id.values()))
            return {
                k: found[n] for k, n in by_id.items() if n in found
            }, f"{where}: {how}, {groups}"
        return self._by_shape(opt), (
            f"{where}: integer ids without param_names, {groups} (paired by unique shapes "
            "only: pass the model and optimizer to the save, or build the optimizer from "
            "named_parameters())"
        )

    def run(self) -> Pairing:
        nbytes = {leaf.name: 4 * math.prod(self.shape(leaf.name)) for leaf in self.weights}
        if not self.walk.optimizers:
            pairs = [Pair(leaf.name, None, None) for leaf in self.weights]
            return Pairing(pairs, [], "no optimizer (weights only)", False, nbytes)
        claims: dict[str, list[Pair | None]] = {}
        layouts = []
        for opt in self.walk.optimizers:
            matched, layout = self.match(opt)
            layouts.append(layout)
            for key, leaf in matched.items():
                claims.setdefault(leaf.name, []).append(self._pair(leaf.name, opt, key))
        for leaf in self._by_name(list(self.names.params)).values():  # the caller's model's
            claims.setdefault(leaf.name, [Pair(leaf.name, None, None)])
        pairs, exact = [], []
        for leaf in self.weights:
            found = claims.get(leaf.name, [])
            if len(found) == 1 and found[0] is not None:
                pairs.append(found[0])
            else:  # unclaimed, claimed twice, or moments that do not fit it
                exact.append(leaf.name)
        return Pairing(pairs, exact, "; ".join(layouts), True, nbytes)

    def _pair(self, weight: str, opt: _Optimizer, key: object) -> Pair | None:
        """The weight with the moments of ``key``; without any if it has no Adam state (a
        frozen parameter); None if its moments cannot be this weight's."""
        state = opt.state.get(key, {})
        m, v = state.get("exp_avg"), state.get("exp_avg_sq")
        if m is None or v is None:  # no Adam state (frozen, or another optimizer)
            return Pair(weight, None, None)
        if not all(self.f32(x) and self.shape(x) == self.shape(weight) for x in (m, v)):
            return None
        return Pair(weight, m, v)


def pairing(
    tensors: Sequence[tuple[str, str, tuple[int, ...]]],
    skeleton: object,
    names: ParamNames | str | None = None,
) -> Pairing:
    """Which F32 weights go with which Adam moments, torch-free, from the tensor names
    ``(name, dtype, shape)``, the parsed skeleton JSON (``{"v": 1, "root": ...}``, its
    root, or its text) and what the caller says (``names``: :class:`ParamNames` or its JSON
    text, ``ckptstore.param_names``); see the comment above :class:`Pair` for what proves a
    pair. Without an optimizer in the state every fp32 weight is paired without moments
    (weights-only pruning). Weights: the fp32 tensors outside every optimizer, BatchNorm
    running statistics excepted; every one is either in ``pairs`` or in ``exact``."""
    if isinstance(skeleton, str | bytes):
        skeleton = json.loads(skeleton)
    if isinstance(skeleton, dict) and "root" in skeleton and "t" not in skeleton:
        skeleton = skeleton["root"]
    if isinstance(names, str):
        names = ParamNames.from_json(names)
    return _Pairer(tensors, _Walk(skeleton), names).run()


def pair_tensors(
    tensors: Sequence[tuple[str, str, tuple[int, ...]]],
    skeleton: object,
    names: ParamNames | str | None = None,
) -> list[Pair]:
    """The pairs of :func:`pairing` alone."""
    return pairing(tensors, skeleton, names).pairs
