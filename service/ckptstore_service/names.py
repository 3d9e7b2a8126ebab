"""Names the service accepts and makes: run names, steps in paths, blob keys.

One place for each rule, so the routes, the save path and maintenance agree on them. The
run-name rule itself lives in :mod:`ckptstore_core.names`, which the client checks too.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from ckptstore_core.errors import InvalidRequest
from ckptstore_core.names import PART_NAME_RULE, RUN_NAME_RULE, check_part_name, check_run_name
from ckptstore_service.storage.base import PRESIGNED_SUFFIX

__all__ = [
    "MAX_STEP",
    "PART_NAME_RULE",
    "RUN_NAME_RULE",
    "SPREAD_CHARS",
    "BlobKey",
    "blob_key",
    "check_part_name",
    "check_run_name",
    "parse_blob_key",
    "parse_step",
]

MAX_STEP = (1 << 63) - 1

#: hex characters of a blob key's spread (:func:`blob_key`): 16**2 = 256 prefixes per run
SPREAD_CHARS = 2

# runs/<run>/[<spread>-]<step>-<uuid hex>[.<unix time>.presigned].blob: the spread is absent
# from the keys written before it existed (catalogs keep them; they load as ever)
_BLOB_KEY = re.compile(
    rf"runs/(?P<run>[^/]+)/(?:(?P<spread>[0-9a-f]{{{SPREAD_CHARS}}})-)?(?P<step>0|[1-9][0-9]*)-"
    rf"(?P<uid>[0-9a-f]{{32}})(?:\.(?P<since>[0-9]+){re.escape(PRESIGNED_SUFFIX)}|\.blob)"
)


def parse_step(step: str, *, allow_latest: bool = False) -> int | None:
    """A step path segment: a non-negative integer written canonically, as the service
    writes it (or ``latest`` when allowed -> None). ``05``, ``+5``, `` 5`` are not step 5
    (InvalidRequest): one checkpoint has one path, so a cache, a log or a token's audit never
    sees two names for it."""
    if allow_latest and step == "latest":
        return None
    if (
        not step.isascii()
        or not step.isdigit()
        or len(step) > 19
        or (step.startswith("0") and step != "0")
        or int(step) > MAX_STEP
    ):
        what = "a non-negative integer without leading zeros" + (
            " or 'latest'" if allow_latest else ""
        )
        raise InvalidRequest(f"invalid step {step!r}: expected {what}")
    return int(step)


def blob_key(run: str, step: int) -> str:
    """A new, unique key for a blob of checkpoint ``run/step`` (a save's, a part's, or a
    re-root's, delete's or archive's rewrite of it): never reused, so a blob once written is
    never overwritten.

    ``runs/<run>/<spread>-<step>-<uuid hex>.blob``, where the spread is the uuid's first
    :data:`SPREAD_CHARS` hex characters: S3 partitions a bucket's key space by ranges of
    keys, each partition taking 3,500 PUT/s and 5,500 GET/s, and splits a busy range where
    its keys differ. Random characters right after the run's folder give it 256 places to
    split one run's keys at, the same for every step, so the partitions a run's saves
    and loads made S3 split serve its next ones; ``runs/<run>/`` still prefixes every key
    of the run (docs/scale.md, "Keys spread over prefixes")."""
    uid = uuid.uuid4().hex
    return f"runs/{run}/{uid[:SPREAD_CHARS]}-{step}-{uid}.blob"


@dataclass(frozen=True)
class BlobKey:
    """What a blob key the service made says: its checkpoint's run and step, its uuid, its
    spread (None for a key made before keys were spread) and, for a presigned upload's key,
    when the upload began (Unix seconds)."""

    run: str
    step: int
    uid: str
    spread: str | None
    since: int | None


def parse_blob_key(key: str) -> BlobKey | None:
    """``key`` read as :func:`blob_key` (or :func:`~ckptstore_service.storage.presigned_key`
    of one) writes it, either layout; None for any other key, or one whose spread is not its
    uuid's own."""
    m = _BLOB_KEY.fullmatch(key)
    if m is None or (m["spread"] is not None and m["spread"] != m["uid"][:SPREAD_CHARS]):
        return None
    since = int(m["since"]) if m["since"] is not None else None
    return BlobKey(m["run"], int(m["step"]), m["uid"], m["spread"], since)
