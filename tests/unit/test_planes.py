"""Byte-plane kernels: the fused (numba) and numpy implementations agree byte for byte."""

from __future__ import annotations

import importlib.util
import logging
import mmap
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore_core import codec, planes

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def test_fused_kernels_are_used_when_numba_is_installed() -> None:
    # the server extra installs numba; a broken kernel import must not fall back silently
    numba_installed = importlib.util.find_spec("numba") is not None
    assert planes.FUSED is numba_installed


@settings(max_examples=60, deadline=None)
@given(
    itemsize=st.sampled_from([1, 2, 4, 8]),
    mode=st.sampled_from(sorted(planes.MODES.values())),
    data=st.data(),
)
def test_split_and_join_match_the_numpy_reference(
    itemsize: int, mode: int, data: st.DataObject
) -> None:
    n = data.draw(st.integers(0, 300))
    raw_bytes = data.draw(st.binary(min_size=n * itemsize, max_size=n * itemsize))
    # bases near the values (small signed steps) and far from them (random bits)
    near = data.draw(st.booleans())
    raw = np.frombuffer(raw_bytes, UINT[itemsize])
    if near:
        steps = np.frombuffer(data.draw(st.binary(min_size=n, max_size=n)), np.int8)
        base = (raw.astype(np.int64) - steps).astype(raw.dtype)
    else:
        base = np.frombuffer(
            data.draw(st.binary(min_size=len(raw_bytes), max_size=len(raw_bytes))), raw.dtype
        )
    # some elements equal to their base: a zero residual (in every mode but none)
    same = np.frombuffer(data.draw(st.binary(min_size=n, max_size=n)), np.uint8) < 96
    base = np.where(same, raw, base)

    fused = planes.split(raw, base, mode)
    reference = planes.split_numpy(raw, base, mode)
    assert fused.shape == (itemsize, n)
    assert np.array_equal(fused, reference)
    # the same planes with their nonzero elements, counted in the same pass
    with_mask, mask, kept = planes.split_nonzero(raw, base, mode)
    expected_mask, expected_kept = planes.nonzero_elements_numpy(reference)
    assert np.array_equal(with_mask, reference)
    assert np.array_equal(mask, expected_mask)
    assert kept == expected_kept

    start = np.zeros(n, raw.dtype) if mode == planes.MODES["none"] else base.copy()
    for join in (planes.join, planes.join_numpy):
        out = start.copy()
        join(list(fused), out, mode)
        assert np.array_equal(out, raw), join.__name__
        # onto a base read in the same pass, into a buffer holding anything; base untouched
        kept = start.copy()
        fresh = np.full(n, 0xA5, raw.dtype)
        join(list(fused), fresh, mode, kept)
        assert np.array_equal(fresh, raw), join.__name__
        assert np.array_equal(kept, start), join.__name__


@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_planes_hold_the_bytes_of_each_element(itemsize: int) -> None:
    raw = np.arange(1, 6, dtype=UINT[itemsize]) * 0x0101 + 0x7F00
    split = planes.split(raw, None, planes.MODES["none"])
    as_bytes = raw.view(np.uint8).reshape(-1, itemsize)
    for i in range(itemsize):
        assert split[i].tobytes() == as_bytes[:, i].tobytes()


def test_zigzag_keeps_small_negative_steps_in_the_low_plane() -> None:
    base = np.array([1000, 1000, 1000, 1000], np.uint32)
    raw = base + np.array([1, -1, 2, -2], np.int64).astype(np.uint32)
    split = planes.split(raw, base, planes.MODES["zsub"])
    assert split[0].tolist() == [2, 1, 4, 3]
    assert not split[1:].any()


