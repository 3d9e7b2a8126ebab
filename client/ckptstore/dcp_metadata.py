"""DCP's :class:`~torch.distributed.checkpoint.metadata.Metadata` as JSON, and a DCP
checkpoint's full state dict from its full tensors: what both :mod:`ckptstore.dcp` (the
storage classes) and :meth:`ckptstore.CheckpointClient.load` (a DCP checkpoint loaded whole)
need, below both of them.

The JSON form (version 1, :func:`metadata_to_json` / :func:`metadata_from_json`) is what a
DCP commit stores under ``"dcp"``: no pickle on the wire or at rest. Imports torch and
``torch.distributed.checkpoint``; nothing of ckptstore above :mod:`ckptstore.state`.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptstore.state import DTYPE_TO_NAME, NAME_TO_DTYPE, tensor_bytes
from ckptstore_core.dcp_layout import FULL, LAYOUT_KEY, METADATA_KEY, parse_chunks
from ckptstore_core.errors import CorruptData, InvalidRequest

__all__ = [
    "StorageInfo",
    "full_state",
    "full_state_if_dcp",
    "metadata_from_json",
    "metadata_to_json",
]

_CODEC_VERSION = 1

# ------------------------------------------------------------------------ Metadata <-> JSON

_LAYOUTS: Mapping[torch.layout, str] = {
    torch.strided: "strided",
    torch.sparse_coo: "sparse_coo",
    torch.sparse_csr: "sparse_csr",
    torch.sparse_csc: "sparse_csc",
    torch.sparse_bsr: "sparse_bsr",
    torch.sparse_bsc: "sparse_bsc",
    torch._mkldnn: "mkldnn",  # type: ignore[attr-defined]
    torch.jagged: "jagged",
}
_MEMORY_FORMATS: Mapping[torch.memory_format, str] = {
    torch.contiguous_format: "contiguous_format",
    torch.channels_last: "channels_last",
    torch.channels_last_3d: "channels_last_3d",
    torch.preserve_format: "preserve_format",
}


@dataclass(frozen=True, slots=True)
class StorageInfo:
    """Where one write item is stored: tensor ``name`` of part ``part``
    (``Metadata.storage_data`` maps each item's :class:`MetadataIndex` to one)."""

    part: str
    name: str


def _ints(value: object, what: str) -> torch.Size:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise ValueError(f"DCP metadata: {what} must be a list of integers >= 0, got {value!r}")
    return torch.Size(value)


def _str(value: object, what: str, *, optional: bool = False) -> Any:
    if (value is None and optional) or isinstance(value, str):
        return value
    raise ValueError(f"DCP metadata: {what} must be a string, got {value!r}")


def _lookup(table: Mapping[Any, str], name: object, what: str) -> Any:
    for key, value in table.items():
        if value == name:
            return key
    raise ValueError(f"DCP metadata: unknown {what} {name!r}")


def _encode_entry(fqn: str, md: object) -> list[object]:
    if isinstance(md, BytesStorageMetadata):
        return [fqn, {"t": "bytes"}]
    if not isinstance(md, TensorStorageMetadata):
        raise TypeError(f"DCP metadata of {fqn!r} is a {type(md).__name__}: no JSON form")
    props = md.properties
    if props.dtype not in DTYPE_TO_NAME:
        raise TypeError(f"{fqn!r}: dtype {props.dtype} has no name in ckptstore's table")
    return [
        fqn,
        {
            "t": "tensor",
            "dtype": DTYPE_TO_NAME[props.dtype],
            "size": list(md.size),
            "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks],
            "layout": _LAYOUTS[props.layout],
            "requires_grad": bool(props.requires_grad),
            "memory_format": _MEMORY_FORMATS[props.memory_format],
            "pin_memory": bool(props.pin_memory),
        },
    ]


def _decode_entry(entry: object) -> tuple[str, TensorStorageMetadata | BytesStorageMetadata]:
    if not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[1], dict):
        raise ValueError(f"DCP metadata: bad state_dict entry {entry!r}")
    fqn = _str(entry[0], "fqn")
    node = entry[1]
    if node.get("t") == "bytes":
        return fqn, BytesStorageMetadata()
    if node.get("t") != "tensor":
        raise ValueError(f"DCP metadata: {fqn!r} is neither a tensor nor bytes: {node!r}")
    chunks = node.get("chunks")
    if not isinstance(chunks, list):
        raise ValueError(f"DCP metadata: {fqn!r}: chunks must be a list")
    for flag in ("requires_grad", "pin_memory"):
        if type(node.get(flag)) is not bool:
            raise ValueError(f"DCP metadata: {fqn!r}: {flag} must be true or false")
    dtype = NAME_TO_DTYPE.get(node.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise ValueError(f"DCP metadata: {fqn!r}: unknown dtype {node.get('dtype')!r}")
    props = TensorProperties(
        dtype=dtype,
        layout=_lookup(_LAYOUTS, node.get("layout"), "layout"),
        requires_grad=node["requires_grad"],
        memory_format=_lookup(_MEMORY_FORMATS, node.get("memory_format"), "memory format"),
        pin_memory=node["pin_memory"],
    )
    size = _ints(node.get("size"), f"{fqn!r}: size")
    decoded = [
        ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        for offsets, sizes in parse_chunks(fqn, tuple(size), chunks)
    ]
    return fqn, TensorStorageMetadata(properties=props, size=size, chunks=decoded)


def _encode_planner_data(data: object) -> object:
    if data is None:
        return None
    if isinstance(data, dict) and all(
        isinstance(k, str)
        and isinstance(path, tuple | list)
        and all(type(p) is str or type(p) is int for p in path)
        for k, path in data.items()
    ):
        return [[k, list(path)] for k, path in data.items()]
    raise TypeError(
        f"planner_data of type {type(data).__name__} has no JSON form (ckptstore stores DCP's "
        "metadata as JSON, never a pickle); DefaultSavePlanner's flattening map has one"
    )


def _decode_planner_data(data: object) -> dict[str, tuple[str | int, ...]] | None:
    if data is None:
        return None
    if not isinstance(data, list):
        raise ValueError("DCP metadata: planner_data must be a list")
    out: dict[str, tuple[str | int, ...]] = {}
    for entry in data:
        if (
            not isinstance(entry, list)
            or len(entry) != 2
            or not isinstance(entry[0], str)
            or not isinstance(entry[1], list)
            or not all(type(p) is str or type(p) is int for p in entry[1])
        ):
            raise ValueError(f"DCP metadata: bad planner_data entry {entry!r}")
        out[entry[0]] = tuple(entry[1])
    return out


def _encode_storage_data(data: object) -> object:
    if data is None:
        return None
    if not isinstance(data, dict):
        raise TypeError(f"storage_data of type {type(data).__name__} has no JSON form")
    out = []
    for index, info in data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, StorageInfo):
            raise TypeError(f"storage_data entry {index!r}: {info!r} is not ckptstore's")
        offset = None if index.offset is None else list(index.offset)
        out.append([index.fqn, offset, info.part, info.name])
    return out


