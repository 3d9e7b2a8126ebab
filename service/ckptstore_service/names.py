"""Names the service accepts and makes: run names, steps in paths, blob keys.

One place for each rule, so the routes, the save path and maintenance agree on them. The
run-name rule itself lives in :mod:`ckptstore_core.names`, which the client checks too.
"""

from __future__ import annotations

import uuid

from ckptstore_core.errors import InvalidRequest
from ckptstore_core.names import PART_NAME_RULE, RUN_NAME_RULE, check_part_name, check_run_name

__all__ = [
    "MAX_STEP",
    "PART_NAME_RULE",
    "RUN_NAME_RULE",
    "blob_key",
    "check_part_name",
    "check_run_name",
    "parse_step",
]

MAX_STEP = (1 << 63) - 1


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
    """A new, unique key for a blob of checkpoint ``run/step`` (a save's, or a re-root's
    rewrite of it): never reused, so a blob once written is never overwritten."""
    return f"runs/{run}/{step}-{uuid.uuid4().hex}.blob"
