"""Stored chunks that lie: a decode returns the original bytes or raises CorruptData, nothing
else (no other exception, no crash in a kernel, no wrong bytes), whatever the damage."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest

from ckptstore_core.codec import RAW, cast_prediction, decode_chain, encode_chunk, is_delta
from ckptstore_core.errors import CorruptData

Links = list[tuple[str, bytes]]


def _corpus() -> list[tuple[Links, int, bytes, bytes]]:
    """Encoded chunks of every kind: (links, itemsize, raw bytes, checksum)."""
    rng = np.random.default_rng(5)
    n = 1 << 15
    w = rng.standard_normal(n).astype(np.float32)
    drift = w + rng.standard_normal(n).astype(np.float32) * np.float32(1e-3)
    rows = w.copy()
    rows[4096:4352] += np.float32(0.5)
    decayed = np.abs(w) * np.float32(0.999**25)
    decayed[: n // 4] = np.abs(rng.standard_normal(n // 4)).astype(np.float32)
    moments = np.where(rng.random(n // 256)[:, None] < 0.3, w.reshape(-1, 256), 0)
    bf16 = (drift.view(np.uint32) >> 16).astype(np.uint16)
    pred = cast_prediction(drift.tobytes(), "BF16")
    copy = np.frombuffer(pred, np.uint16).copy()
    copy[rng.integers(0, n, 100)] ^= 1
    ints = np.arange(n, dtype=np.int64) * 3
    cases: list[tuple[bytes, bytes | None, int]] = [
        (rng.bytes(4 * n), None, 4),  # raw
        (w.tobytes(), None, 4),  # none, zstd planes
        (drift.tobytes(), w.tobytes(), 4),  # zsub, sparse planes
        (rows.tobytes(), w.tobytes(), 4),  # runs
        (decayed.tobytes(), np.abs(w).tobytes(), 4),  # scale
        (moments.astype(np.float32).tobytes(), None, 4),  # none + runs
        (bf16.tobytes(), None, 2),
        (copy.tobytes(), pred, 2),  # a bf16 copy against its prediction
        ((ints + rng.integers(0, 2, n)).tobytes(), ints.tobytes(), 8),
        ((rng.random(4 * n) < 0.05).astype(np.uint8).tobytes(), None, 1),
    ]
    out = []
    for raw, base, itemsize in cases:
        enc = encode_chunk(raw, base, itemsize)
        links: Links = [(enc.codec, enc.payload)]
        if is_delta(enc.codec):
            assert base is not None
            links.insert(0, (RAW, base))
        out.append((links, itemsize, raw, enc.checksum))
    codecs = {links[-1][0].split("|")[0] for links, *_ in out} | {
        "runs/1" for links, *_ in out if "runs/1" in links[-1][0]
    }
    assert codecs >= {"raw/1", "none/1", "zsub/1", "scale/1", "runs/1"}
    return out


_WORDS = [0, 1, 2, 255, 256, 1 << 16, 1 << 24, (1 << 31) - 1, (1 << 32) - 1]
_SPECS = ["none/1", "sub/1", "zsub/1", "xor/1", "scale/1|zsub/1", "zsub/2", "ref", "raw/1"]


def _mutate_payload(r: random.Random, payload: bytes) -> bytes:
    p = bytearray(payload)
    op = r.randrange(5)
    if op == 0 or len(p) < 16:
        for _ in range(r.randrange(1, 8)):
            if p:
                p[r.randrange(len(p))] ^= 1 << r.randrange(8)
    elif op == 1:
        del p[r.randrange(len(p)) :]
    elif op == 2:
        p += bytes(r.randrange(1, 40))
    else:  # a header word (runs, plane table, sparse counts, scale) near the start
        at = r.randrange(min(len(p) - 4, 64))
        p[at : at + 4] = struct.pack("<I", r.choice(_WORDS))
    return bytes(p)


def _mutate_spec(r: random.Random, spec: str, itemsize: int) -> str:
    parts = spec.split("|")
    op = r.randrange(4)
    if op == 0:
        return "|".join(
            [r.choice(_SPECS)]
            + [p for p in parts if not p.startswith(("scale", "z", "none", "sub", "xor"))]
        )
    if op == 1:
        return (
            "|".join(p for p in parts if p != "runs/1")
            if "runs/1" in parts
            else spec.replace("|planes", "|runs/1|planes")
        )
    if op == 2:
        k = r.choice([1, 2, 3, 4, 8, 16])
        return "|".join(f"planes{k}/{p[-1]}" if p.startswith("planes") else p for p in parts)
    return "|".join(p[:-1] + r.choice("0123") if p.startswith("planes") else p for p in parts)


def test_damaged_chunks_decode_exactly_or_are_corrupt_data() -> None:
    corpus = _corpus()
    r = random.Random(11)
    for i in range(600):
        links, itemsize, raw, digest = r.choice(corpus)
        links = list(links)
        raw_len = len(raw)
        k = r.randrange(len(links))
        spec, payload = links[k]
        what = r.random()
        if what < 0.65:
            links[k] = (spec, _mutate_payload(r, payload))
        elif what < 0.85:
            links[k] = (_mutate_spec(r, spec, itemsize), payload)
        elif what < 0.93:
            itemsize = r.choice([1, 2, 4, 8])
        else:
            raw_len = r.choice([0, raw_len - itemsize, raw_len + itemsize, raw_len // 2])
        try:
            out = decode_chain(links, itemsize, raw_len, digest)
        except CorruptData:
            continue
        assert bytes(out) == raw, f"case {i}: wrong bytes"


@pytest.mark.parametrize(("itemsize", "raw_len"), [(0, 64), (3, 63), (16, 64), (-4, 64), (1, -64)])
def test_item_sizes_and_lengths_from_a_corrupt_catalog_are_corrupt_data(
    itemsize: int, raw_len: int
) -> None:
    raw = np.arange(16, dtype=np.float32).tobytes()
    enc = encode_chunk(raw, None, 4)
    planes1 = encode_chunk(bytes(4096), None, 1)  # one zstd plane
    for links in ([(enc.codec, enc.payload)], [(planes1.codec, planes1.payload)]):
        with pytest.raises(CorruptData):
            decode_chain(links, itemsize, raw_len, enc.checksum)
