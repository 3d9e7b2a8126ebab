"""Lossy archival encoding (issue 23): deterministic, bit-exact decode, checksummed chains,
parameters checked. Pairing weights with their moments: test_lossy_pairing.py."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from ckptstore_core import codec, lossy
from ckptstore_core.codec import RAW, checksum, decode_chain, encode_chunk, is_delta
from ckptstore_core.errors import CorruptData, InvalidRequest
from ckptstore_core.lossy import LOSSY, Lossy, decode, encode

N = 1 << 16


def adam_like(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(base weights, new weights, exp_avg, exp_avg_sq) as consecutive Adam checkpoints
    look: small steps, heavy-tailed moments, a stretch of untouched elements."""
    rng = np.random.default_rng(seed)
    w0 = rng.normal(0, 0.02, N).astype(np.float32)
    v = (rng.standard_t(3, N) * 1e-3).astype(np.float32) ** 2
    m = (rng.standard_t(3, N) * 1e-3).astype(np.float32)
    step = (1e-3 * m / (np.sqrt(v) + 1e-8)).astype(np.float32)
    w1 = (w0 - step).astype(np.float32)
    w1[: N // 8] = w0[: N // 8]  # rows that saw no gradient
    return w0, w1, m, v


def test_weight_roundtrip_is_deterministic_and_bit_exact() -> None:
    """The k-means codebook (``step=None``, payload version 1)."""
    w0, w1, _, v = adam_like(1)
    params = Lossy(weight_prune=0.9, step=None)
    first = encode("weight", w1, w0, v, params)
    second = encode("weight", w1.copy(), w0.copy(), v.copy(), params)
    assert first is not None and second is not None
    payload, recon = first
    assert payload == second[0]
    assert recon.tobytes() == second[1].tobytes()
    # decode gives the reconstruction bit for bit, from bytes or an array base
    assert decode(payload, w0.tobytes(), N).tobytes() == recon.tobytes()
    assert decode(memoryview(payload), w0, N).tobytes() == recon.tobytes()
    # pruned elements load as their base exactly; about 10% of the changed ones are kept
    changed = w1 != w0
    moved = recon != w0
    assert not (moved & ~changed).any()
    assert 0.08 < moved.sum() / changed.sum() < 0.12
    # closer to the truth than the base, and small: a mask and 4-bit indices
    assert np.abs(recon - w1).sum() < 0.7 * np.abs(w0 - w1).sum()
    assert len(payload) < 0.05 * w1.nbytes


@pytest.mark.parametrize("rel", [lossy.STEP, 0.05, 4.0])
def test_uniform_weights_are_within_half_a_step(rel: float) -> None:
    """The uniform quantizer (payload version 2): deterministic, decoded bit for bit, every
    element within half a step of the truth, elements that did not change untouched."""
    w0, w1, _, v = adam_like(7)
    w1[-1] = w0[-1] + np.float32(0.5)  # one outlier far in the tail
    params = Lossy(step=rel)
    first = encode("weight", w1, w0, v, params)
    again = encode("weight", w1.copy(), w0.copy(), v.copy(), params)
    assert first is not None and again is not None
    payload, recon = first
    assert payload == again[0] and payload[0] == 2
    assert decode(payload, w0.tobytes(), N).tobytes() == recon.tobytes()
    step = struct.unpack_from("<f", payload, 12)[0]
    r = (w1 - w0).astype(np.float64)
    assert step >= rel * np.abs(r).mean() * (1 - 1e-6)
    err = np.abs((recon.astype(np.float64) - w0) - r)
    assert err.max() <= step / 2 * 1.001 + 1e-7
    assert (recon[: N // 8] == w0[: N // 8]).all()  # unchanged elements stay as they were
    if rel == lossy.STEP:
        assert len(payload) < 0.15 * w1.nbytes
        # finer steps cost more bytes and err less
        fine = encode("weight", w1, w0, v, Lossy(step=0.05))
        assert fine is not None and len(fine[0]) > len(payload)
        assert np.abs(fine[1] - w1).sum() < np.abs(recon - w1).sum()


def test_uniform_moments_roundtrip() -> None:
    _, _, m, v = adam_like(8)
    v1 = (v * np.float32(1.5)).astype(np.float32)
    for role, raw, base in (("exp_avg", m, None), ("exp_avg_sq", v1, v)):
        enc = encode(role, raw, v if base is None else base, v, Lossy(moment_prune=0.5))
        assert enc is not None
        assert decode(enc[0], base, N).tobytes() == enc[1].tobytes()
        assert (enc[1] >= 0).all() or role == "exp_avg"


def test_moments_roundtrip() -> None:
    _, _, m, v = adam_like(2)
    rng = np.random.default_rng(3)
    m1 = (0.5 * m + rng.normal(0, 1e-3, N)).astype(np.float32)
    v1 = (v * rng.uniform(0.5, 2.0, N)).astype(np.float32)
    params = Lossy(moment_prune=0.8, step=None)
    enc_m = encode("exp_avg", m1, m, v, params)
    enc_v = encode("exp_avg_sq", v1, v, v, params)
    assert enc_m is not None and enc_v is not None
    # exp_avg: pruned to 0, kept ones quantized; needs no base to decode
    assert decode(enc_m[0], None, N).tobytes() == enc_m[1].tobytes()
    assert 0.18 < np.count_nonzero(enc_m[1]) / N < 0.22
    # exp_avg_sq: never negative, pruned elements at their base
    recon_v = decode(enc_v[0], v, N)
    assert recon_v.tobytes() == enc_v[1].tobytes()
    assert (recon_v >= 0).all()
    assert 0.75 < np.count_nonzero(recon_v == v) / N < 0.85
    # exact moments: the caller stores them losslessly
    exact = Lossy(exact_moments=True)
    assert encode("exp_avg", m1, m, v, exact) is None
    assert encode("exp_avg_sq", v1, v, v, exact) is None
    assert encode("weight", m1, m, v, exact) is not None


def test_chunks_that_stay_lossless() -> None:
    w0, w1, _, v = adam_like(4)
    params = Lossy()
    assert encode("weight", w1, None, v, params) is None  # no base
    small = lossy.MIN_ELEMENTS - 1
    assert encode("weight", w1[:small], w0[:small], v[:small], params) is None
    bad = w1.copy()
    bad[7] = np.nan
    assert encode("weight", bad, w0, v, params) is None
    with pytest.raises(ValueError):
        encode("weight", w1.astype(np.float64), w0, v, params)  # type: ignore[arg-type]


def test_decode_chain_checks_the_reconstruction() -> None:
    """A lossy link decodes against the chain's result so far and is checked against the
    checksum of the reconstruction; mixed chains (whole, lossy, lossless delta, lossy)
    rebuild exactly."""
    assert is_delta(LOSSY)
    w0, w1, _, v = adam_like(5)
    enc1 = encode("weight", w1, w0, v, Lossy())
    assert enc1 is not None
    payload1, recon1 = enc1
    links: list[tuple[str, codec.Buffer]] = [(RAW, w0.tobytes()), (LOSSY, payload1)]
    out = decode_chain(links, 4, w0.nbytes, checksum(recon1.tobytes()))
    assert bytes(out) == recon1.tobytes()
    with pytest.raises(CorruptData, match="checksum"):
        decode_chain(links, 4, w0.nbytes, checksum(w1.tobytes()))
    # a lossless delta on the reconstruction, then another lossy link
    w2 = (w1 + np.float32(1e-4)).astype(np.float32)
    exact = encode_chunk(w2.tobytes(), recon1.tobytes(), 4)
    assert is_delta(exact.codec)
    enc3 = encode("weight", (w2 * np.float32(1.001)).astype(np.float32), w2, v, Lossy())
    assert enc3 is not None
    chain = [*links, (exact.codec, exact.payload), (LOSSY, enc3[0])]
    out = decode_chain(chain, 4, w0.nbytes, checksum(enc3[1].tobytes()))
    assert bytes(out) == enc3[1].tobytes()
    # through decode_chunk too, and only for 4-byte items
    assert (
        codec.decode_chunk(LOSSY, payload1, w0.tobytes(), 4, w0.nbytes, checksum(recon1))
        == recon1.tobytes()
    )
    with pytest.raises(CorruptData):
        decode_chain([(RAW, w0.tobytes()), (LOSSY, payload1)], 2, w0.nbytes, b"")


def test_corrupt_payloads_are_typed_errors() -> None:
    w0, w1, _, v = adam_like(6)
    enc = encode("weight", w1, w0, v, Lossy())
    assert enc is not None
    payload = enc[0]
    for bad in (payload[:5], payload[:-1], payload + b"\0", b"\x03" + payload[1:]):
        with pytest.raises(CorruptData):
            decode(bad, w0, N)
    # version 2: a bad width, flags, count or step
    nan, zero = struct.pack("<f", float("nan")), struct.pack("<f", 0.0)
    for bad in (
        payload[:2] + b"\x03" + payload[3:],
        payload[:3] + b"\x01" + payload[4:],
        payload[:4] + struct.pack("<I", N + 1) + payload[8:],
        payload[:12] + nan + payload[16:],
        payload[:12] + zero + payload[16:],
    ):
        with pytest.raises(CorruptData):
            decode(bad, w0, N)
    old = encode("weight", w1, w0, v, Lossy(step=None))
    assert old is not None and old[0][0] == 1
    for bad in (old[0][:5], old[0][:-1], old[0] + b"\0"):
        with pytest.raises(CorruptData):
            decode(bad, w0, N)
    with pytest.raises(CorruptData):
        decode(payload, w0, N - 1)  # another length
    with pytest.raises(CorruptData):
        decode(payload, None, N)  # an additive chunk needs its base


def test_the_archival_defaults_and_the_resume_safe_preset() -> None:
    """What bench/lossy.py chose (docs/lossy.md#benchmark): ``lossy=True`` archives (>= 40x
    within +0.5% eval loss), ``Lossy.RESUMABLE`` resumes within 1%; neither is a field."""
    assert Lossy().to_json() == {
        "weight_prune": 0.0,
        "moment_prune": 0.999,
        "bits": 4,
        "exact_moments": False,
        "step": 2.5,
    }
    assert Lossy(moment_prune=0.8, step=0.5) == Lossy.RESUMABLE
    assert Lossy.from_json(Lossy.RESUMABLE.to_json()) == Lossy.RESUMABLE
    assert "RESUMABLE" not in Lossy().to_json()
    with pytest.raises(InvalidRequest, match="unknown lossy parameter"):
        Lossy.from_json({"RESUMABLE": True})


def test_parameters_json() -> None:
    assert Lossy.from_json(True) == Lossy()
    custom = Lossy(weight_prune=0.5, moment_prune=0.25, bits=3, exact_moments=True)
    assert Lossy.from_json(custom.to_json()) == custom
    assert Lossy.from_json(json.dumps(custom.to_json())) == custom
    assert Lossy.from_json({"bits": 2}) == Lossy(bits=2)
    for bad in (
        False,
        None,
        1,
        "[",
        [0.5],
        {"weight_prune": 1.0},
        {"weight_prune": -0.1},
        {"weight_prune": "0.5"},
        {"moment_prune": float("nan")},
        {"bits": 0},
        {"bits": 9},
        {"bits": 4.0},
        {"bits": True},
        {"exact_moments": 1},
        {"prune": 0.5},
    ):
        with pytest.raises(InvalidRequest):
            Lossy.from_json(bad)
