"""Retention policies: which checkpoints of a run to keep, as data and as one pure decision.

A :class:`RetentionPolicy` has up to three rules (Orbax's preservation policies):

* ``keep_last=N``: the newest N checkpoints;
* ``keep_every=K``: every checkpoint whose step is a multiple of K;
* ``keep_best=KeepBest(metric, mode, n)``: the n checkpoints with the lowest (``min``) or
  highest (``max``) number under ``metric`` in their user metadata; a checkpoint without
  that key (or whose value is no number) is never among the best.

A checkpoint is kept if ANY rule keeps it, and always kept, whatever the rules: the run's
newest checkpoint and every pinned one. A policy without a rule keeps everything.
:func:`kept_steps` is that decision; the service applies it (deleting the rest with its
delete machinery) in the background after each save and when a policy is set.

One more field moves checkpoints to the lossy tier instead of deleting them (issue 23,
docs/lossy.md#archival): ``lossy_after=K``, every checkpoint older than the newest K that is
not pinned is re-encoded lossy (with the :class:`~ckptstore_core.lossy.Lossy` parameters
``lossy``, None: the defaults) in the background. It is no deletion rule: a policy with only
``lossy_after`` keeps everything. :func:`lossy_steps` is that decision.

The same classes travel as JSON (``PUT /v1/runs/{run}/retention``), are validated at
construction (``ValueError``, or :class:`~ckptstore_core.errors.InvalidRequest` for bad
lossy parameters: a clear 400 on the service, an error before anything is sent on the
client) and are what ``CheckpointClient.set_retention`` builds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ckptstore_core.lossy import Lossy

__all__ = [
    "MAX_METRIC_CHARS",
    "Candidate",
    "KeepBest",
    "RetentionPolicy",
    "kept_steps",
    "lossy_steps",
    "parse_keep_best",
]

_FIELDS = ("keep_last", "keep_every", "keep_best", "lossy_after", "lossy")

#: The longest metadata key a ``keep_best`` rule may name.
MAX_METRIC_CHARS = 256


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, not {value!r}")


@dataclass(frozen=True, slots=True)
class KeepBest:
    """Keep the ``n`` checkpoints with the lowest (``mode="min"``) or highest (``"max"``)
    number under ``metric`` in their user metadata (``save(..., metadata={...})``)."""

    metric: str
    mode: Literal["min", "max"]
    n: int

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not 0 < len(self.metric) <= MAX_METRIC_CHARS:
            raise ValueError(
                f"keep_best's metric must be a metadata key of 1 to {MAX_METRIC_CHARS} "
                f"characters, not {self.metric!r}"
            )
        if self.mode not in ("min", "max"):
            raise ValueError(f"keep_best's mode must be 'min' or 'max', not {self.mode!r}")
        _positive("keep_best's n", self.n)

    def to_json(self) -> dict[str, Any]:
        return {"metric": self.metric, "mode": self.mode, "n": self.n}

    def __str__(self) -> str:
        return f"{self.metric}:{self.mode}:{self.n}"


def parse_keep_best(text: str) -> KeepBest:
    """``METRIC:min|max:N`` (the CLI's and the settings' form) -> :class:`KeepBest`;
    ``ValueError`` naming the expected form otherwise. The metric may itself hold ``:``."""
    metric, _, rest = text.rpartition(":")
    metric, _, mode = metric.rpartition(":")
    if not metric or not rest.isascii() or not rest.isdigit():
        raise ValueError(f"{text!r}: expected METRIC:min|max:N (eval_loss:min:3)")
    return KeepBest(metric, mode, int(rest))  # type: ignore[arg-type]  # checked there


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """A run's retention rules (see the module's docstring); every field None: no rule,
    everything is kept, bit-exact."""

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: KeepBest | None = None
    #: the checkpoints older than the newest ``lossy_after`` (not pinned) become lossy
    lossy_after: int | None = None
    #: their parameters (None: the defaults, ``Lossy.from_json(True)``); only with lossy_after
    lossy: Lossy | None = None

    def __post_init__(self) -> None:
        if self.keep_last is not None:
            _positive("keep_last", self.keep_last)
        if self.keep_every is not None:
            _positive("keep_every", self.keep_every)
        if self.keep_best is not None and not isinstance(self.keep_best, KeepBest):
            raise ValueError(f"keep_best must be a KeepBest, not {self.keep_best!r}")
        if self.lossy_after is not None:
            _positive("lossy_after", self.lossy_after)
        if self.lossy is not None:
            if not isinstance(self.lossy, Lossy):
                raise ValueError(f"lossy must be a Lossy, not {self.lossy!r}")
            if self.lossy_after is None:
                raise ValueError("lossy parameters need lossy_after (which checkpoints)")

    @property
    def has_rules(self) -> bool:
        """Whether any rule is set (without one, everything is kept)."""
        return (self.keep_last, self.keep_every, self.keep_best) != (None, None, None)

    @property
    def archives(self) -> bool:
        """Whether it moves old checkpoints to the lossy tier (``lossy_after`` is set)."""
        return self.lossy_after is not None

    def lossy_params(self) -> Lossy:
        """The parameters of the checkpoints it makes lossy (the defaults if none given)."""
        return self.lossy if self.lossy is not None else Lossy.from_json(True)

    def to_json(self) -> dict[str, Any]:
        best = None if self.keep_best is None else self.keep_best.to_json()
        return {
            "keep_last": self.keep_last,
            "keep_every": self.keep_every,
            "keep_best": best,
            "lossy_after": self.lossy_after,
            "lossy": None if self.lossy is None else self.lossy.to_json(),
        }

    @classmethod
    def from_json(cls, obj: object) -> RetentionPolicy:
        """The policy ``obj`` (what :meth:`to_json` writes; missing keys are None);
        ``ValueError`` for anything else: unknown keys, wrong types, numbers below 1
        (InvalidRequest for bad lossy parameters: :meth:`Lossy.from_json`)."""
        if not isinstance(obj, Mapping):
            raise ValueError(f"a retention policy is a JSON object, not {obj!r}")
        unknown = set(obj) - set(_FIELDS)
        if unknown:
            raise ValueError(
                f"unknown retention fields {sorted(unknown)}: expected {', '.join(_FIELDS)}"
            )
        best = obj.get("keep_best")
        if best is not None:
            if not isinstance(best, Mapping) or set(best) != {"metric", "mode", "n"}:
                raise ValueError(
                    'keep_best must be {"metric": KEY, "mode": "min"|"max", "n": N}, '
                    f"not {best!r}"
                )
            best = KeepBest(best["metric"], best["mode"], best["n"])
        lossy = obj.get("lossy")
        return cls(
            obj.get("keep_last"),
            obj.get("keep_every"),
            best,
            obj.get("lossy_after"),
            None if lossy is None else Lossy.from_json(lossy),
        )

    def __str__(self) -> str:
        lossy = ""
        if self.lossy is not None:
            lossy = " (" + ", ".join(f"{k}={v}" for k, v in self.lossy.to_json().items()) + ")"
        rules = [
            f"keep_last={self.keep_last}" if self.keep_last is not None else "",
            f"keep_every={self.keep_every}" if self.keep_every is not None else "",
            f"keep_best={self.keep_best}" if self.keep_best is not None else "",
            f"lossy_after={self.lossy_after}{lossy}" if self.lossy_after is not None else "",
        ]
        return ", ".join(r for r in rules if r) or "keep everything"


@dataclass(frozen=True, slots=True)
class Candidate:
    """What the decision reads of one committed checkpoint."""

    step: int
    pinned: bool = False
    metadata: Mapping[str, Any] = field(default_factory=dict)


def _metric(metadata: Mapping[str, Any], key: str) -> float | None:
    """The number under ``key``, or None (absent, not a number, a bool, not finite)."""
    value = metadata.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _best(best: KeepBest, checkpoints: list[Candidate]) -> set[int]:
    """The steps of the ``best.n`` best checkpoints by ``best.metric``; on equal values the
    newer step wins (the order is total: the same inputs always give the same steps)."""
    values = ((_metric(c.metadata, best.metric), c.step) for c in checkpoints)
    scored = [(v, step) for v, step in values if v is not None]
    sign = 1.0 if best.mode == "min" else -1.0
    scored.sort(key=lambda vs: (sign * vs[0], -vs[1]))
    return {step for _, step in scored[: best.n]}


def kept_steps(policy: RetentionPolicy | None, checkpoints: Iterable[Candidate]) -> set[int]:
    """The steps that ``policy`` keeps among ``checkpoints`` (a run's committed ones, in any
    order, steps unique): those any rule keeps, the newest and the pinned ones; every step
    when the policy is None or has no rule. The others are the ones to delete."""
    ordered = sorted(checkpoints, key=lambda c: c.step)
    steps = {c.step for c in ordered}
    if policy is None or not policy.has_rules or not ordered:
        return steps
    kept = {ordered[-1].step} | {c.step for c in ordered if c.pinned}
    if policy.keep_last is not None:
        kept |= {c.step for c in ordered[-policy.keep_last :]}
    if policy.keep_every is not None:
        kept |= {s for s in steps if s % policy.keep_every == 0}
    if policy.keep_best is not None:
        kept |= _best(policy.keep_best, ordered)
    return kept


def lossy_steps(policy: RetentionPolicy | None, checkpoints: Iterable[Candidate]) -> set[int]:
    """The steps that ``policy`` moves to the lossy tier among ``checkpoints`` (a run's
    committed ones, in any order, steps unique): those older than the newest
    ``lossy_after``, pinned ones left out (so the newest always is). None without
    ``lossy_after``. Whether one is lossy already is the caller's to check."""
    if policy is None or policy.lossy_after is None:
        return set()
    ordered = sorted(checkpoints, key=lambda c: c.step)
    return {c.step for c in ordered[: max(0, len(ordered) - policy.lossy_after)] if not c.pinned}