def test_kernels_accept_bytes_bytearray_and_mmap_views() -> None:
    raw = np.random.default_rng(3).integers(0, 2**32, 1000, dtype=np.uint32)
    base = raw ^ 5
    expected = planes.split_numpy(raw, base, planes.MODES["xor"])
    m = mmap.mmap(-1, raw.nbytes)
    m[:] = raw.tobytes()
    for source in (raw.tobytes(), bytearray(raw.tobytes()), m):
        view = np.frombuffer(source, np.uint32)
        assert np.array_equal(planes.split(view, base, planes.MODES["xor"]), expected)
        out = base.copy()
        planes.join([np.frombuffer(bytes(p), np.uint8) for p in expected], out, 3)
        assert np.array_equal(out, raw)


def test_a_single_plane_payload_decodes_for_wide_items() -> None:
    # a payload may hold one plane with the elements' bytes in order (planes1)
    raw = np.arange(1000, dtype=np.uint32).tobytes()
    payload = struct.pack("<B", 1) + struct.pack("<BI", 0, len(raw)) + raw
    out = codec.decode_chunk(
        "none/1|planes1/1|zstd/1", payload, None, 4, len(raw), codec.checksum(raw)
    )
    assert out == raw


def test_bf16_rounding_matches_the_numpy_reference_and_torch() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    edges = [0, 1, 0x7FFF, 0x8000, 0x8001, 0x18000, 0x3F807FFF, 0x3F808000, 0x7F7FFFFF]
    edges += [0x7F800000, 0xFF800000, 0xFFFF7FFF, 0xFFFFFFFF, 0x80000000]
    values = np.concatenate(
        [np.array(edges, np.uint32), rng.integers(0, 2**32, 100_000, np.uint32)]
    )
    fused = planes.round_bf16(values)
    assert fused.dtype == np.uint16
    assert np.array_equal(fused, planes.round_bf16_numpy(values))
    finite = np.isfinite(values.view(np.float32))
    expected = torch.from_numpy(values.view(np.float32)[finite].copy()).to(torch.bfloat16)
    assert np.array_equal(fused[finite], expected.view(torch.int16).numpy().view(np.uint16))


