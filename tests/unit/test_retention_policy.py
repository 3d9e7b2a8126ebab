"""The retention decision (ckptstore_core.retention.kept_steps), a pure function: examples,
and properties against a reference written independently (rule by rule, per step)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore_core.errors import InvalidRequest
from ckptstore_core.lossy import Lossy
from ckptstore_core.retention import (
    Candidate,
    KeepBest,
    RetentionPolicy,
    kept_steps,
    lossy_steps,
    parse_keep_best,
)


def run(
    n: int, pinned: tuple[int, ...] = (), losses: dict[int, Any] | None = None
) -> list[Candidate]:
    losses = losses or {}
    return [
        Candidate(s, s in pinned, {} if s not in losses else {"eval_loss": losses[s]})
        for s in range(n)
    ]


def test_keep_last_and_every_on_thirty() -> None:
    policy = RetentionPolicy(keep_last=3, keep_every=10)
    assert kept_steps(policy, run(30)) == {0, 10, 20, 27, 28, 29}


def test_no_rule_or_no_policy_keeps_everything() -> None:
    assert kept_steps(None, run(5)) == set(range(5))
    assert kept_steps(RetentionPolicy(), run(5)) == set(range(5))
    assert kept_steps(RetentionPolicy(keep_last=1), []) == set()


def test_the_newest_and_the_pinned_are_always_kept() -> None:
    # keep_every=7 alone keeps 0 and 7; the newest (9) and the pinned (3) stay too
    assert kept_steps(RetentionPolicy(keep_every=7), run(10, pinned=(3,))) == {0, 3, 7, 9}


def test_keep_best_by_metadata() -> None:
    losses: dict[int, Any] = {1: 0.5, 2: 0.2, 3: 0.9, 4: 0.2, 5: True, 6: "low", 7: 0.1}
    # 0 and 8 have no eval_loss, 5 and 6 no number: never best; 2 and 4 tie, the newer wins
    best = RetentionPolicy(keep_best=KeepBest("eval_loss", "min", 2))
    assert kept_steps(best, run(9, losses=losses)) == {7, 4, 8}
    worst = RetentionPolicy(keep_best=KeepBest("eval_loss", "max", 2))
    assert kept_steps(worst, run(9, losses=losses)) == {3, 1, 8}
    # more wanted than there are scored checkpoints: all of those
    many = RetentionPolicy(keep_best=KeepBest("eval_loss", "min", 50))
    assert kept_steps(many, run(9, losses=losses)) == {1, 2, 3, 4, 7, 8}


def test_policy_json_round_trip_and_refusals() -> None:
    policy = RetentionPolicy(3, None, KeepBest("eval_loss", "max", 2))
    assert RetentionPolicy.from_json(policy.to_json()) == policy
    assert RetentionPolicy.from_json({}) == RetentionPolicy()
    assert str(policy) == "keep_last=3, keep_best=eval_loss:max:2"
    for bad in (
        {"keep_last": 0},
        {"keep_every": -1},
        {"keep_last": True},
        {"keep_last": "3"},
        {"keep_forever": 1},
        {"keep_best": {"metric": "x", "mode": "median", "n": 1}},
        {"keep_best": {"metric": "", "mode": "min", "n": 1}},
        {"keep_best": {"metric": "x", "mode": "min"}},
        [],
    ):
        with pytest.raises(ValueError):
            RetentionPolicy.from_json(bad)


def test_lossy_after_is_no_deletion_rule() -> None:
    """``lossy_after=K``: every checkpoint older than the newest K but the pinned ones goes
    to the lossy tier; alone it deletes nothing; with rules, it applies to what they keep."""
    policy = RetentionPolicy(lossy_after=3)
    assert not policy.has_rules and policy.archives
    assert kept_steps(policy, run(10)) == set(range(10))
    assert lossy_steps(policy, run(10, pinned=(2,))) == {0, 1, 3, 4, 5, 6}
    assert lossy_steps(policy, run(3)) == set() == lossy_steps(None, run(10))
    assert lossy_steps(RetentionPolicy(keep_last=2), run(10)) == set()
    both = RetentionPolicy(keep_every=2, lossy_after=1)
    kept = [c for c in run(10) if c.step in kept_steps(both, run(10))]
    assert lossy_steps(both, kept) == {0, 2, 4, 6, 8}
    assert policy.lossy_params() == Lossy.from_json(True)


def test_lossy_policy_json_round_trip_and_refusals() -> None:
    params = Lossy(weight_prune=0.5, moment_prune=0.7, bits=3, exact_moments=True, step=0.5)
    policy = RetentionPolicy(keep_last=4, lossy_after=2, lossy=params)
    assert RetentionPolicy.from_json(policy.to_json()) == policy
    assert policy.to_json()["lossy"] == params.to_json()
    assert str(policy) == (
        "keep_last=4, lossy_after=2 (weight_prune=0.5, moment_prune=0.7, bits=3, "
        "exact_moments=True, step=0.5)"
    )
    # a policy stored before lossy_after existed reads as it was
    old = {"keep_last": 3, "keep_every": None, "keep_best": None}
    assert RetentionPolicy.from_json(old) == RetentionPolicy(keep_last=3)
    for bad in ({"lossy_after": 0}, {"lossy_after": True}, {"lossy": {"bits": 4}}):
        with pytest.raises(ValueError):
            RetentionPolicy.from_json(bad)
    with pytest.raises(InvalidRequest):
        RetentionPolicy.from_json({"lossy_after": 1, "lossy": {"bits": 99}})


def test_parse_keep_best() -> None:
    assert parse_keep_best("eval_loss:min:3") == KeepBest("eval_loss", "min", 3)
    assert parse_keep_best("val:acc:max:1") == KeepBest("val:acc", "max", 1)
    for bad in ("eval_loss", "eval_loss:min", "eval_loss:min:x", ":min:3", "l:mean:3", "l:min:0"):
        with pytest.raises(ValueError):
            parse_keep_best(bad)


# -- properties ----------------------------------------------------------------------------


def reference(policy: RetentionPolicy, cands: list[Candidate]) -> set[int]:
    """Each step on its own: kept if some rule names it, or it is the newest or pinned."""
    steps = sorted(c.step for c in cands)
    if not policy.has_rules:
        return set(steps)
    best = policy.keep_best

    def score(c: Candidate) -> float | None:
        v = c.metadata.get(best.metric) if best else None
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

    def better(a: Candidate, b: Candidate) -> bool:  # a strictly ahead of b
        va, vb = score(a), score(b)
        assert best is not None and va is not None and vb is not None
        if va != vb:
            return va < vb if best.mode == "min" else va > vb
        return a.step > b.step

    kept = set()
    for c in cands:
        newer = sum(1 for s in steps if s > c.step)
        reasons = [
            newer == 0,
            c.pinned,
            policy.keep_last is not None and newer < policy.keep_last,
            policy.keep_every is not None and c.step % policy.keep_every == 0,
            best is not None
            and score(c) is not None
            and sum(1 for o in cands if score(o) is not None and better(o, c)) < best.n,
        ]
        if any(reasons):
            kept.add(c.step)
    return kept


policies = st.builds(
    RetentionPolicy,
    st.none() | st.integers(1, 8),
    st.none() | st.integers(1, 8),
    st.none()
    | st.builds(KeepBest, st.just("eval_loss"), st.sampled_from(["min", "max"]), st.integers(1, 5)),
)
values = st.none() | st.integers(-3, 3) | st.floats(-2, 2) | st.booleans() | st.just("x")


@st.composite
def runs(draw: st.DrawFn) -> list[Candidate]:
    steps = draw(st.lists(st.integers(0, 60), unique=True, max_size=25))
    return [
        Candidate(
            s,
            draw(st.booleans()),
            {} if (v := draw(values)) is None else {"eval_loss": v},
        )
        for s in steps
    ]


@settings(max_examples=300, deadline=None)
@given(policies, runs())
def test_matches_the_reference(policy: RetentionPolicy, cands: list[Candidate]) -> None:
    kept = kept_steps(policy, cands)
    assert kept == reference(policy, cands)
    assert kept <= {c.step for c in cands}
    if cands:
        assert max(c.step for c in cands) in kept
    assert {c.step for c in cands if c.pinned} <= kept


@settings(max_examples=300, deadline=None)
@given(policies, runs(), values)
def test_a_newer_checkpoint_never_saves_one_already_doomed(
    policy: RetentionPolicy, cands: list[Candidate], value: Any
) -> None:
    """What replicas rely on: a save can only add to what a pass deletes, never take back a
    decision (a pass that decided before the save deletes nothing the save would keep)."""
    newest = max((c.step for c in cands), default=-1) + 1
    more = [*cands, Candidate(newest, False, {} if value is None else {"eval_loss": value})]
    before = kept_steps(policy, cands)
    after = kept_steps(policy, more)
    assert after - {newest} <= before
