"""Who may do what: the scopes of a bearer token and the run patterns that limit one.

One rule for both sides of the wire: the service checks every request against it, the
client's ``ckptstore token create`` checks a pattern before it sends anything.

Scopes are ordered, each allowing what the ones below it allow:

* ``read``: list runs and checkpoints, load checkpoints, the dashboard, ``/metrics``
* ``write``: also save checkpoints (whole or in parts) and commit them
* ``admin``: also manage tokens (with no run pattern) and whatever else an operator does

A run pattern limits a token to some runs. Run names hold no ``/`` (see :mod:`.names`), so a
pattern is a comma-separated list of globs over run-name characters in which ``*`` stands for
any run-name characters (none included): ``team-a-*`` covers ``team-a-exp1``; ``team-a-*,
shared`` also covers ``shared``. A token covers every run only when asked for: the
pattern ``*`` (stored and listed as no pattern, ``None``). An empty, blank or missing pattern
is refused, never read as "every run".
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Literal, Self, get_args

from ckptstore_core.errors import InvalidRequest

__all__ = [
    "EVERY_RUN",
    "PATTERN_RULE",
    "SCOPES",
    "TOKEN_NAME_RULE",
    "Scope",
    "TokenInfo",
    "check_run_pattern",
    "token_runs",
    "check_scope",
    "check_token_name",
    "token_table",
    "pattern_matches",
    "scope_allows",
]

Scope = Literal["read", "write", "admin"]
#: the scopes, lowest first: each allows everything the ones before it allow
SCOPES: Final[tuple[Scope, ...]] = get_args(Scope)

_GLOB = re.compile(r"[A-Za-z0-9._*-]{1,128}")
_MAX_PATTERN = 1024
_RUN_CHARS = "[A-Za-z0-9._-]*"  # what a * stands for
PATTERN_RULE = (
    "a comma-separated list of globs of 1-128 of A-Z a-z 0-9 . _ - * each, "
    "where * stands for any run-name characters (team-a-*); '*' alone: every run"
)
EVERY_RUN: Final = "*"


# digits alone would read as a token's id where a name or an id is taken (a revoke)
_TOKEN_NAME = re.compile(r"(?![0-9]+\Z)[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
TOKEN_NAME_RULE = (
    "use 1-64 of A-Z a-z 0-9 . _ - starting with a letter or digit, not digits alone "
    "(those name a token's id)"
)


@dataclass(frozen=True)
class TokenInfo:
    """A token as listed (never its secret): what ``token list`` shows on both sides."""

    id: int
    name: str
    scope: Scope
    runs: str | None  # the run pattern; None: every run
    created: datetime
    revoked: datetime | None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "scope": self.scope,
            "runs": self.runs,
            "created": self.created.isoformat(),
            "revoked": self.revoked.isoformat() if self.revoked else None,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Self:
        revoked = obj.get("revoked")
        return cls(
            id=int(obj["id"]),
            name=str(obj["name"]),
            scope=check_scope(str(obj["scope"])),
            runs=obj.get("runs"),
            created=datetime.fromisoformat(obj["created"]),
            revoked=datetime.fromisoformat(revoked) if revoked else None,
        )


def token_table(tokens: list[TokenInfo]) -> list[str]:
    """The lines of ``token list`` (both commands print the same table)."""
    lines = [f"{'id':>5} {'name':<24} {'scope':<6} {'runs':<24} {'created (UTC)':<19} revoked"]
    for t in tokens:
        revoked = t.revoked.strftime("%Y-%m-%d %H:%M:%S") if t.revoked else "-"
        lines.append(
            f"{t.id:>5} {t.name:<24} {t.scope:<6} {t.runs or '(all)':<24} "
            f"{t.created.strftime('%Y-%m-%d %H:%M:%S'):<19} {revoked}"
        )
    return lines


def check_token_name(name: str) -> str:
    """``name`` if it is a valid token name (a label: ``ci-team-a``), else InvalidRequest."""
    if not _TOKEN_NAME.fullmatch(name):
        raise InvalidRequest(f"invalid token name {name!r}: {TOKEN_NAME_RULE}")
    return name


def check_scope(scope: str) -> Scope:
    """``scope`` if it is one of :data:`SCOPES`, else InvalidRequest naming them."""
    for known in SCOPES:
        if scope == known:
            return known
    raise InvalidRequest(f"invalid scope {scope!r}: use one of {', '.join(SCOPES)}")


def scope_allows(have: Scope, need: Scope) -> bool:
    """Whether a token of scope ``have`` may do what needs ``need``."""
    return SCOPES.index(have) >= SCOPES.index(need)


def check_run_pattern(pattern: str) -> str:
    """``pattern`` if it follows :data:`PATTERN_RULE`, else InvalidRequest naming the rule."""
    globs = pattern.split(",")
    if len(pattern) > _MAX_PATTERN or not all(_GLOB.fullmatch(g) for g in globs):
        raise InvalidRequest(f"invalid run pattern {pattern!r}: {PATTERN_RULE}")
    return pattern


def token_runs(pattern: str | None) -> str | None:
    """The run pattern a new token is given for ``pattern``: ``None`` (every run) for
    :data:`EVERY_RUN`, else the checked pattern. A missing (``None``), empty or blank
    pattern is InvalidRequest: a token covers every run only when asked for with ``*``."""
    if pattern is None:
        every = f"'{EVERY_RUN}' for every run"
        raise InvalidRequest(f"a token needs a run pattern ({every}): {PATTERN_RULE}")
    checked = check_run_pattern(pattern)
    return None if checked == EVERY_RUN else checked


def pattern_matches(pattern: str | None, run: str) -> bool:
    """Whether the run pattern ``pattern`` (None: every run) covers the run ``run``."""
    if pattern is None:
        return True
    return _compiled(pattern).fullmatch(run) is not None


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str) -> re.Pattern[str]:
    """The regular expression of a pattern (a service sees a few distinct ones)."""
    globs = check_run_pattern(pattern).split(",")
    alternatives = (_RUN_CHARS.join(re.escape(part) for part in g.split("*")) for g in globs)
    return re.compile("|".join(f"(?:{a})" for a in alternatives))
