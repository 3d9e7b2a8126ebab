"""Blob keys spread over prefixes (docs/scale.md, "Keys spread over prefixes"): one run's
keys fall into many of S3's key ranges, the same ones for every step; every key still
starts with ``runs/<run>/``; what the service reads back from a key (run, step, when a
presigned upload began) round-trips, for the keys written before the spread too."""

from __future__ import annotations

import itertools
import time
from collections import Counter

import pytest

from ckptstore_core.errors import InvalidRequest
from ckptstore_service.names import SPREAD_CHARS, blob_key, parse_blob_key
from ckptstore_service.save.direct import _check_upload_key
from ckptstore_service.storage.base import check_key, presigned_key, presigned_since

UID = ("3f" + "0123456789abcdef" * 2)[:32]  # a uuid whose spread is 3f


def spread_of(key: str, run: str) -> str:
    """The characters right after the run's folder: where S3 can split the run's range."""
    return key.removeprefix(f"runs/{run}/")[:SPREAD_CHARS]


def test_one_steps_keys_fall_into_many_prefixes() -> None:
    keys = [blob_key("big-run", 7) for _ in range(1024)]
    assert len(set(keys)) == 1024
    assert all(k.startswith("runs/big-run/") and check_key(k) == k for k in keys)
    per_prefix = Counter(spread_of(k, "big-run") for k in keys)
    # 1,024 draws of 256 prefixes: about 251 distinct, 4 per prefix (11 at most, typically)
    assert len(per_prefix) > 200, len(per_prefix)
    assert max(per_prefix.values()) <= 20, per_prefix.most_common(3)
    assert all(len(p) == 2 and int(p, 16) < 256 for p in per_prefix)


def test_the_spread_comes_before_the_step() -> None:
    """Steps share the prefixes (S3's splits made for one save serve the next): the keys of
    two steps interleave in S3's listing order instead of forming a range per step."""
    one = {spread_of(blob_key("r", 1), "r") for _ in range(512)}
    two = {spread_of(blob_key("r", 2), "r") for _ in range(512)}
    assert len(one & two) > 100
    ordered = sorted((blob_key("r", step), step) for step in (1, 2) for _ in range(64))
    changes = sum(a[1] != b[1] for a, b in itertools.pairwise(ordered))
    assert changes > 10  # one change if each step's keys formed a range


@pytest.mark.parametrize("step", [0, 1, 12, (1 << 63) - 1])
@pytest.mark.parametrize("run", ["r", "run-1.a_b", "12-3", "ab"])
def test_keys_parse_back(run: str, step: int) -> None:
    key = blob_key(run, step)
    parsed = parse_blob_key(key)
    assert parsed is not None
    assert (parsed.run, parsed.step, parsed.since) == (run, step, None)
    assert parsed.spread == parsed.uid[:SPREAD_CHARS] == spread_of(key, run)
    now = time.time()
    up = presigned_key(key, now)
    assert up.startswith(key.removesuffix(".blob")) and check_key(up) == up
    got = parse_blob_key(up)
    assert got is not None and (got.run, got.step, got.uid) == (run, step, parsed.uid)
    assert got.since == presigned_since(up) == int(now)  # what the sweep reads
    _check_upload_key(run, step, up)


def test_keys_written_before_the_spread_still_parse() -> None:
    """Catalogs hold keys of the old layout (no spread); they are not migrated. Nothing
    parses a key to load it, and what does parse keys reads both layouts."""
    old = f"runs/r/12-{UID}.blob"
    parsed = parse_blob_key(old)
    assert parsed is not None and (parsed.run, parsed.step, parsed.spread) == ("r", 12, None)
    up = f"runs/r/12-{UID}.1700000000.presigned.blob"
    assert presigned_since(up) == 1700000000
    # a key in the store that no replica wrote: a stamp of other digits is no stamp
    assert presigned_since(f"runs/r/12-{UID}.\u00b3.presigned.blob") is None
    got = parse_blob_key(up)
    assert got is not None and (got.step, got.since) == (12, 1700000000)
    _check_upload_key("r", 12, up)  # an upload begun by a replica of before the spread


@pytest.mark.parametrize(
    "key",
    [
        f"runs/r/3f-12-{UID}.blob",  # a blob, not an upload
        f"runs/other/3f-12-{UID}.1.presigned.blob",  # another run
        f"runs/r/3f-13-{UID}.1.presigned.blob",  # another step
        f"runs/r/00-12-{UID}.1.presigned.blob",  # a spread that is not the uuid's own
        f"runs/r/3f-012-{UID}.1.presigned.blob",  # the step not written canonically
        f"runs/r/3f/12-{UID}.1.presigned.blob",
        f"runs/r/sub/3f-12-{UID}.1.presigned.blob",
        f"runs/r/3f-12-{UID[:-1]}.1.presigned.blob",
        f"prefix/runs/r/3f-12-{UID}.1.presigned.blob",
    ],
)
def test_a_key_of_another_run_step_or_shape_is_no_upload_of_that_step(key: str) -> None:
    assert parse_blob_key(f"runs/r/3f-12-{UID}.1.presigned.blob") is not None
    with pytest.raises(InvalidRequest, match="no presigned upload of r/12"):
        _check_upload_key("r", 12, key)
