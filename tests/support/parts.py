"""Checkpoints written in parts over raw HTTP, for the tests of a real service below the
client: each rank's shards of two tensors (``shards``, changing a little from step to
step), their DCP layout (``dcp_layout``), a part's body, its upload and the commit, and the
tensors of a safetensors response (``tensors_of``); and a part finished straight in a
catalog (``finish_part_rows``)."""

from __future__ import annotations

import json
import struct
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from ckptstore_core.wire import FORMAT, encode_header
from ckptstore_service.catalog import Catalog, NewChunk, TensorInfo

__all__ = [
    "commit",
    "dcp_layout",
    "finish_part_rows",
    "part_body",
    "put_part",
    "save_in_parts",
    "shards",
    "tensors_of",
]


def part_body(tensors: dict[str, np.ndarray]) -> bytes:
    prefix, _ = encode_header(
        [(name, "F32", a.shape) for name, a in tensors.items()], {"format": FORMAT}
    )
    return prefix + b"".join(a.astype(np.float32).tobytes() for a in tensors.values())


def shards(
    step: int, ranks: int = 2, rows: int = 64, cols: int = 512
) -> list[dict[str, np.ndarray]]:
    """Each rank's dim-0 shard of two tensors, changing a little from step to step."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    b = rng.standard_normal((rows,)).astype(np.float32)
    w[:, : step % cols] += np.float32(1e-3) * step  # a slowly changing part
    per = rows // ranks
    return [
        {
            f"w@{r * per},0": w[r * per : (r + 1) * per],
            f"b@{r * per}": b[r * per : (r + 1) * per],
        }
        for r in range(ranks)
    ]


def dcp_layout(
    ranks: int = 2, rows: int = 64, cols: int = 512, parts: list[str] | None = None
) -> str:
    """The DCP metadata (ckptstore's JSON form) of :func:`shards`: ``w`` and ``b`` split in
    ``ranks`` row blocks, rank ``r``'s in part ``parts[r]`` (default ``rank-{r}``)."""
    per = rows // ranks
    names = parts or [f"rank-{r}" for r in range(ranks)]
    tensor = {"t": "tensor", "dtype": "float32"}
    return json.dumps(
        {
            "v": 1,
            "state_dict": [
                [
                    "w",
                    {
                        **tensor,
                        "size": [rows, cols],
                        "chunks": [[[r * per, 0], [per, cols]] for r in range(ranks)],
                    },
                ],
                [
                    "b",
                    {
                        **tensor,
                        "size": [rows],
                        "chunks": [[[r * per], [per]] for r in range(ranks)],
                    },
                ],
            ],
            "storage_data": [
                entry
                for r in range(ranks)
                for entry in (
                    ["w", [r * per, 0], names[r], f"w@{r * per},0"],
                    ["b", [r * per], names[r], f"b@{r * per}"],
                )
            ],
        }
    )


def put_part(url: str, run: str, step: int, part: str, body: bytes) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=60) as c:
        return c.put(f"/v1/runs/{run}/checkpoints/{step}/parts/{part}", content=body)


def commit(url: str, run: str, step: int, parts: list[str], meta: dict[str, str] | None = None):
    with httpx.Client(base_url=url, timeout=60) as c:
        return c.post(
            f"/v1/runs/{run}/checkpoints/{step}/commit",
            json={"parts": parts, "metadata": meta or {}},
        )


def tensors_of(content: bytes) -> dict[str, bytes]:
    (n,) = struct.unpack("<Q", content[:8])
    header = json.loads(content[8 : 8 + n])
    data = content[8 + n :]
    return {
        name: data[spec["data_offsets"][0] : spec["data_offsets"][1]]
        for name, spec in header.items()
        if name != "__metadata__"
    }


def save_in_parts(url: str, run: str, step: int, ranks: int = 2) -> list[dict[str, np.ndarray]]:
    bodies = shards(step, ranks)
    with ThreadPoolExecutor(ranks) as pool:  # the ranks upload at the same time
        answers = list(
            pool.map(
                lambda r: put_part(url, run, step, f"rank-{r}", part_body(bodies[r])),
                range(ranks),
            )
        )
    assert [a.status_code for a in answers] == [201] * ranks, [a.text for a in answers]
    return bodies


def finish_part_rows(catalog: Catalog, checkpoint_id: int, name: str) -> None:
    """Finish part ``name`` of the parts checkpoint ``checkpoint_id`` in ``catalog``, as an
    upload does once its blob is durable: one 4-byte tensor ``{name}.w`` in one raw chunk."""
    part = catalog.find_part(checkpoint_id, name)
    assert part is not None
    tensor = TensorInfo(0, f"{name}.w", "U8", (4,), 0, 4, b"\0" * 16)
    chunk = NewChunk(0, 0, 4, 1, "raw/1", None, 0, 0, 4, b"\0" * 16)
    catalog.finish_part(
        part, raw_bytes=4, stored_bytes=4, tensors=[tensor], chunks=[chunk], sibling_bases={}
    )
