"""Byte planes: a chunk's residual split into planes, and planes joined back onto values.

:func:`split` computes the residual of ``raw`` against ``base`` (see :mod:`ckptstore_core.codec` for
the modes) and returns it as a ``(itemsize, n)`` uint8 array whose row ``i`` holds byte ``i`` of
every element. :func:`join` is its inverse: it reads the ``itemsize`` planes back as elements
and applies them to ``out`` -- stores them (``none``), adds them (``sub``), adds their
zigzag-decoded value (``zsub``) or XORs them (``xor``) -- so a chain of deltas decodes in place
on one array. :func:`sparse_pack` / :func:`sparse_unpack` turn a mostly-zero plane into the
list of its nonzero bytes and back; :func:`element_runs`, :func:`compact` and
:func:`join_runs` leave out the elements whose residual is zero; :func:`scale` multiplies fp32
values by a factor (the prediction of the ``scale`` mode).

Two implementations compute the same bytes. With numba installed (the ``server`` extra) each
call is one fused pass, compiled on first use and cached on disk: residual and transposition in
one loop; so is the bf16 rounding that predicts a bf16 copy from its fp32 master. Without
numba, a numpy reference takes several passes. Measured on 4 MiB fp32 chunks on
the 2-core machine: join 0.12-0.19 ms against 1.2-2.2 ms, split 0.4-0.7 ms against 1.3-2.3 ms.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "FUSED",
    "MODES",
    "UINT",
    "compact",
    "compact_numpy",
    "element_runs",
    "element_runs_numpy",
    "equal",
    "is_normal_f32",
    "join",
    "join_numpy",
    "join_runs",
    "join_runs_numpy",
    "round_bf16",
    "round_bf16_numpy",
    "scale",
    "scale_factor",
    "scale_factor_numpy",
    "scale_numpy",
    "sparse_pack",
    "sparse_pack_numpy",
    "sparse_unpack",
    "sparse_unpack_numpy",
    "split",
    "split_nonzero",
    "split_numpy",
    "warm_up",
]

#: Residual modes, as the kernels number them.
MODES = {"none": 0, "sub": 1, "zsub": 2, "xor": 3}
#: The unsigned integer dtype of each element size: residuals are computed on raw bit patterns.
UINT: dict[int, np.dtype[Any]] = {
    1: np.dtype("u1"),
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
    8: np.dtype("<u8"),
}


_GAP_ESCAPE = 255  # a sparse stream's gap byte that continues the gap into the next byte


# -- numpy reference ----------------------------------------------------------------------


def _zigzag(diff: np.ndarray) -> np.ndarray:
    signed = diff.view(diff.dtype.str.replace("u", "i"))
    out: np.ndarray = ((signed << 1) ^ (signed >> (8 * diff.itemsize - 1))).view(diff.dtype)
    return out


def _unzigzag(z: np.ndarray) -> np.ndarray:
    """``(z >> 1) ^ -(z & 1)``, in place on ``z``."""
    signs = np.bitwise_and(z, 1)
    signed = signs.view(z.dtype.str.replace("u", "i"))
    np.negative(signed, out=signed)
    np.right_shift(z, 1, out=z)
    np.bitwise_xor(z, signs, out=z)
    return z


def split_numpy(raw: np.ndarray, base: np.ndarray | None, mode: int) -> np.ndarray:
    values = raw
    if base is None or mode == MODES["none"]:
        pass
    elif mode == MODES["xor"]:
        values = np.bitwise_xor(raw, base)
    else:
        values = np.subtract(raw, base)  # unsigned: wraps modulo 2**bits
        if mode == MODES["zsub"]:
            values = _zigzag(values)
    k = raw.itemsize
    as_bytes = values.view(np.uint8)
    out = np.empty((k, len(raw)), np.uint8)
    for i in range(k):  # one strided copy per plane: ~1.5x faster than a transposed copy
        out[i] = as_bytes[i::k]
    return out


def join_numpy(
    planes: Sequence[np.ndarray], out: np.ndarray, mode: int, base: np.ndarray | None = None
) -> None:
    k = out.itemsize
    if base is not None and mode != MODES["none"]:
        out[:] = base
    if mode == MODES["none"]:
        target = out.view(np.uint8)
        for i, plane in enumerate(planes):
            target[i::k] = plane
        return
    columns = np.empty((len(out), k), np.uint8)
    for i, plane in enumerate(planes):
        columns[:, i] = plane
    values = columns.reshape(-1).view(out.dtype)
    if mode == MODES["xor"]:
        np.bitwise_xor(out, values, out=out)
    else:
        np.add(out, _unzigzag(values) if mode == MODES["zsub"] else values, out=out)


def sparse_pack_numpy(plane: np.ndarray) -> tuple[int, np.ndarray]:
    nonzero = np.flatnonzero(plane)
    gaps = np.diff(nonzero, prepend=-1) - 1
    extra = gaps // _GAP_ESCAPE
    stream = np.full(len(gaps) + int(extra.sum()) + len(nonzero), _GAP_ESCAPE, np.uint8)
    ends = np.cumsum(extra + 1) - 1
    stream[ends] = gaps % _GAP_ESCAPE
    stream[len(stream) - len(nonzero) :] = plane[nonzero]
    return len(nonzero), stream


def sparse_unpack_numpy(stream: np.ndarray, count: int, out: np.ndarray) -> bool:
    gap_len = len(stream) - count
    if gap_len < 0:
        return False
    gaps = stream[:gap_len]
    ends = np.flatnonzero(gaps != _GAP_ESCAPE)
    if len(ends) != count or (gap_len and gaps[-1] == _GAP_ESCAPE):
        return False
    positions = np.cumsum(gaps, dtype=np.int64)[ends] + np.arange(count)
    if count and positions[-1] >= len(out):
        return False
    out[:] = 0
    out[positions] = stream[gap_len:]
    return True


def element_runs_numpy(mask: np.ndarray) -> np.ndarray:
    edges = np.flatnonzero(np.diff(mask.astype(np.int8), prepend=0, append=0))
    starts, ends = edges[0::2], edges[1::2]
    skips = starts - np.concatenate(([0], ends[:-1]))
    return np.stack([skips, ends - starts], axis=1).reshape(-1).astype(np.uint32)


def nonzero_elements_numpy(planes: np.ndarray) -> tuple[np.ndarray, int]:
    mask: np.ndarray = np.bitwise_or.reduce(planes, axis=0) != 0
    return mask, int(np.count_nonzero(mask))


def _run_mask(runs: np.ndarray, n: int) -> np.ndarray:
    skips, lengths = runs[0::2].astype(np.int64), runs[1::2].astype(np.int64)
    ends = np.cumsum(skips + lengths)
    mask = np.zeros(n, bool)
    for start, end in zip(ends - lengths, ends, strict=True):
        mask[start:end] = True
    return mask


def compact_numpy(planes: np.ndarray, runs: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(planes[:, _run_mask(runs, planes.shape[1])])


def join_runs_numpy(
    planes: Sequence[np.ndarray],
    runs: np.ndarray,
    out: np.ndarray,
    mode: int,
    base: np.ndarray | None = None,
) -> None:
    mask = _run_mask(runs, len(out))
    full = np.zeros((len(planes), len(out)), np.uint8)
    for i, plane in enumerate(planes):
        full[i, mask] = plane
    join_numpy(list(full), out, mode, base)


_F32_EXPONENT = 0x7F800000
_F32_ONE = 0x3F800000
_F32_MIN = np.float32(np.finfo(np.float32).tiny)  # smallest normal
_F32_MAX = np.float32(np.finfo(np.float32).max)


def scale_numpy(values: np.ndarray, factor: int) -> None:
    f = values.view("<f4")
    c = np.array([factor], np.uint32).view("<f4")[0]
    with np.errstate(all="ignore"):
        product = f * c
        a, ap = np.abs(f), np.abs(product)
        ok = (a >= _F32_MIN) & (a <= _F32_MAX) & (ap >= _F32_MIN) & (ap <= _F32_MAX)
    np.copyto(f, product, where=ok)


def is_normal_f32(bits: np.ndarray) -> np.ndarray:
    """Which fp32 bit patterns are normal numbers (not zero, subnormal, infinite or NaN)."""
    exponent = bits & np.uint32(_F32_EXPONENT)
    out: np.ndarray = (exponent != 0) & (exponent != _F32_EXPONENT)
    return out


def scale_factor_numpy(
    raw: np.ndarray, base: np.ndarray, stride: int, width: float, at_least: int, share: int
) -> int | None:
    r, b = raw[::stride], base[::stride]
    ok = is_normal_f32(r) & is_normal_f32(b)
    q = np.sort(r[ok].view("<f4").astype(np.float64) / b[ok].view("<f4"))
    if len(q) < at_least:
        return None
    # the densest window of ratios [q, q * (1 + width)]
    counts = np.searchsorted(q, q * (1 + width), "right") - np.arange(len(q))
    i = int(np.argmax(counts))
    if counts[i] < max(at_least, len(q) // share):
        return None
    bits = np.array([np.median(q[i : i + counts[i]])], "<f4").view("<u4")
    if bits[0] == _F32_ONE or not is_normal_f32(bits)[0]:
        return None  # 1 is zsub; the factor must be a normal number
    return int(bits[0])


def round_bf16_numpy(values: np.ndarray) -> np.ndarray:
    out: np.ndarray = ((values + 0x7FFF + ((values >> 16) & 1)) >> 16).astype("<u2")
    return out


# -- numba kernels --------------------------------------------------------------------------


def _split_kernel(raw: Any, base: Any, mode: int, out: Any) -> None:  # pragma: no cover - jit
    n = raw.shape[0]
    k = out.shape[0]
    bits = np.uint64(8 * k)
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> (np.uint64(64) - bits)
    top = bits - np.uint64(1)
    one = np.uint64(1)
    zero = np.uint64(0)
    src = raw
    if mode != 0:  # the residual once, then one contiguous pass per plane (vectorizes)
        src = np.empty_like(raw)
        if mode == 3:
            for i in range(n):
                src[i] = raw[i] ^ base[i]
        elif mode == 1:
            for i in range(n):
                src[i] = (np.uint64(raw[i]) - np.uint64(base[i])) & mask
        else:
            for i in range(n):
                d = (np.uint64(raw[i]) - np.uint64(base[i])) & mask
                src[i] = ((d << one) ^ (zero - (d >> top))) & mask
    for j in range(k):
        row = out[j]
        shift = np.uint64(8 * j)
        for i in range(n):
            row[i] = np.uint8((np.uint64(src[i]) >> shift) & np.uint64(0xFF))


def _split4_kernel(raw: Any, base: Any, mode: int, out: Any, mask: Any) -> int:  # pragma: no cover
    # 4-byte elements (fp32, the bulk of a checkpoint) in one pass, in their own width and
    # with no temporary residual: one loop per mode, so that each vectorizes. On the
    # bench's fine-tune chunks 0.16 core-s less per GB of encode than residual, then planes.
    # The same pass marks the elements whose residual is nonzero and counts them (what
    # the codec's zero runs need): a second pass over the planes cost more than the stores.
    r0, r1, r2, r3 = out[0], out[1], out[2], out[3]
    t = raw.dtype.type
    ff, one, top, zero = t(0xFF), t(1), t(31), t(0)
    kept = 0
    if mode == 0:
        for i in range(raw.shape[0]):
            d = raw[i]
            r0[i], r1[i] = np.uint8(d & ff), np.uint8((d >> t(8)) & ff)
            r2[i], r3[i] = np.uint8((d >> t(16)) & ff), np.uint8(d >> t(24))
            mask[i] = d != zero
            kept += d != zero
    elif mode == 3:
        for i in range(raw.shape[0]):
            d = raw[i] ^ base[i]
            r0[i], r1[i] = np.uint8(d & ff), np.uint8((d >> t(8)) & ff)
            r2[i], r3[i] = np.uint8((d >> t(16)) & ff), np.uint8(d >> t(24))
            mask[i] = d != zero
            kept += d != zero
    elif mode == 1:
        for i in range(raw.shape[0]):
            d = t(raw[i] - base[i])
            r0[i], r1[i] = np.uint8(d & ff), np.uint8((d >> t(8)) & ff)
            r2[i], r3[i] = np.uint8((d >> t(16)) & ff), np.uint8(d >> t(24))
            mask[i] = d != zero
            kept += d != zero
    else:
        for i in range(raw.shape[0]):
            d = t(raw[i] - base[i])
            d = t((d << one) ^ (zero - (d >> top)))
            r0[i], r1[i] = np.uint8(d & ff), np.uint8((d >> t(8)) & ff)
            r2[i], r3[i] = np.uint8((d >> t(16)) & ff), np.uint8(d >> t(24))
            mask[i] = d != zero
            kept += d != zero
    return kept


def _join_kernel(planes: Any, base: Any, out: Any, mode: int) -> None:  # pragma: no cover
    # out = base op the planes' values; ``base`` may be ``out`` itself (in place)
    n = out.shape[0]
    k = len(planes)
    one = np.uint64(1)
    zero = np.uint64(0)
    if mode == 0:
        for i in range(n):
            v = zero
            for j in range(k):
                v |= np.uint64(planes[j][i]) << np.uint64(8 * j)
            out[i] = v
    elif mode == 3:
        for i in range(n):
            v = zero
            for j in range(k):
                v |= np.uint64(planes[j][i]) << np.uint64(8 * j)
            out[i] = base[i] ^ v
    elif mode == 1:
        for i in range(n):
            v = zero
            for j in range(k):
                v |= np.uint64(planes[j][i]) << np.uint64(8 * j)
            out[i] = base[i] + v
    else:
        for i in range(n):
            v = zero
            for j in range(k):
                v |= np.uint64(planes[j][i]) << np.uint64(8 * j)
            out[i] = base[i] + ((v >> one) ^ (zero - (v & one)))


def _sparse_pack_kernel(plane: Any) -> Any:  # pragma: no cover - jit
    n = plane.shape[0]
    count = 0
    for i in range(n):
        count += plane[i] != 0
    where = np.empty(count + 1, np.int64)
    c = 0
    for i in range(n):  # branch-free: always store, advance past nonzero bytes only
        where[c] = i
        c += plane[i] != 0
    # gap bytes: one per nonzero, plus one 255 per 255 zeros in a row (at most n // 255)
    stream = np.empty(2 * count + n // 255 + 1, np.uint8)
    g = 0
    last = -1
    for t in range(count):
        gap = where[t] - last - 1
        while gap >= 255:
            stream[g] = 255
            g += 1
            gap -= 255
        stream[g] = gap
        g += 1
        last = where[t]
    for t in range(count):
        stream[g + t] = plane[where[t]]
    return count, stream[: g + count]


def _sparse_unpack_kernel(stream: Any, count: int, out: Any) -> bool:  # pragma: no cover - jit
    n = out.shape[0]
    gap_len = stream.shape[0] - count
    if gap_len < 0:
        return False
    out[:] = 0
    pos = -1
    j = 0
    gap = 0
    for i in range(gap_len):
        b = stream[i]
        gap += b
        if b != 255:
            pos += gap + 1
            if j >= count or pos >= n:
                return False
            out[pos] = stream[gap_len + j]
            j += 1
            gap = 0
    return j == count and gap == 0


def _compact_kernel(planes: Any, runs: Any, out: Any) -> None:  # pragma: no cover - jit
    for j in range(planes.shape[0]):
        pos = 0
        m = 0
        for r in range(0, runs.shape[0], 2):
            pos += runs[r]
            length = runs[r + 1]
            out[j, m : m + length] = planes[j, pos : pos + length]
            pos += length
            m += length


def _join_runs_kernel(  # pragma: no cover - jit
    planes: Any, runs: Any, base: Any, out: Any, mode: int, gaps: bool
) -> None:
    # out = base op the runs' values; the elements between runs are base's (copied when
    # ``gaps``: ``out`` is not ``base``), or zero in mode none
    k = len(planes)
    one = np.uint64(1)
    zero = np.uint64(0)
    pos = np.uint64(0)
    m = np.uint64(0)
    # unsigned offsets spare numba's negative-index checks: the element loops vectorize
    for r in range(0, runs.shape[0], 2):
        skip = np.uint64(runs[r])
        length = np.uint64(runs[r + 1])
        if mode == 0:
            out[pos : pos + skip] = 0
        elif gaps:
            out[pos : pos + skip] = base[pos : pos + skip]
        pos += skip
        if mode == 0:
            for t in range(length):
                v = zero
                for j in range(k):
                    v |= np.uint64(planes[j][m + t]) << np.uint64(8 * j)
                out[pos + t] = v
        elif mode == 3:
            for t in range(length):
                v = zero
                for j in range(k):
                    v |= np.uint64(planes[j][m + t]) << np.uint64(8 * j)
                out[pos + t] = base[pos + t] ^ v
        elif mode == 1:
            for t in range(length):
                v = zero
                for j in range(k):
                    v |= np.uint64(planes[j][m + t]) << np.uint64(8 * j)
                out[pos + t] = base[pos + t] + v
        else:
            for t in range(length):
                v = zero
                for j in range(k):
                    v |= np.uint64(planes[j][m + t]) << np.uint64(8 * j)
                out[pos + t] = base[pos + t] + ((v >> one) ^ (zero - (v & one)))
        pos += length
        m += length
    if mode == 0:
        out[pos:] = 0
    elif gaps:
        out[pos:] = base[pos:]


def _runs_kernel(mask: Any) -> Any:  # pragma: no cover - jit
    n = mask.shape[0]
    count = np.int64(mask[0]) if n else 0
    for i in range(1, n):  # starts of runs: vectorizes
        count += mask[i] > mask[i - 1]
    runs = np.empty(2 * count, np.uint32)
    i = 0
    end = 0
    for r in range(0, 2 * count, 2):
        while not mask[i]:
            i += 1
        start = i
        while i < n and mask[i]:
            i += 1
        runs[r] = start - end
        runs[r + 1] = i - start
        end = i
    return runs


def _nonzero_kernel(planes: Any, mask: Any) -> int:  # pragma: no cover - jit
    n = planes.shape[1]
    for i in range(n):  # one pass per plane: vectorizes
        mask[i] = planes[0, i] != 0
    for j in range(1, planes.shape[0]):
        for i in range(n):
            mask[i] |= planes[j, i] != 0
    kept = 0
    for i in range(n):
        kept += mask[i]
    return kept


def _scale_kernel(values: Any, factor: Any, lo: Any, hi: Any) -> None:  # pragma: no cover
    for i in range(values.shape[0]):  # branch-free: vectorizes
        x = values[i]
        p = x * factor
        a = abs(x)
        b = abs(p)
        # false for zero, subnormals, infinities and NaNs, of either
        ok = (a >= lo) & (a <= hi) & (b >= lo) & (b <= hi)
        values[i] = p if ok else x


def _scale_factor_kernel(  # pragma: no cover - jit
    raw: Any, base: Any, rf: Any, bf: Any, stride: int, width: float, at_least: int, share: int
) -> Any:
    # scale_factor_numpy's steps, the same float64 operations; -1: none. The sort, the
    # window counts (two pointers) and the median (of the sorted window) by hand: numba's
    # sort, searchsorted and median took 9.8 s to compile, 40% of a first start's kernels
    n = raw.shape[0]
    q = np.empty((n + stride - 1) // stride, np.float64)
    c = 0
    e = np.uint32(_F32_EXPONENT)
    for i in range(0, n, stride):
        x, y = raw[i] & e, base[i] & e
        if x != 0 and x != e and y != 0 and y != e:
            q[c] = np.float64(rf[i]) / np.float64(bf[i])
            c += 1
    if c < at_least:
        return -1
    gap = 1
    while gap < c // 3:
        gap = 3 * gap + 1
    while gap:  # shell sort: np.sort's quicksort costs seconds to compile, and any sort
        for i in range(gap, c):  # of the same numbers gives the same array
            v = q[i]
            j = i
            while j >= gap and q[j - gap] > v:
                q[j] = q[j - gap]
                j -= gap
            q[j] = v
        gap //= 3
    best, count, hi = 0, -c, 0
    for i in range(c):  # the ratios within [q[i], q[i] * (1 + width)]: hi never goes back
        top = q[i] * (1 + width)
        while hi < c and q[hi] <= top:
            hi += 1
        if hi - i > count:
            best, count = i, hi - i
    if count < max(at_least, c // share):
        return -1
    mid = best + count // 2
    median = q[mid] if count % 2 else (q[mid - 1] + q[mid]) / 2
    bits = np.array([median], np.float32).view(np.uint32)[0]
    x = bits & e
    if bits == np.uint32(_F32_ONE) or x == 0 or x == e:
        return -1
    return np.int64(bits)


def _equal_kernel(a: Any, b: Any) -> bool:  # pragma: no cover - jit
    # 4 KiB at a time, stopping at the first that differs
    n = a.shape[0]
    for start in range(0, n, 512):
        same = True
        for i in range(start, min(start + 512, n)):  # vectorizes
            same &= a[i] == b[i]
        if not same:
            return False
    return True


def _bf16_kernel(values: Any, out: Any) -> None:  # pragma: no cover - jit
    for i in range(values.shape[0]):
        v = values[i]
        out[i] = np.uint16((v + np.uint32(0x7FFF) + ((v >> np.uint32(16)) & np.uint32(1))) >> 16)


def _compile() -> tuple[Callable[..., Any], ...] | None:
    try:
        import numba
    except ImportError:
        return None

    def jit(fn: Callable[..., Any], cache: bool) -> Callable[..., Any]:
        compiled: Callable[..., Any] = numba.njit(
            fn, cache=cache, nogil=True, boundscheck=False, error_model="numpy"
        )
        return compiled

    kernels = (
        _split_kernel,
        _join_kernel,
        _bf16_kernel,
        _sparse_pack_kernel,
        _sparse_unpack_kernel,
        _runs_kernel,
        _compact_kernel,
        _join_runs_kernel,
        _scale_kernel,
        _nonzero_kernel,
        _split4_kernel,
        _scale_factor_kernel,
        _equal_kernel,
    )
    try:
        return tuple(jit(k, True) for k in kernels)
    except RuntimeError:  # no writable cache location: compile in every process instead
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return tuple(jit(k, False) for k in kernels)


_KERNELS = _compile()
#: Whether the fused numba kernels are in use.
FUSED = _KERNELS is not None


def _readonly(a: np.ndarray) -> np.ndarray:
    # one array type for every caller (bytes, bytearray, mmap views): one compiled kernel each
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def split(raw: np.ndarray, base: np.ndarray | None, mode: int) -> np.ndarray:
    """The residual of ``raw`` (unsigned ints) against ``base`` as ``(itemsize, n)`` planes."""
    if _KERNELS is None:
        return split_numpy(raw, base, mode)
    return _split_fused(raw, base, mode)[0]


def split_nonzero(
    raw: np.ndarray, base: np.ndarray | None, mode: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """:func:`split`, with :func:`nonzero_elements` of its planes: 4-byte elements in the
    same pass (one read of the chunk, not a second one over its planes)."""
    if _KERNELS is None:
        planes = split_numpy(raw, base, mode)
        return (planes, *nonzero_elements_numpy(planes))
    out, mask, kept = _split_fused(raw, base, mode)
    if mask is None:
        return (out, *nonzero_elements(out))
    return out, mask, kept


def _split_fused(
    raw: np.ndarray, base: np.ndarray | None, mode: int
) -> tuple[np.ndarray, np.ndarray | None, int]:
    # the planes, and for 4-byte elements their nonzero elements (that kernel writes both)
    assert _KERNELS is not None
    out = np.empty((raw.itemsize, len(raw)), np.uint8)
    args = (_readonly(raw), _readonly(raw if base is None else base), mode, out)
    if raw.itemsize != 4:
        _KERNELS[0](*args)
        return out, None, 0
    mask = np.empty(len(raw), np.bool_)
    kept = _KERNELS[10](*args, mask)
    return out, mask, int(kept)


def join(
    planes: Sequence[np.ndarray], out: np.ndarray, mode: int, base: np.ndarray | None = None
) -> None:
    """Apply the values that ``planes`` (``out.itemsize`` uint8 arrays) hold to ``base``
    (``out`` itself when None), into ``out``: a link decoded onto a kept chunk reads it in
    this pass rather than copying it first."""
    if _KERNELS is None:
        join_numpy(planes, out, mode, base)
        return
    source = _readonly(out if base is None else base)
    _KERNELS[1](tuple(_readonly(p) for p in planes), source, out, mode)


def round_bf16(values: np.ndarray) -> np.ndarray:
    """The bf16 bit patterns (uint16) of fp32 bit patterns ``values`` (uint32) rounded to
    nearest even, as mixed-precision training makes its bf16 copies (NaNs may differ)."""
    if _KERNELS is None:
        return round_bf16_numpy(values)
    out = np.empty(len(values), np.uint16)
    _KERNELS[2](_readonly(values), out)
    return out


def sparse_pack(plane: np.ndarray) -> tuple[int, np.ndarray]:
    """A mostly-zero uint8 plane as ``(count, stream)``: ``count`` nonzero bytes, and a
    stream of the gaps before each of them (zero bytes skipped; a gap of 255 or more is
    written as that many 255 bytes, ``gap // 255`` of them, then ``gap % 255``) followed by
    the ``count`` nonzero values."""
    if _KERNELS is None:
        return sparse_pack_numpy(plane)
    count, stream = _KERNELS[3](_readonly(plane))
    return int(count), stream


def sparse_unpack(stream: np.ndarray, count: int, out: np.ndarray) -> bool:
    """Inverse of :func:`sparse_pack` into the uint8 array ``out`` (the plane's length);
    False if ``stream`` is not a well-formed stream of ``count`` values for that length."""
    if _KERNELS is None:
        return sparse_unpack_numpy(stream, count, out)
    return bool(_KERNELS[4](_readonly(stream), count, out))


def element_runs(mask: np.ndarray) -> np.ndarray:
    """The runs of true elements of the bool array ``mask``, as uint32 pairs ``(skip,
    length)``: ``skip`` false elements, then ``length`` true ones (trailing false elements
    are implied)."""
    if _KERNELS is None:
        return element_runs_numpy(mask)
    runs: np.ndarray = _KERNELS[5](_readonly(mask))
    return runs


def nonzero_elements(planes: np.ndarray) -> tuple[np.ndarray, int]:
    """Which columns (elements) of the ``(itemsize, n)`` planes hold a nonzero byte, as a
    bool array, and how many do. (The numba kernel releases the GIL; numpy's reduction and
    count, three passes, hold it.)"""
    if _KERNELS is None:
        return nonzero_elements_numpy(planes)
    mask = np.empty(planes.shape[1], np.bool_)
    kept = _KERNELS[9](_readonly(planes), mask)
    return mask, int(kept)


def compact(planes: np.ndarray, runs: np.ndarray) -> np.ndarray:
    """The columns of the ``(itemsize, n)`` planes that ``runs`` cover, back to back."""
    if _KERNELS is None:
        return compact_numpy(planes, runs)
    out = np.empty((planes.shape[0], int(runs[1::2].sum(dtype=np.int64))), np.uint8)
    _KERNELS[6](_readonly(planes), _readonly(runs), out)
    return out


def join_runs(
    planes: Sequence[np.ndarray],
    runs: np.ndarray,
    out: np.ndarray,
    mode: int,
    base: np.ndarray | None = None,
) -> None:
    """:func:`join` of planes that hold only the elements ``runs`` cover: the others have a
    zero residual (``base``'s, or left as they are; set to zero in mode ``none``). ``runs``
    must fit ``out`` and the planes (the codec checks them)."""
    if _KERNELS is None:
        join_runs_numpy(planes, runs, out, mode, base)
        return
    source = _readonly(out if base is None else base)
    gaps = base is not None  # out is not base: the elements between runs are copied
    _KERNELS[7](tuple(_readonly(p) for p in planes), _readonly(runs), source, out, mode, gaps)


def scale(values: np.ndarray, factor: int) -> None:
    """Multiply the fp32 bit patterns (uint32) ``values`` in place by the normal fp32 whose
    bit pattern is ``factor``, each product rounded to nearest (IEEE). Elements that are, or
    whose product would be, zero, subnormal, infinite or NaN stay as they are: the result
    depends neither on flush-to-zero settings nor on NaN payloads. Only float arithmetic and
    comparisons, no bit casts: the kernel sees a float view."""
    if _KERNELS is None:
        scale_numpy(values, factor)
        return
    c = np.array([factor], np.uint32).view("<f4")[0]
    _KERNELS[8](values.view("<f4"), c, _F32_MIN, _F32_MAX)


def scale_factor(
    raw: np.ndarray, base: np.ndarray, stride: int, width: float, at_least: int, share: int
) -> int | None:
    """The bit pattern of the fp32 factor that maps most of ``base``'s elements onto
    ``raw``'s (fp32 bit patterns, every ``stride``-th element of each), if there is one: the
    median of the densest window ``[q, q * (1 + width)]`` of their ratios, if that window
    holds at least ``at_least`` ratios and ``1 / share`` of those of normal pairs, and the
    factor is a normal number other than 1. One kernel, not a dozen numpy calls on a
    thousand elements each holding the GIL: it runs for every fp32 chunk with a base."""
    if _KERNELS is None:
        return scale_factor_numpy(raw, base, stride, width, at_least, share)
    args = (
        _readonly(raw),
        _readonly(base),
        _readonly(raw.view("<f4")),
        _readonly(base.view("<f4")),
    )
    bits = int(_KERNELS[11](*args, stride, width, at_least, share))
    return None if bits < 0 else bits


def equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether the uint8 arrays ``a`` and ``b`` hold the same bytes: 8 at a time and 4 KiB
    at a stretch, stopping at the first stretch that differs, without the GIL (numpy's
    ``array_equal`` builds a bool array of the whole length first, holding it)."""
    if len(a) != len(b):
        return False
    if _KERNELS is None:
        return bool(np.array_equal(a[:4096], b[:4096]) and np.array_equal(a, b))
    whole = len(a) // 8 * 8
    words = (_readonly(a[:whole].view(np.uint64)), _readonly(b[:whole].view(np.uint64)))
    tail = (_readonly(a[whole:]), _readonly(b[whole:]))
    return bool(_KERNELS[12](*words)) and bool(_KERNELS[12](*tail))


def warm_up() -> None:
    """Compile (or load from the on-disk cache) the kernels for every element size now, so
    the first save or load does not pay for it."""
    for uint in UINT.values():
        raw = np.zeros(8, dtype=uint)
        planes = split(raw, raw, MODES["zsub"])
        join(list(planes), raw.copy(), MODES["zsub"])
        runs = element_runs(nonzero_elements(planes)[0])
        join_runs(list(compact(planes, runs)), runs, raw.copy(), MODES["zsub"])
    round_bf16(np.zeros(8, np.uint32))
    equal(np.zeros(9, np.uint8), np.zeros(9, np.uint8))
    scale_factor(np.zeros(8, np.uint32), np.zeros(8, np.uint32), 1, 2.0**-19, 32, 8)
    scale(np.zeros(8, np.uint32), 0x3F800000)
    count, stream = sparse_pack(np.zeros(8, np.uint8))
    sparse_unpack(stream, count, np.empty(8, np.uint8))