def _decode_storage_data(data: object) -> dict[MetadataIndex, StorageInfo] | None:
    if data is None:
        return None
    if not isinstance(data, list):
        raise ValueError("DCP metadata: storage_data must be a list")
    out = {}
    for entry in data:
        if not isinstance(entry, list) or len(entry) != 4:
            raise ValueError(f"DCP metadata: bad storage_data entry {entry!r}")
        fqn, offset, part, name = entry
        index = MetadataIndex(
            _str(fqn, "fqn"), None if offset is None else _ints(offset, f"{fqn!r} offset")
        )
        out[index] = StorageInfo(_str(part, "part"), _str(name, "tensor name"))
    return out


def metadata_to_json(metadata: Metadata) -> str:
    """DCP's :class:`Metadata` as compact JSON (version 1; :func:`metadata_from_json`
    inverts it). ``TypeError`` for what has no JSON form (a custom planner's
    ``planner_data``, another writer's ``storage_data``): never a pickle."""
    meta = metadata.storage_meta
    doc = {
        "v": _CODEC_VERSION,
        "version": metadata.version,
        "state_dict": [_encode_entry(k, v) for k, v in metadata.state_dict_metadata.items()],
        "planner_data": _encode_planner_data(metadata.planner_data),
        "storage_data": _encode_storage_data(metadata.storage_data),
        "storage_meta": None
        if meta is None
        else {
            "checkpoint_id": None if meta.checkpoint_id is None else os.fspath(meta.checkpoint_id),
            "save_id": meta.save_id,
            "load_id": meta.load_id,
            "modules": list(meta.modules),
        },
    }
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)