def test_the_service_warns_when_it_runs_the_numpy_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from ckptstore_service.runtime import Runtime
    from ckptstore_service.settings import Settings

    monkeypatch.setattr(planes, "FUSED", False)
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        rt = Runtime.open(Settings(data_dir=tmp_path))
    rt.close()
    assert "numba is not installed" in caplog.text


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(0, 2000),
    density=st.sampled_from([0.0, 0.001, 0.05, 0.5, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_sparse_pack_matches_the_numpy_reference_and_unpacks(
    n: int, density: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    plane = np.where(rng.random(n) < density, rng.integers(1, 256, n), 0).astype(np.uint8)
    count, stream = planes.sparse_pack(plane)
    ref_count, ref_stream = planes.sparse_pack_numpy(plane)
    assert (count, stream.tobytes()) == (ref_count, ref_stream.tobytes())
    assert count == np.count_nonzero(plane)
    for unpack in (planes.sparse_unpack, planes.sparse_unpack_numpy):
        out = np.full(n, 7, np.uint8)  # stale bytes are overwritten
        assert unpack(stream, count, out)
        assert np.array_equal(out, plane), unpack.__name__


def test_sparse_gaps_of_255_and_more_are_escaped() -> None:
    plane = np.zeros(2000, np.uint8)
    plane[[254, 254 + 256, 254 + 256 + 511, 1999]] = [1, 2, 3, 4]
    count, stream = planes.sparse_pack(plane)
    # gaps 254, 255, 510, 977 -> 254 | 255 0 | 255 255 0 | 255 255 255 212, then the values
    expected = [254, 255, 0, 255, 255, 0, 255, 255, 255, 212, 1, 2, 3, 4]
    assert (count, stream.tolist()) == (4, expected)


@pytest.mark.parametrize(
    ("stream", "count", "n"),
    [
        ([255], 1, 300),  # a gap that never ends
        ([5, 9], 1, 3),  # a value past the end of the plane
        ([0, 0, 9], 1, 4),  # two gaps for one value
        ([0, 9], 2, 4),  # one gap for two values
        ([], 1, 4),  # nothing at all
    ],
)
def test_malformed_sparse_streams_are_rejected(stream: list[int], count: int, n: int) -> None:
    data = np.array(stream, np.uint8)
    for unpack in (planes.sparse_unpack, planes.sparse_unpack_numpy):
        assert not unpack(data, count, np.empty(n, np.uint8)), unpack.__name__


@settings(max_examples=60, deadline=None)
@given(
    itemsize=st.sampled_from([1, 2, 4, 8]),
    n=st.integers(0, 1500),
    row=st.integers(1, 300),
    share=st.floats(0, 1),
    seed=st.integers(0, 2**32 - 1),
)
def test_runs_kernels_match_the_numpy_reference(
    itemsize: int, n: int, row: int, share: float, seed: int
) -> None:
    # rows of elements with a zero residual (untouched embedding rows) among others
    rng = np.random.default_rng(seed)
    rows = np.repeat(rng.random(n // row + 1) < share, row)[:n]
    residual = (rng.integers(0, 256, (itemsize, n)) * rows).astype(np.uint8)
    mask = residual.any(axis=0)
    for nonzero in (planes.nonzero_elements, planes.nonzero_elements_numpy):
        found, kept_count = nonzero(residual)
        assert np.array_equal(found, mask), nonzero.__name__
        assert kept_count == int(mask.sum()), nonzero.__name__
    runs = planes.element_runs(mask)
    assert np.array_equal(runs, planes.element_runs_numpy(mask))
    assert int(runs[1::2].sum()) == int(mask.sum())
    kept = planes.compact(residual, runs)
    assert np.array_equal(kept, planes.compact_numpy(residual, runs))
    base = rng.integers(0, 256, n * itemsize).astype(np.uint8).view(UINT[itemsize])
    for mode in planes.MODES.values():
        expected = base.copy()
        planes.join(list(residual), expected, mode)  # the full planes, zeros included
        for join_runs in (planes.join_runs, planes.join_runs_numpy):
            out = base.copy()
            join_runs(list(kept), runs, out, mode)
            assert np.array_equal(out, expected), (join_runs.__name__, mode)
            # onto a base read in the same pass (its gaps copied), into a buffer of garbage
            fresh = np.full(n, 0xA5, base.dtype)
            join_runs(list(kept), runs, fresh, mode, _readonly(base))
            assert np.array_equal(fresh, expected), (join_runs.__name__, mode)


def _readonly(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


_SPECIAL_F32 = [
    0x00000000,  # +0
    0x80000000,  # -0
    0x00000001,  # smallest subnormal
    0x807FFFFF,  # largest negative subnormal
    0x00800000,  # smallest normal: times a factor below 1 it becomes subnormal
    0x7F7FFFFF,  # largest finite: times a factor above 1 it overflows
    0x7F800000,  # +inf
    0xFF800000,  # -inf
    0x7FC00000,  # quiet NaN
    0x7FA00001,  # signalling NaN with a payload
    0xFFC01234,  # negative NaN with a payload
]


@settings(max_examples=80, deadline=None)
@given(
    values=st.lists(
        st.one_of(st.sampled_from(_SPECIAL_F32), st.integers(0, 2**32 - 1)), max_size=300
    ),
    factor=st.floats(
        min_value=2.0**-100, max_value=2.0**100, allow_nan=False, allow_infinity=False, width=32
    ),
)
def test_scale_matches_the_numpy_reference_and_keeps_special_values(
    values: list[int], factor: float
) -> None:
    bits = int(np.array([factor], "<f4").view("<u4")[0])
    base = np.array(values, np.uint32)
    fused, reference = base.copy(), base.copy()
    planes.scale(fused, bits)
    planes.scale_numpy(reference, bits)
    assert fused.tobytes() == reference.tobytes()
    f = base.view("<f4")
    with np.errstate(all="ignore"):
        product = (f * np.float32(factor)).view("<u4")
    normal = [0 < (v >> 23) & 0xFF < 255 for v in base.tolist()]
    normal_product = [0 < (v >> 23) & 0xFF < 255 for v in product.tolist()]
    for i, v in enumerate(base.tolist()):
        # IEEE products where both are normal numbers; every other element as it was
        want = int(product[i]) if normal[i] and normal_product[i] else v
        assert int(fused[i]) == want, (hex(v), factor)


@pytest.mark.parametrize("fused", [True, False])
def test_scale_does_not_depend_on_flush_to_zero(fused: bool) -> None:
    # torch.set_flush_denormal sets FTZ/DAZ for the thread: products and inputs that are
    # subnormal would come out differently, so scale leaves those elements alone
    torch = pytest.importorskip("torch")
    local = np.random.default_rng(5)
    tiny = np.float32(np.finfo(np.float32).tiny)
    values = np.concatenate(
        [
            local.uniform(0.5, 4, 1000).astype(np.float32) * tiny,  # around the smallest normal
            local.standard_normal(1000).astype(np.float32),
            np.array(_SPECIAL_F32, np.uint32).view(np.float32),
        ]
    ).view(np.uint32)
    run = planes.scale if fused else planes.scale_numpy
    factor = int(np.array([0.7], "<f4").view("<u4")[0])
    plain = values.copy()
    run(plain, factor)
    if not torch.set_flush_denormal(True):
        pytest.skip("no flush-to-zero mode on this CPU")
    try:
        flushed = values.copy()
        run(flushed, factor)
    finally:
        torch.set_flush_denormal(False)
    assert flushed.tobytes() == plain.tobytes()
    assert (plain != values).sum() > 1000  # the normal elements were scaled


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 3000),
    factor=st.sampled_from([0.9, 0.999, 0.5, 1.0, 1.0000001, 3.0, -2.0, 1e-39]),
    changed=st.floats(0.0, 1.0),
    special=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_scale_factor_matches_the_numpy_reference(
    n: int, factor: float, changed: float, special: bool, seed: int
) -> None:
    """The factor found for a chunk decides its codec, so the kernel must find exactly the
    reference's: rows that only decayed (``base * factor``) among others that moved."""
    local = np.random.default_rng(seed)
    base = local.standard_normal(n).astype(np.float32)
    with np.errstate(all="ignore"):
        raw = base * np.float32(factor)
    moved = local.random(n) < changed
    raw[moved] = local.standard_normal(int(moved.sum())).astype(np.float32)
    if special:  # zeros, infinities, NaNs and subnormals are left out of the ratios
        raw[::7] = 0
        base[::11] = np.inf
        base[::13] = np.nan
        raw[::17] = np.float32(1e-40)
    stride = max(1, n // 256)
    args = (raw.view(np.uint32), base.view(np.uint32), stride, 2.0**-19, 32, 8)
    found = planes.scale_factor(*args)
    assert found == planes.scale_factor_numpy(*args)
    if found is not None:  # a normal fp32 other than 1
        assert found != 0x3F800000 and 0 < (found >> 23) & 0xFF < 255


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=9000), flip=st.integers(-1, 8999), offset=st.integers(0, 7))
def test_equal_finds_any_one_byte_that_differs(data: bytes, flip: int, offset: int) -> None:
    """A chunk equal to its base is stored as ``ref``: one differing byte anywhere (the
    8-byte words, the tail, any 4 KiB stretch), at any alignment, must be seen."""
    other = bytearray(data)
    if 0 <= flip < len(data):
        other[flip] ^= 0x40
    # the second array at an odd address: views of a body's pieces need not be aligned
    holder = bytearray(offset + len(other))
    holder[offset:] = other
    a = np.frombuffer(data, np.uint8)
    b = np.frombuffer(memoryview(holder)[offset:], np.uint8)
    assert planes.equal(a, b) == (bytes(data) == bytes(other))
    assert not planes.equal(a, b[:-1]) or len(a) == 0
