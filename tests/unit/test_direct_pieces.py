"""ckptstore.direct.tensor_pieces: a DCP rank's bytes, back to back in pieces of any size,
cut at its tensors' boundaries into the pipeline's pieces."""

from __future__ import annotations

import pytest

from ckptstore.direct import tensor_pieces

SPECS = [("a", "F32", (3,)), ("empty", "U8", (0,)), ("b", "U8", (5,)), ("c", "I64", (1,))]
DATA = bytes(range(12)) + bytes(range(100, 105)) + bytes(range(200, 208))


@pytest.mark.parametrize("size", [1, 2, 5, 7, 12, 25, 100])
def test_any_cut_of_the_bytes_gives_each_tensor_its_own(size: int) -> None:
    pieces = [DATA[i : i + size] for i in range(0, len(DATA), size)]
    got: dict[int, bytes] = {}
    for p in tensor_pieces(SPECS, pieces):
        assert p.offset == len(got.get(p.index, b""))  # in order, no gap
        got[p.index] = got.get(p.index, b"") + bytes(p.data)
    assert got == {0: DATA[:12], 2: DATA[12:17], 3: DATA[17:]}


def test_more_bytes_than_the_specs_describe_are_refused() -> None:
    with pytest.raises(ValueError, match="more tensor bytes"):
        list(tensor_pieces(SPECS, [DATA + b"x"]))