def metadata_from_json(text: str) -> Metadata:
    """The :class:`Metadata` that :func:`metadata_to_json` wrote; ``ValueError`` if
    ``text`` is not such a document."""
    doc = json.loads(text)
    if not isinstance(doc, dict) or doc.get("v") != _CODEC_VERSION:
        raise ValueError(f"DCP metadata: not version {_CODEC_VERSION} of ckptstore's JSON form")
    entries = doc.get("state_dict")
    if not isinstance(entries, list):
        raise ValueError("DCP metadata: state_dict must be a list")
    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for entry in entries:
        fqn, md = _decode_entry(entry)
        if fqn in state_dict_metadata:
            raise ValueError(f"DCP metadata: {fqn!r} twice")
        state_dict_metadata[fqn] = md
    meta = doc.get("storage_meta")
    storage_meta = None
    if meta is not None:
        if not isinstance(meta, dict) or not isinstance(meta.get("modules"), list):
            raise ValueError("DCP metadata: bad storage_meta")
        storage_meta = StorageMeta(
            checkpoint_id=_str(meta.get("checkpoint_id"), "checkpoint_id", optional=True),
            save_id=_str(meta.get("save_id"), "save_id", optional=True),
            load_id=_str(meta.get("load_id"), "load_id", optional=True),
            modules=[_str(m, "module") for m in meta["modules"]],
        )
    return Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data=_decode_planner_data(doc.get("planner_data")),
        storage_data=_decode_storage_data(doc.get("storage_data")),
        storage_meta=storage_meta,
        version=_str(doc.get("version"), "version", optional=True),
    )


# ---------------------------------------------------------------- one process, full tensors


def full_state(
    metadata: Metadata,
    tensors: Mapping[str, torch.Tensor],
    *,
    device: Any = "cpu",
) -> dict[str, Any]:
    """The state dict of a DCP checkpoint from its full tensors by DCP name (what the
    service's ``GET`` returns for one, :data:`ckptstore_core.dcp_layout.FULL`), nested as
    it was saved (DCP's flattening map undone), in the order given. A non-tensor entry
    arrives as a ``U8`` tensor of DCP's ``torch.save`` bytes and is read with
    ``torch.load(weights_only=True)`` (plain Python values and tensors only)."""
    mapping = metadata.planner_data if isinstance(metadata.planner_data, dict) else None
    flat: dict[str, Any] = {}
    for fqn, tensor in tensors.items():
        md = metadata.state_dict_metadata.get(fqn)
        if md is None:
            raise CorruptData(f"the checkpoint's DCP metadata has no entry {fqn!r}")
        if isinstance(md, BytesStorageMetadata):
            flat[fqn] = _unpickled(fqn, tensor)
        elif list(tensor.shape) != list(md.size) or tensor.dtype != md.properties.dtype:
            raise CorruptData(
                f"{fqn}: {tensor.dtype} {list(tensor.shape)} served, DCP saved "
                f"{md.properties.dtype} {list(md.size)}"
            )
        else:
            flat[fqn] = tensor.to(device=device)
    if mapping is None:
        return flat
    nested: dict[str, Any] = {}
    for fqn, value in flat.items():
        set_element(nested, mapping.get(fqn, (fqn,)), value)
    return nested


def _unpickled(fqn: str, raw: torch.Tensor) -> Any:
    """A non-tensor entry from DCP's ``torch.save`` bytes, plain values only."""
    try:
        return torch.load(io.BytesIO(tensor_bytes(raw)), weights_only=True)
    except pickle.UnpicklingError as exc:
        raise InvalidRequest(
            f"{fqn}: DCP saved it as a pickled object that is no plain value "
            f"(torch.load(weights_only=True) refuses it: {exc}); load this "
            "checkpoint with dcp.load into a state dict that has the object"
        ) from exc


def full_state_if_dcp(
    tensors: dict[str, torch.Tensor], header_metadata: Mapping[str, str], map_location: Any
) -> Any:
    """What :meth:`CheckpointClient.load` returns for a checkpoint without a skeleton: the
    state dict (:func:`full_state`) of a DCP checkpoint served as full tensors, else the
    flat ``tensors``."""
    text = header_metadata.get(METADATA_KEY)
    if text is None or header_metadata.get(LAYOUT_KEY) != FULL:
        return tensors
    try:
        metadata = metadata_from_json(text)
    except ValueError as exc:
        raise CorruptData(f"the checkpoint's DCP metadata: {exc}") from exc
    return full_state(metadata, tensors, device=map_location)
