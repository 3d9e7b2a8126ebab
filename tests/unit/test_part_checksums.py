"""``ckptstore.parts.tensor_checksums``: the checksums a rank sends before its part's body
(``POST .../parts/{part}/check``) are those the service records, however the bytes are cut."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from ckptstore.parts import tensor_checksums
from ckptstore_core.wire import encode_header


def test_each_tensor_is_hashed_however_its_bytes_are_cut() -> None:
    rng = np.random.default_rng(3)
    arrays = {
        "a": rng.standard_normal(37).astype(np.float32),
        "empty": np.zeros(0, np.float32),
        "b": rng.integers(0, 255, 1001, dtype=np.uint8),
        "c": rng.standard_normal((5, 3)).astype(np.float64),
    }
    codes = {np.float32: "F32", np.uint8: "U8", np.float64: "F64"}
    specs = [(n, codes[a.dtype.type], a.shape) for n, a in arrays.items()]
    _, header = encode_header(specs, {})
    want = {n: xxhash.xxh3_128_hexdigest(a.tobytes()) for n, a in arrays.items()}
    data = b"".join(a.tobytes() for a in arrays.values())
    assert tensor_checksums(header, [data]) == want
    assert tensor_checksums(header, [a.tobytes() for a in arrays.values()]) == want
    for _ in range(20):
        cuts = sorted(rng.integers(0, len(data), 6).tolist())
        pieces = [data[i:j] for i, j in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        assert tensor_checksums(header, pieces) == want
    with pytest.raises(ValueError, match="more than"):
        tensor_checksums(header, [data, b"x"])
    with pytest.raises(ValueError, match="not"):
        tensor_checksums(header, [data[:-1]])
    assert tensor_checksums(encode_header([], {})[1], []) == {}
