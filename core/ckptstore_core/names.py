"""What a run may be called: one rule for both sides of the wire.

A run name is one path segment of the API (``/v1/runs/{run}/...``) and one folder of blob
keys, so it holds no ``/``, no ``..`` and nothing that needs quoting. The service refuses any
other name with :class:`~ckptstore_core.errors.InvalidRequest` naming the rule; the client
checks it before it sends anything, so a bad name fails before a state dict is flattened.
"""

from __future__ import annotations

import re

from ckptstore_core.errors import InvalidRequest

__all__ = ["PART_NAME_RULE", "RUN_NAME_RULE", "check_part_name", "check_run_name", "is_run_name"]

_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
RUN_NAME_RULE = "use 1-128 of A-Z a-z 0-9 . _ - starting with a letter or digit"


def is_run_name(run: str) -> bool:
    return _RUN_NAME.fullmatch(run) is not None


def check_run_name(run: str) -> str:
    """``run`` if it is a valid run name, else InvalidRequest naming the rule."""
    if not is_run_name(run):
        raise InvalidRequest(f"invalid run name {run!r}: {RUN_NAME_RULE}")
    return run


_PART_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
PART_NAME_RULE = "use 1-64 of A-Z a-z 0-9 . _ - starting with a letter or digit"


def check_part_name(part: str) -> str:
    """``part`` if it is a valid name for one writer's part of a checkpoint (``rank-3``),
    else InvalidRequest naming the rule."""
    if not _PART_NAME.fullmatch(part):
        raise InvalidRequest(f"invalid part name {part!r}: {PART_NAME_RULE}")
    return part
