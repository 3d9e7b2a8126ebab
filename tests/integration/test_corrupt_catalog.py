"""A catalog whose chunk rows lie (base ids that loop or point at other chunks, lengths,
item sizes, offsets outside the blob) and a truncated blob: every GET of a checkpoint that
depends on them is a 500 ``corrupt_data`` or a cut response, within seconds, never wrong bytes
with a 200, and the service goes on serving other runs. Raw HTTP, not the client: the client
checks the tensor checksums in the response header too, and would hide what the service sent.
"""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch

from ckptstore import CheckpointClient
from support.serviceproc import Service

ENV = {"CKPTSTORE_CHUNK_BYTES": str(64 << 10)}  # 16384 elements a chunk: several per tensor
STEPS = 3


def _states(seed: int) -> list[dict[str, object]]:
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(128, 256, generator=g)
    w = torch.randn(128, 256, generator=g)
    frozen = torch.randn(128, 256, generator=g)  # never changes: stored as refs
    out: list[dict[str, object]] = []
    for i in range(STEPS):
        master = master + 1e-3 * torch.randn(master.shape, generator=g)
        w = w + 1e-3 * torch.randn(w.shape, generator=g)
        out.append(
            {
                "model": {"emb": master.to(torch.bfloat16), "w": w.clone(), "frozen": frozen},
                "master": {"emb": master.clone()},
                "step": i,
            }
        )
    return out


Outcome = tuple[str, object]


def _get(url: str, run: str, step: int) -> Outcome:
    """("ok", body), ("http", (status, code)) or ("cut", repr): a hang fails on the timeout."""
    try:
        with httpx.stream("GET", f"{url}/v1/runs/{run}/checkpoints/{step}", timeout=30) as r:
            if r.status_code != 200:
                r.read()
                return "http", (r.status_code, r.json()["error"]["code"])
            return "ok", b"".join(r.iter_bytes())
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        return "cut", repr(exc)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[tuple[str, int], bytes]]:
    """A data folder holding run ``a`` (one chain of 3) and run ``b``, and every GET's body."""
    data_dir = tmp_path_factory.mktemp("corrupt-catalog") / "data"
    with Service(data_dir, ENV) as svc:
        with CheckpointClient(svc.url) as client:
            for run, seed in (("a", 1), ("b", 2)):
                for i, state in enumerate(_states(seed)):
                    client.save(run, i, state)
        bodies = {}
        for run in "ab":
            for i in range(STEPS):
                kind, body = _get(svc.url, run, i)
                assert kind == "ok" and isinstance(body, bytes)
                bodies[run, i] = body
    shutil.rmtree(data_dir / "cache")
    return data_dir, bodies


def _chunk(db: sqlite3.Connection, step: int, where: str) -> int:
    """The id of the first chunk of run ``a``'s checkpoint ``step`` that matches ``where``."""
    row = db.execute(
        "SELECT c.id FROM chunks c JOIN checkpoints cp ON cp.id = c.checkpoint_id "
        "JOIN runs r ON r.id = cp.run_id "
        f"WHERE r.name = 'a' AND cp.step = ? AND ({where}) ORDER BY c.id",
        (step,),
    ).fetchone()
    assert row is not None, where
    return int(row[0])


def _sql(statement: Callable[[sqlite3.Connection], str]) -> Callable[[Path], None]:
    def corrupt(data_dir: Path) -> None:
        with sqlite3.connect(data_dir / "catalog.sqlite3") as db:
            db.execute(statement(db))

    return corrupt


def _truncate_blob(data_dir: Path) -> None:
    with sqlite3.connect(data_dir / "catalog.sqlite3") as db:
        (key,) = db.execute(
            "SELECT blob_key FROM checkpoints cp JOIN runs r ON r.id = cp.run_id "
            "WHERE r.name = 'a' AND cp.step = 1"
        ).fetchone()
    (blob,) = (p for p in (data_dir / "blobs").rglob("*") if p.name == Path(key).name)
    blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])


DELTA = "c.codec LIKE 'zsub/%'"
REF = "c.codec = 'ref'"
CAST = "c.codec LIKE 'cast-bf16/%'"

