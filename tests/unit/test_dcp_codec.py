"""ckptstore.dcp without a service: DCP Metadata <-> JSON, checkpoint ids, shard names,
pickling of the writer and reader, and full tensors from shards (the service's
assembly, then the client's nesting)."""

from __future__ import annotations

import json
import pickle
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItemType

from ckptstore.dcp import (
    CkptStoreReader,
    CkptStoreWriter,
    StorageInfo,
    bytes_name,
    full_state,
    grid_cuts,
    metadata_from_json,
    metadata_to_json,
    parse_checkpoint_id,
    part_name,
    shard_name,
)
from ckptstore.state import dtype_to_wire, tensor_bytes, tensor_from_bytes
from ckptstore_core.dcp_layout import METADATA_KEY
from ckptstore_core.errors import CorruptData, InvalidRequest
from ckptstore_core.wire import tensor_nbytes
from support.states import assert_same_state


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "half": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "flag": torch.tensor(True),
        "step": 7,
        "name": "run-a",
    }


def _planned(state: dict[str, Any]) -> tuple[Metadata, list[Any]]:
    """DCP's own global plan and metadata of ``state`` (one rank), storage as our writer's."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    plans, metadata = planner.create_global_plan([planner.create_local_plan()])
    items = plans[0].items
    storage = {}
    for item in items:
        if item.type == WriteItemType.BYTE_IO:
            storage[item.index] = StorageInfo("rank-0", bytes_name(item.index.fqn))
        else:
            assert item.tensor_data is not None
            name = shard_name(item.index.fqn, item.tensor_data.chunk.offsets)
            storage[item.index] = StorageInfo("rank-0", name)
    metadata.storage_data = storage
    metadata.version = "1.0.0"
    metadata.storage_meta = StorageMeta(checkpoint_id="run/3", save_id="abc", modules=["m"])
    return metadata, items


def test_metadata_round_trips_through_json() -> None:
    metadata, _ = _planned(_state())
    text = metadata_to_json(metadata)
    json.loads(text)  # plain JSON
    back = metadata_from_json(text)
    assert back == metadata
    assert list(back.state_dict_metadata) == list(metadata.state_dict_metadata)
    assert list(back.planner_data) == list(metadata.planner_data)
    assert back.planner_data["optim.param_groups.0.lr"] == ("optim", "param_groups", 0, "lr")
    assert metadata_to_json(back) == text


def test_sharded_metadata_and_odd_properties_round_trip() -> None:
    props = TensorProperties(
        dtype=torch.float8_e4m3fn,
        layout=torch.strided,
        requires_grad=True,
        memory_format=torch.channels_last,
        pin_memory=True,
    )
    chunks = [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([3, 8])),
        ChunkStorageMetadata(torch.Size([3, 0]), torch.Size([3, 8])),
        ChunkStorageMetadata(torch.Size([6, 0]), torch.Size([0, 8])),  # an empty shard
    ]
    metadata = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(props, torch.Size([6, 8]), chunks),
            "scalar": TensorStorageMetadata(TensorProperties(), torch.Size([]), []),
            "blob": BytesStorageMetadata(),
        },
        storage_data={
            MetadataIndex("w", [3, 0]): StorageInfo("rank-1", "w@3,0"),
            MetadataIndex("blob"): StorageInfo("rank-0", "blob@bytes"),
        },
    )
    back = metadata_from_json(metadata_to_json(metadata))
    assert back == metadata
    w = back.state_dict_metadata["w"]
    assert isinstance(w, TensorStorageMetadata)
    assert w.properties.memory_format == torch.channels_last and w.properties.pin_memory
    assert isinstance(w.size, torch.Size) and isinstance(w.chunks[1].offsets, torch.Size)
    assert back.storage_data[MetadataIndex("w", [3, 0])] == StorageInfo("rank-1", "w@3,0")
    assert back.planner_data is None and back.storage_meta is None and back.version is None


def test_what_has_no_json_form_is_refused_never_pickled() -> None:
    metadata, _ = _planned(_state())
    metadata.planner_data = {"x": object()}
    with pytest.raises(TypeError, match="no JSON form"):
        metadata_to_json(metadata)
    metadata, _ = _planned(_state())
    metadata.storage_data = {MetadataIndex("x"): "somebody else's"}
    with pytest.raises(TypeError, match="not ckptstore's"):
        metadata_to_json(metadata)


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        '{"v": 2, "state_dict": []}',
        '{"v": 1, "state_dict": [["w", {"t": "tensor", "dtype": "float99"}]]}',
        '{"v": 1, "state_dict": [["w", {"t": "other"}]]}',
        '{"v": 1, "state_dict": [["w", {"t": "bytes"}], ["w", {"t": "bytes"}]]}',
        '{"v": 1, "state_dict": [], "planner_data": [["w", [1.5]]]}',
        '{"v": 1, "state_dict": [], "storage_data": [["w", [-1], "p", "n"]]}',
    ],
)
def test_malformed_metadata_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError, match="DCP metadata"):
        metadata_from_json(text)


def test_shard_names_are_stable_and_never_collide_with_bytes() -> None:
    assert shard_name("model.w", torch.Size([0, 64])) == "model.w@0,64"
    assert shard_name("step", torch.Size([])) == "step@"
    assert bytes_name("optim.param_groups.0.lr") == "optim.param_groups.0.lr@bytes"
    # what follows the last "@": digits and commas for a shard, "bytes" for bytes
    assert bytes_name("a@0") != shard_name("a", [0])


@pytest.mark.parametrize(
    ("cid", "want"),
    [(5, (None, 5)), ("12", (None, 12)), ("my-run/40", ("my-run", 40))],
)
def test_checkpoint_ids(cid: object, want: tuple[str | None, int]) -> None:
    assert parse_checkpoint_id(cid) == want
    assert CkptStoreWriter.validate_checkpoint_id(cid)  # type: ignore[arg-type]


def test_bad_checkpoint_ids() -> None:
    for bad in (-1, True, "x", "a/b/", "bad name/3", 1.5, "latest"):
        with pytest.raises(InvalidRequest):
            parse_checkpoint_id(bad)
    assert parse_checkpoint_id("run/latest", allow_latest=True) == ("run", "latest")
    assert CkptStoreReader.validate_checkpoint_id("latest")
    assert not CkptStoreWriter.validate_checkpoint_id("latest")


def test_writer_and_reader_pickle_as_plain_config() -> None:
    writer = CkptStoreWriter("http://127.0.0.1:1", "run", retries=2, timeout=3.0)
    writer.reset("other/9")
    writer.set_up_storage_writer(True, rank=3, use_collectives=True)
    copy = pickle.loads(pickle.dumps(writer))
    assert (copy.url, copy.run, copy.step, copy.rank) == ("http://127.0.0.1:1", "other", 9, 3)
    assert copy.client_options == {"retries": 2, "timeout": 3.0}
    assert copy.checkpoint_id == "other/9" and copy.storage_meta() == writer.storage_meta()
    reader = pickle.loads(pickle.dumps(CkptStoreReader("http://h:1", "run", 4)))
    assert reader.checkpoint_id == "run/4"


def test_writer_needs_a_step_and_collectives() -> None:
    with pytest.raises(InvalidRequest, match="no step"):
        CkptStoreWriter("http://h:1", "run").set_up_storage_writer(True)
    with pytest.raises(ValueError, match="use_collectives"):
        CkptStoreWriter("http://h:1", "run", 1).set_up_storage_writer(True, use_collectives=False)


def test_full_state_assembles_shards_and_unflattens() -> None:
    state = _state()
    metadata, items = _planned(state)
    # the stored tensors of a 2-way row split of every 1+-d tensor (what two ranks store)
    flat = {}
    new_sd = {}
    new_storage = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            new_sd[fqn] = md
            index = MetadataIndex(fqn)
            new_storage[index] = metadata.storage_data[index]
            continue
        whole = _lookup(state, metadata.planner_data[fqn])
        if whole.dim() == 0:
            cuts = [(0, None)]
        else:
            half = whole.shape[0] // 2
            cuts = [(0, half), (half, None)]
        chunks = []
        for start, stop in cuts:
            piece = whole if stop is None and start == 0 else whole[start:stop]
            offsets = torch.Size([start] + [0] * (whole.dim() - 1)) if whole.dim() else torch.Size()
            chunks.append(ChunkStorageMetadata(offsets, piece.shape))
            name = shard_name(fqn, offsets)
            flat[name] = piece.clone()
            new_storage[MetadataIndex(fqn, offsets)] = StorageInfo("rank-0", name)
        new_sd[fqn] = TensorStorageMetadata(md.properties, md.size, chunks)
    for item in items:
        if item.type == WriteItemType.BYTE_IO:
            import io

            buf = io.BytesIO()
            torch.save(_lookup(state, metadata.planner_data[item.index.fqn]), buf)
            flat[bytes_name(item.index.fqn)] = torch.frombuffer(
                bytearray(buf.getvalue()), dtype=torch.uint8
            )
    metadata.state_dict_metadata = new_sd
    metadata.storage_data = new_storage
    text = metadata_to_json(metadata)
    back = metadata_from_json(text)
    expected = _stringified(state)
    assert_same_state(expected, full_state(back, _served(text, flat)), same_objects=False)
    only_model = full_state(back, _served(text, flat, prefix="model."))
    assert list(only_model) == ["model"]
    assert_same_state(expected["model"], only_model["model"], same_objects=False)
    with pytest.raises(CorruptData, match=r"model\.0\.weight"):
        full_state(back, {"model.0.weight": torch.zeros(1)})  # not what DCP saved
    del flat[shard_name("model.0.weight", [0, 0])]
    assert _full_view(text, flat) is None  # served as stored


def _full_view(text: str, stored: dict[str, torch.Tensor], prefix: str | None = None) -> Any:
    from ckptstore_core.assemble import full_view
    from ckptstore_service.catalog import TensorInfo

    infos = [
        TensorInfo(i, name, dtype_to_wire(t.dtype), tuple(t.shape), 0, t.nbytes, b"")
        for i, (name, t) in enumerate(stored.items())
    ]
    return full_view({METADATA_KEY: text}, infos, prefix)


def _served(
    text: str, stored: dict[str, torch.Tensor], prefix: str | None = None
) -> dict[str, torch.Tensor]:
    """What the service's GET returns for a DCP checkpoint of ``stored`` pieces: its
    full tensors by DCP name (:mod:`ckptstore_core.assemble`, without I/O)."""
    view = _full_view(text, stored, prefix)
    assert view is not None
    data = view.stream(iter([tensor_bytes(stored[t.name]) for t in view.stored]))
    out = {}
    for name, dtype, shape in view.specs:
        raw = b"".join(bytes(p) for p in _take(data, tensor_nbytes(dtype, shape)))
        out[name] = tensor_from_bytes(bytearray(raw), dtype, shape)
    return out


def _take(data: Any, n: int) -> Any:
    while n:
        piece = next(data)
        n -= len(piece)
        yield piece


def _lookup(state: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        state = state[key] if not isinstance(state, dict) or key in state else state[int(key)]
    return state


def _stringified(state: Any) -> Any:
    """``state`` as DCP keeps it: mapping keys as str, plain dicts."""
    if isinstance(state, dict):
        return {str(k): _stringified(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_stringified(v) for v in state]
    return state


class _Custom:
    pass


def test_full_state_refuses_objects_that_are_no_plain_values() -> None:
    import io

    buf = io.BytesIO()
    torch.save(_Custom(), buf)
    metadata = Metadata(
        state_dict_metadata={"obj": BytesStorageMetadata()},
        storage_data={MetadataIndex("obj"): StorageInfo("rank-0", "obj@bytes")},
    )
    served = {"obj": torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)}
    with pytest.raises(InvalidRequest, match="weights_only"):
        full_state(metadata, served)


def test_grid_cuts_at_cells_of_the_global_tensor() -> None:
    # 16 x 8 fp32: 32-byte rows, a 64-byte grid is 2 rows
    assert grid_cuts((16, 8), 4, 4, 4, 64) == [(4, 2), (6, 2)]
    assert grid_cuts((16, 8), 4, 3, 4, 64) == [(3, 1), (4, 2), (6, 1)]
    assert grid_cuts((16, 8), 4, 0, 16, None) == [(0, 16)]
    assert grid_cuts((16, 8), 4, 0, 16, 1) == [(i, 1) for i in range(16)]  # at least a row
    assert grid_cuts((16, 8), 4, 0, 16, 100) == [(0, 2), (2, 2), (4, 2), (6, 2)] + [
        (r, 2) for r in range(8, 16, 2)
    ]  # the largest power of two of rows within the grid: 3 rows fit, 2 are taken
    assert grid_cuts((16, 0), 4, 0, 16, 64) == [(0, 16)]  # empty rows
    assert grid_cuts((1000,), 2, 500, 500, 4 << 20) == [(500, 500)]  # one cell
    # shards of world 2 and 4 cover whole cells: the same pieces
    four = [c for r in range(0, 16, 4) for c in grid_cuts((16, 8), 4, r, 4, 64)]
    two = [c for r in range(0, 16, 8) for c in grid_cuts((16, 8), 4, r, 8, 64)]
    assert four == two


def test_the_writer_plans_grid_pieces_and_dcp_accepts_them() -> None:
    state = {"w": torch.arange(48.0).reshape(12, 4), "b": torch.ones(3), "n": 5}
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    writer = CkptStoreWriter("http://h:1", "run", 1, grid_bytes=32)  # 2 rows of w
    writer.set_up_storage_writer(True, rank=0)
    local = writer.prepare_local_plan(planner.create_local_plan())
    plans, metadata = planner.create_global_plan([local])  # DCP validates the pieces
    (final,) = writer.prepare_global_plan(plans)
    w = metadata.state_dict_metadata["w"]
    assert isinstance(w, TensorStorageMetadata)
    assert [list(c.offsets) for c in w.chunks] == [[r, 0] for r in range(0, 12, 2)]
    assert len(metadata.state_dict_metadata["b"].chunks) == 1  # type: ignore[union-attr]
    assert final.storage_data.part == part_name(0, writer.save_id) != part_name(0, "other")
    # each piece resolves to its rows of the tensor the planner holds
    from ckptstore.dcp import _resolve

    for item in final.items:
        if item.index.fqn == "w":
            shard = final.storage_data.shards[item.index]
            got = _resolve(planner, item, shard)
            row = item.index.offset[0]
            assert torch.equal(got, state["w"][row : row + 2])
