"""ckptstore_core.dcp_layout (which stored piece is which region of which tensor) and the
service's full view of a DCP checkpoint (ckptstore_core.assemble), torch-free."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from ckptstore_core.assemble import full_view
from ckptstore_core.dcp_layout import FULL, LAYOUT_KEY, METADATA_KEY, parse_layout
from ckptstore_core.errors import CorruptData
from ckptstore_service.catalog import TensorInfo


def _doc(
    tensors: dict[str, tuple[list[int], list[tuple[list[int], list[int]]]]],
    byte_items: tuple[str, ...] = (),
    order: list[str] | None = None,
) -> str:
    """A DCP metadata document (ckptstore's JSON form) of ``tensors``: fqn -> (size,
    [(offsets, sizes)]), each chunk stored as ``fqn@offsets``; ``byte_items`` as ``@bytes``."""
    state: list[Any] = [
        [fqn, {"t": "tensor", "size": size, "chunks": [[o, s] for o, s in chunks]}]
        for fqn, (size, chunks) in tensors.items()
    ]
    state += [[fqn, {"t": "bytes"}] for fqn in byte_items]
    storage: list[Any] = [
        [fqn, o, "rank-0", f"{fqn}@{','.join(map(str, o))}"]
        for fqn, (_, chunks) in tensors.items()
        for o, _ in chunks
    ]
    storage += [[fqn, None, "rank-0", f"{fqn}@bytes"] for fqn in byte_items]
    planner = None if order is None else [[fqn, fqn.split(".")] for fqn in order]
    return json.dumps(
        {"v": 1, "state_dict": state, "planner_data": planner, "storage_data": storage}
    )


def test_entries_come_in_saved_order_with_their_pieces_sorted() -> None:
    text = _doc(
        {"b.w": ([4, 2], [([2, 0], [2, 2]), ([0, 0], [2, 2])]), "a.w": ([3], [([0], [3])])},
        byte_items=("c.lr",),
        order=["c.lr", "a.w", "b.w"],
    )
    entries = parse_layout(text)
    assert [e.fqn for e in entries] == ["c.lr", "a.w", "b.w"]
    assert entries[0].is_bytes and entries[0].pieces[0].name == "c.lr@bytes"
    assert [p.name for p in entries[2].pieces] == ["b.w@0,0", "b.w@2,0"]
    assert entries[2].whole_rows
    columns = parse_layout(_doc({"t": ([2, 4], [([0, 0], [2, 2]), ([0, 2], [2, 2])])}))
    assert not columns[0].whole_rows


@pytest.mark.parametrize(
    ("chunks", "match"),
    [
        ([([0, 0], [2, 2])], "hold 4 of its 8"),  # a gap
        ([([0, 0], [3, 2]), ([2, 0], [1, 2])], "overlap"),  # same count, rows overlap
        ([([0, 0], [4, 1]), ([0, 0], [4, 1])], "overlap"),  # column pieces overlap
        ([([0, 0], [5, 2])], "outside"),
        ([([0], [4])], "chunk"),  # a 1-d chunk of a 2-d tensor
    ],
)
def test_pieces_must_cover_their_tensor_exactly(chunks: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_layout(_doc({"w": ([4, 2], chunks)}))


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        json.dumps({"v": 2, "state_dict": []}),
        json.dumps({"v": 1, "state_dict": {}, "storage_data": []}),
        json.dumps({"v": 1, "state_dict": [["w", {"t": "tensor", "size": [2], "chunks": []}]]}),
        json.dumps(
            {
                "v": 1,
                "state_dict": [["w", {"t": "tensor", "size": [2], "chunks": [[[0], [2]]]}]],
                "storage_data": [],  # no stored tensor for the chunk
            }
        ),
        json.dumps({"v": 1, "state_dict": [["x", {"t": "object"}]], "storage_data": []}),
    ],
)
def test_malformed_documents_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="DCP metadata"):
        parse_layout(text)


def _stored(arrays: dict[str, np.ndarray]) -> list[TensorInfo]:
    codes = {np.dtype("float32"): "F32", np.dtype("uint8"): "U8"}
    return [
        TensorInfo(i, name, codes[a.dtype], a.shape, 0, a.nbytes, b"")
        for i, (name, a) in enumerate(arrays.items())
    ]


def _serve(text: str, arrays: dict[str, np.ndarray], prefix: str | None = None) -> Any:
    view = full_view({METADATA_KEY: text}, _stored(arrays), prefix)
    assert view is not None
    data = b"".join(
        bytes(p) for p in view.stream(iter([arrays[t.name].tobytes() for t in view.stored]))
    )
    return view, data


def test_full_tensors_from_row_and_column_pieces() -> None:
    full = np.arange(24, dtype=np.float32).reshape(4, 6)
    rows = {"r@0,0": full[:1], "r@1,0": full[1:]}
    cols = {"c@0,0": full[:, :4].copy(), "c@0,4": full[:, 4:].copy()}
    text = _doc(
        {
            "r": ([4, 6], [([0, 0], [1, 6]), ([1, 0], [3, 6])]),
            "c": ([4, 6], [([0, 0], [4, 4]), ([0, 4], [4, 2])]),
        },
        byte_items=("lr",),
    )
    arrays = {**rows, **cols, "lr@bytes": np.frombuffer(b"pickled", dtype=np.uint8)}
    view, data = _serve(text, arrays)
    assert view.specs == [("r", "F32", (4, 6)), ("c", "F32", (4, 6)), ("lr", "U8", (7,))]
    assert data == full.tobytes() + full.tobytes() + b"pickled"
    assert view.metadata({METADATA_KEY: text}) == {METADATA_KEY: text, LAYOUT_KEY: FULL}
    only_c, data = _serve(text, arrays, prefix="c")
    assert [s[0] for s in only_c.specs] == ["c"] and data == full.tobytes()


def test_what_does_not_match_is_served_as_stored() -> None:
    text = _doc({"w": ([2, 2], [([0, 0], [2, 2])])})
    good = {"w@0,0": np.zeros((2, 2), np.float32)}
    assert full_view({METADATA_KEY: text}, _stored(good), None) is not None
    for stored in (
        {"w@0,0": np.zeros((2, 3), np.float32)},  # another shape
        {"other": np.zeros((2, 2), np.float32)},  # no such piece
    ):
        assert full_view({METADATA_KEY: text}, _stored(stored), None) is None
    assert full_view({}, _stored(good), None) is None  # no DCP layout
    assert full_view({METADATA_KEY: "{"}, _stored(good), None) is None
    # a full checkpoint pulled and pushed back keeps its layout key: served as stored
    assert full_view({METADATA_KEY: text, LAYOUT_KEY: FULL}, _stored(good), None) is None


def test_a_short_stream_is_corrupt_data() -> None:
    text = _doc({"w": ([2, 2], [([0, 0], [1, 2]), ([1, 0], [1, 2])])})
    arrays = {"w@0,0": np.zeros((1, 2), np.float32), "w@1,0": np.zeros((1, 2), np.float32)}
    view = full_view({METADATA_KEY: text}, _stored(arrays), None)
    assert view is not None
    with pytest.raises(CorruptData, match="do not match its size"):
        list(view.stream(iter([b"\0" * 8])))