CASES: dict[str, tuple[Callable[[Path], None], int]] = {
    # (corruption, a step of run a that must be refused)
    "a delta that is its own base": (
        _sql(lambda db: f"UPDATE chunks SET base_id = id WHERE id = {_chunk(db, 2, DELTA)}"),
        2,
    ),
    "two deltas that are each other's base": (
        _sql(
            lambda db: (
                f"UPDATE chunks SET base_id = {_chunk(db, 2, DELTA)} "
                f"WHERE id = {_chunk(db, 1, DELTA)}"
            )
        ),
        1,
    ),
    "a ref to itself": (
        _sql(lambda db: f"UPDATE chunks SET base_id = id WHERE id = {_chunk(db, 1, REF)}"),
        1,
    ),
    "a ref to another chunk of the same size": (
        _sql(
            lambda db: (
                f"UPDATE chunks SET base_id = {_chunk(db, 0, 'c.itemsize = 4')} "
                f"WHERE id = {_chunk(db, 2, REF)}"
            )
        ),
        2,
    ),
    "a bf16 copy predicted from itself": (
        _sql(lambda db: f"UPDATE chunks SET base_id = id WHERE id = {_chunk(db, 1, CAST)}"),
        1,
    ),
    "a bf16 copy predicted from a chunk of other items": (
        _sql(
            lambda db: (
                f"UPDATE chunks SET base_id = {_chunk(db, 0, CAST)} "
                f"WHERE id = {_chunk(db, 1, CAST)}"
            )
        ),
        1,
    ),
    "a delta without a base": (
        _sql(lambda db: f"UPDATE chunks SET base_id = NULL WHERE id = {_chunk(db, 1, DELTA)}"),
        1,
    ),
    "an item size of 0": (
        _sql(lambda db: f"UPDATE chunks SET itemsize = 0 WHERE id = {_chunk(db, 1, DELTA)}"),
        1,
    ),
    "a chunk past the end of its blob": (
        _sql(
            lambda db: f"UPDATE chunks SET blob_offset = 1 << 40 WHERE id = {_chunk(db, 1, DELTA)}"
        ),
        1,
    ),
    "a negative blob offset": (
        _sql(lambda db: f"UPDATE chunks SET blob_offset = -5 WHERE id = {_chunk(db, 1, DELTA)}"),
        1,
    ),
    "a truncated blob": (_truncate_blob, 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_lying_catalog_is_refused_as_corrupt_data(
    make_service: Callable[..., Service],
    saved: tuple[Path, dict[tuple[str, int], bytes]],
    tmp_path: Path,
    case: str,
) -> None:
    source, bodies = saved
    data_dir = tmp_path / "data"
    shutil.copytree(source, data_dir)
    corrupt, bad = CASES[case]
    corrupt(data_dir)
    svc = make_service(ENV, data_dir)
    for step in range(STEPS):
        kind, detail = _get(svc.url, "a", step)
        if kind == "ok":  # a checkpoint the corruption does not reach: its own bytes
            assert step != bad, f"step {step} was served"
            assert detail == bodies["a", step], f"step {step}: wrong bytes with a 200"
        else:  # refused before the status line, or cut short; never an internal error
            assert kind == "cut" or detail == (500, "corrupt_data"), f"step {step}: {detail}"
    assert _get(svc.url, "b", STEPS - 1) == ("ok", bodies["b", STEPS - 1])
    assert svc.healthy()


@pytest.mark.slow
def test_a_base_id_with_no_row_is_corrupt_data(
    make_service: Callable[..., Service],
    saved: tuple[Path, dict[tuple[str, int], bytes]],
    tmp_path: Path,
) -> None:
    source, _ = saved
    data_dir = tmp_path / "data"
    shutil.copytree(source, data_dir)
    with sqlite3.connect(data_dir / "catalog.sqlite3") as db:  # foreign keys are off here
        db.execute(f"UPDATE chunks SET base_id = 1 << 40 WHERE id = {_chunk(db, 1, DELTA)}")
    svc = make_service(ENV, data_dir)
    assert _get(svc.url, "a", 1) == ("http", (500, "corrupt_data"))


def _damage_chunks_table(data_dir: Path) -> None:
    """Overwrite the chunks table's root page with noise: SQLite then reads "database disk
    image is malformed" for any query of a checkpoint's chunks, while ``SELECT 1`` and the
    other tables still answer."""
    path = data_dir / "catalog.sqlite3"
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        (page_size,) = db.execute("PRAGMA page_size").fetchone()
        (root,) = db.execute(
            "SELECT rootpage FROM sqlite_master WHERE type = 'table' AND name = 'chunks'"
        ).fetchone()
    with open(path, "r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(bytes(range(256)) * (page_size // 256))


def test_a_damaged_catalog_file_fails_readiness_with_a_typed_error(
    make_service: Callable[..., Service],
    saved: tuple[Path, dict[tuple[str, int], bytes]],
    tmp_path: Path,
) -> None:
    # a damaged SQLite file was a 500 internal_error whose message held the SQL statement,
    # and /readyz went on saying ready
    source, _ = saved
    data_dir = tmp_path / "data"
    shutil.copytree(source, data_dir)
    _damage_chunks_table(data_dir)
    svc = make_service(ENV, data_dir)
    with httpx.Client(base_url=svc.url, timeout=30) as http:
        answer = http.get("/v1/runs/a/checkpoints/1")
        assert answer.status_code == 500, answer.text
        error = answer.json()["error"]
        assert error["code"] == "corrupt_data", error
        assert "catalog" in error["message"] and "malformed" in error["message"]
        for sql in ("SELECT", "FROM", "chunks", "[SQL"):
            assert sql not in error["message"], error["message"]
        ready = http.get("/readyz")
        assert ready.status_code == 503, ready.text
        assert ready.json()["database"] != "ok"
        assert http.get("/healthz").status_code in (200, 503)  # alive, whatever it says
