"""A stateful property-based test of the checkpoint lifecycle (issue 20): hypothesis drives
random sequences of saves, deletes, run deletes, pins, retention policies, forks and
service restarts against a real service process, and checks it against a model of what it
should hold.

The model is, per run, the committed steps with their metadata, pin flag and content, the
run's own retention policy and its lineage (whose states its saves hold). After every step:

* the listings (steps, pins, metadata, the runs) equal the model's;
* the checkpoints the step touched load bit-exactly, and so does their run's ``latest``
  (every checkpoint of every run after a delete, a run delete, a pin change, a retention
  policy or a restart; a ``load`` action picks others at random): checking all of them
  after every step would cost most of the test's time for little more coverage;
* after the background pass (grace 0: it collects at once), the blob store holds exactly
  the blobs the catalog names: the local folder through ``support.blobs.check_store`` on
  SQLite, the bucket's keys on PostgreSQL + S3 (moto).

Retention is modelled with the service's own pure decision,
``ckptstore_core.retention.kept_steps``, applied to the model after each step once /healthz
reports the background pass done (``wait_idle``): the test checks that the service applies
it, and when, not the decision itself (``tests/unit/test_retention_policy.py`` does that).
A run's policy outlives a ``delete_run`` (the run's row stays, docs/lifecycle.md).

The service runs with a small chunk size, keyframes every 3 checkpoints and re-roots at
depth 2, so chains, keyframes and re-roots (and deletes in re-rooted chains) happen within
a few saves. States are small (about 0.5 MB), a function of their ``Content`` (lineage,
saving run, step), and change slowly from step to step (a small drift everywhere and a
moving band of new values): deltas, refs to a frozen tensor and bf16 copies all occur.
Steps are drawn from a small range, so saves arrive out of order, land between existing
checkpoints, repeat a committed step (an idempotent retry) and reuse deleted steps.

One rule, ``act``, draws the action of each step uniformly (saves twice as often) rather
than one rule per action: hypothesis' stateful testing enables a random subset of rules
per example ("swarm testing"), which over the few examples this test can afford left
whole actions (retention, pins) out of every sequence, and spent examples on one action
repeated. A failure's report names each step's action and its arguments (the labelled
draws).

Reproducibility: ``derandomize=True`` and ``database=None``. Each example starts a real
service, so the test can afford only a few (``max_examples`` below); exploring a fresh
random handful on every CI run would make a failure appear on one run and not the next.
Derandomized, the same sequences run every time: a failure reproduces by rerunning the
test, and hypothesis prints the failing sequence of steps. To explore other
sequences locally, set ``CKPTSTORE_STATEFUL_EXAMPLES`` (more examples) and
``CKPTSTORE_STATEFUL_SEED`` (an integer: random exploration from that seed instead of the
derandomized set; the seed is printed).

Shrinking is off unless ``CKPTSTORE_STATEFUL_SHRINK=1``: every shrink attempt replays a
sequence against a fresh service, so shrinking one failure took hypothesis' full five
minutes (a deliberately broken retention pass, whose unshrunk failure was reported in
seconds). Unshrunk, the report is the whole failing sequence, at most
``stateful_step_count`` steps, which reruns as it is; shrink it locally with that setting.

Forks (issue 20, item 4): a ``fork`` action forks any checkpoint (a fork's too) into an
empty run; the model gives the fork the source's content and metadata, and its later saves
states of the source's lineage (a fine-tune: deltas of the source's chunks). Deletes,
``delete_run`` and retention of a source must leave its forks' bytes whole: after them
every checkpoint of every run is loaded.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import HealthCheck, Phase, note, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import create_engine, text

from ckptstore import CheckpointClient
from ckptstore_core.errors import CheckpointExists, CheckpointPinned
from ckptstore_core.retention import Candidate, KeepBest, RetentionPolicy, kept_steps
from support.blobs import check_store
from support.pg import pg_database
from support.s3server import s3_store
from support.serviceproc import Service, wait_idle
from support.states import assert_same_state

RUNS = ("r0", "r1", "f")  # "f" starts empty: the first fork's target
MAX_STEP = 12  # steps 0..12: out-of-order saves, repeats and reused steps are common
ENV = {
    "CKPTSTORE_GARBAGE_GRACE_S": "0",
    "CKPTSTORE_SWEEP_INTERVAL_S": "1",
    "CKPTSTORE_REROOT_QUIET_S": "0",
    "CKPTSTORE_REROOT_DEPTH": "2",
    "CKPTSTORE_KEYFRAME_INTERVAL": "3",
    "CKPTSTORE_CHUNK_BYTES": str(64 << 10),
}
EXAMPLES = os.environ.get("CKPTSTORE_STATEFUL_EXAMPLES")  # default: per backend, below
STEPS = 20
SEED = os.environ.get("CKPTSTORE_STATEFUL_SEED")
SHRINK = os.environ.get("CKPTSTORE_STATEFUL_SHRINK") == "1"
# What each step does; saves twice as often as the rest (chains must grow to be cut).
ACTIONS = (
    "save",
    "save",
    "delete",
    "delete_run",
    "pin_or_unpin",
    "retention",
    "restart",
    "load",
    "fork",
)
NEED_A_CHECKPOINT = {"delete", "delete_run", "pin_or_unpin", "load", "fork"}
POLICIES = st.none() | st.builds(
    RetentionPolicy,
    keep_last=st.none() | st.integers(1, 4),
    keep_every=st.none() | st.integers(2, 5),
    keep_best=st.none()
    | st.builds(KeepBest, st.just("eval_loss"), st.sampled_from(["min", "max"]), st.integers(1, 3)),
)


@dataclass(frozen=True)
class Content:
    """What a checkpoint holds: the states of ``base``'s lineage (a run and its forks share
    its base tensors), as ``variant`` (the run that saved it) moves them at ``step``."""

    base: str
    variant: str
    step: int


@lru_cache(maxsize=256)
def state_of(content: Content) -> dict[str, Any]:
    """A checkpoint's state: a function of ``content``, close to its neighbours' (the
    previous step's, and a fork's source's)."""
    g = torch.Generator().manual_seed(RUNS.index(content.base))
    base = torch.randn(1 << 16, generator=g)  # 256 KiB: 4 chunks
    drift = torch.randn(1 << 16, generator=g)
    frozen = torch.randn(1 << 15, generator=g)  # never changes: refs
    step = content.step
    w = base + 1e-4 * step * drift
    band = (step * 5003) % (w.numel() - 2048)
    band_seed = step * len(RUNS) + RUNS.index(content.variant)
    w[band : band + 2048] = torch.randn(2048, generator=torch.Generator().manual_seed(band_seed))
    return {
        "w": w,
        "w_bf16": w.to(torch.bfloat16),
        "frozen": frozen,
        "counter": torch.tensor([step], dtype=torch.int64),
        "step": step,
    }


def metadata_of(run: str, step: int) -> dict[str, Any] | None:
    """The metadata saved with ``run@step``: an ``eval_loss`` (ties included) on two steps
    of three, none on the third; a function of both, so a repeated save is a retry."""
    if step % 3 == 2:
        return None
    return {"eval_loss": ((step * 7 + RUNS.index(run) * 3) % 5) / 4, "run": run}


@dataclass(frozen=True)
class Ckpt:
    """A committed checkpoint in the model."""

    metadata: dict[str, Any]
    pinned: bool
    content: Content


@dataclass
class Model:
    """What the service should hold: per run, the committed checkpoints by step, the run's
    own retention policy (None: keep everything), and its lineage: the base whose states
    its saves hold (its own; its source's once it is a fork, until the run is deleted)."""

    steps: dict[str, dict[int, Ckpt]] = field(default_factory=lambda: {r: {} for r in RUNS})
    policy: dict[str, RetentionPolicy | None] = field(default_factory=lambda: dict.fromkeys(RUNS))
    lineage: dict[str, str] = field(default_factory=lambda: {r: r for r in RUNS})

    def apply_retention(self) -> None:
        """Drop what each run's policy does not keep. Applying a policy again where no pass
        ran changes nothing: only a save, a policy or an unpin (each followed by the run's
        pass) can make a run hold a checkpoint its policy does not keep; a delete, of its
        own or of a fork's source, only adds to what the rules keep."""
        for run, ckpts in self.steps.items():
            candidates = [Candidate(s, c.pinned, c.metadata) for s, c in ckpts.items()]
            for step in set(ckpts) - kept_steps(self.policy[run], candidates):
                del ckpts[step]


class LifecycleMachine(RuleBasedStateMachine):
    """The machine; ``backend`` (set by the test) gives each example a fresh service's
    settings and the check that its blob store holds exactly what its catalog names."""

    backend: ClassVar[Backend]

    def __init__(self) -> None:
        super().__init__()
        self.exits = ExitStack()
        self.model = Model()
        self.svc, self.check_blobs = self.backend.start(self.exits)
        self.client = CheckpointClient(self.svc.url)
        self.exits.callback(self.client.close)
        self.to_load: set[tuple[str, int]] = set()  # what the next invariant check loads

    def teardown(self) -> None:
        self.exits.close()

    # -- rules ------------------------------------------------------------------------------

    @initialize()
    def first_saves(self) -> None:
        """Every example starts with a chain in r0 and r1 (keyframes, a re-root), so the
        actions have material from the first step; f stays empty, for a fork."""
        for run, steps in (("r0", range(6)), ("r1", range(3))):
            for step in steps:
                self.save_step(run, step)

    @rule(action=st.sampled_from(ACTIONS), data=st.data())
    def act(self, action: str, data: st.DataObject) -> None:
        """One action, drawn uniformly at each step (see the module's docstring: why one
        rule rather than one per action); its arguments are drawn inside, labelled."""
        if action in NEED_A_CHECKPOINT and not self.runs_with_checkpoints():
            action = "save"  # nothing to delete, pin or load
        getattr(self, action)(data)

    # -- actions ----------------------------------------------------------------------------

    def save(self, data: st.DataObject) -> None:
        run = data.draw(st.sampled_from(RUNS), label="run")
        self.save_step(run, data.draw(st.integers(0, MAX_STEP), label="step"))

    def delete(self, data: st.DataObject) -> None:
        """Any checkpoint (the newest, a keyframe, a re-root's root...); a pinned one
        refuses."""
        run, step = self.draw_checkpoint(data)
        note(f"deleting {run}@{step}: {self.kind_of(run, step)}")
        if self.model.steps[run][step].pinned:
            with pytest.raises(CheckpointPinned):
                self.client.delete(run, step)
        else:
            self.client.delete(run, step)
            del self.model.steps[run][step]
        self.settle()
        self.load_all()

    def delete_run(self, data: st.DataObject) -> None:
        """A whole run; refused (nothing deleted) while one of its checkpoints is pinned.
        Its policy stays with the run; its forks keep every byte."""
        run, _ = self.draw_checkpoint(data)
        if any(c.pinned for c in self.model.steps[run].values()):
            with pytest.raises(CheckpointPinned):
                self.client.delete_run(run)
        else:
            self.client.delete_run(run)
            self.model.steps[run].clear()
            self.model.lineage[run] = run
        self.settle()
        self.load_all()

    def pin_or_unpin(self, data: st.DataObject) -> None:
        """Toggle a checkpoint's pin; unpinning schedules the run's retention pass."""
        run, step = self.draw_checkpoint(data)
        ckpt = self.model.steps[run][step]
        info = self.client.unpin(run, step) if ckpt.pinned else self.client.pin(run, step)
        assert info.pinned is not ckpt.pinned
        self.model.steps[run][step] = replace(ckpt, pinned=not ckpt.pinned)
        self.settle()
        self.load_all()

    def retention(self, data: st.DataObject) -> None:
        """Set a run's policy (applied at once, in the background), or clear it."""
        run = data.draw(st.sampled_from(RUNS), label="run")
        policy = data.draw(POLICIES, label="policy")
        if policy is None:
            assert self.client.clear_retention(run) is None  # no service default
        else:
            stored = self.client.set_retention(
                run, policy.keep_last, policy.keep_every, policy.keep_best
            )
            assert stored == policy
        self.model.policy[run] = policy
        self.settle()
        self.load_all()

    def restart(self, data: st.DataObject) -> None:
        """Stop (or SIGKILL) the service and start it again on the same data: every
        checkpoint loads exactly, and its start's collection leaves nothing behind."""
        if data.draw(st.booleans(), label="crash"):
            self.svc.kill()
        else:
            self.svc.stop()
        self.svc.start()
        self.load_all()

    def load(self, data: st.DataObject) -> None:
        """One checkpoint at random (the other actions load only what they touched)."""
        self.to_load.add(self.draw_checkpoint(data))

    def fork(self, data: st.DataObject) -> None:
        """Fork any checkpoint (a fork's included) into an empty run: it loads to the
        source's bytes, with the source's metadata; later saves to it are close to the
        source's states (a fine-tune). A target with checkpoints refuses (409), or is
        deleted first (what the 409 says to do)."""
        src_run, step = self.draw_checkpoint(data)
        targets = [r for r in RUNS if r != src_run]
        new_run = data.draw(st.sampled_from(targets), label="new_run")
        source = self.model.steps[src_run][step]
        held = self.model.steps[new_run]
        unpinned = held and not any(c.pinned for c in held.values())
        if unpinned and data.draw(st.booleans(), label="delete the target first"):
            self.client.delete_run(new_run)  # what the 409 says to do
            held.clear()
        if len(held) >= 2:  # one could be this very fork: a retry
            with pytest.raises(CheckpointExists):
                self.client.fork(src_run, step, new_run)
            return
        if held:
            return  # whether it is "this very fork" depends on chunk rows: not modelled
        info = self.client.fork(src_run, step, new_run)
        assert (info.run, info.step, info.stored_bytes) == (new_run, step, 0)
        assert info.metadata == source.metadata and not info.pinned
        self.model.steps[new_run][step] = Ckpt(source.metadata, False, source.content)
        self.model.lineage[new_run] = source.content.base
        self.settle()
        self.to_load.add((new_run, step))

    # -- helpers ----------------------------------------------------------------------------

    def save_step(self, run: str, step: int) -> None:
        """Save ``run@step``. A repeat of a committed step is a retry (same content and
        metadata: nothing changes) unless that step holds other content (a fork's first
        checkpoint): 409. The run's retention pass then applies its policy."""
        meta = metadata_of(run, step)
        content = Content(self.model.lineage[run], run, step)
        old = self.model.steps[run].get(step)
        if old is not None and (old.content, old.metadata) != (content, meta or {}):
            with pytest.raises(CheckpointExists):
                self.client.save(run, step, state_of(content), metadata=meta)
            return
        info = self.client.save(run, step, state_of(content), metadata=meta)
        assert info.step == step and info.metadata == (meta or {})
        pinned = old is not None and old.pinned
        self.model.steps[run][step] = Ckpt(meta or {}, pinned, content)
        self.settle()
        if step in self.model.steps[run]:
            self.to_load.add((run, step))

    def kind_of(self, run: str, step: int) -> str:
        """What ``run@step`` is in its chain (a note in a failure's report)."""
        infos = {i.step: i for i in self.client.list(run)}
        info = infos[step]
        kinds = ["pinned"] if info.pinned else []
        kinds += ["newest"] if step == max(infos) else []
        kinds += ["keyframe"] if info.keyframe else []
        kinds += ["re-rooted"] if info.parent_step is None and not info.keyframe else []
        kinds += ["a fork"] if info.stored_bytes == 0 else []
        return " ".join(kinds) or "delta"

    def runs_with_checkpoints(self) -> list[str]:
        return [r for r in RUNS if self.model.steps[r]]

    def draw_checkpoint(self, data: st.DataObject) -> tuple[str, int]:
        """A committed checkpoint of any run (``act`` made sure there is one)."""
        run = data.draw(st.sampled_from(self.runs_with_checkpoints()), label="run")
        return run, data.draw(st.sampled_from(sorted(self.model.steps[run])), label="step")

    def settle(self) -> None:
        """Wait for the service's background passes (retention, re-root, collection), and
        apply the runs' policies to the model as the service should have."""
        wait_idle(self.svc.url)
        self.model.apply_retention()

    def load_all(self) -> None:
        """Load every checkpoint at the next check (a delete's re-base may reach into
        other runs: its source's forks)."""
        self.to_load |= {(run, step) for run in RUNS for step in self.model.steps[run]}

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def listings_match_the_model(self) -> None:
        for run in RUNS:
            expected = {s: (c.metadata, c.pinned) for s, c in self.model.steps[run].items()}
            if not expected:
                assert run not in {r.name for r in self.client.runs()}
                continue
            listed = {i.step: (i.metadata, i.pinned) for i in self.client.list(run)}
            assert listed == expected, run

    @invariant()
    def loads_are_exact(self) -> None:
        for run, step in sorted(self.to_load):
            ckpt = self.model.steps[run].get(step)
            if ckpt is not None:
                got = self.client.load(run, step)
                assert_same_state(state_of(ckpt.content), got, path=f"{run}@{step}")
        for run in {r for r, _ in self.to_load}:
            if self.model.steps[run]:
                newest = self.model.steps[run][max(self.model.steps[run])]
                got = self.client.load(run)
                assert_same_state(state_of(newest.content), got, path=f"{run}@latest")
        self.to_load.clear()

    @invariant()
    def blob_store_holds_exactly_what_the_catalog_names(self) -> None:
        self.check_blobs(self.svc, self.client)


@dataclass
class Backend:
    """Starts one example's service on fresh storage (registering its clean-up on the
    stack) and returns it with its blob store's check."""

    start: Callable[[ExitStack], tuple[Service, Callable[[Service, CheckpointClient], object]]]


def sqlite_backend(tmp_path: Path) -> Backend:
    """SQLite and a local folder under ``tmp_path``, a new folder for each example."""

    def start(exits: ExitStack) -> tuple[Service, Callable[[Service, CheckpointClient], object]]:
        data = tmp_path / uuid.uuid4().hex[:8]
        exits.callback(shutil.rmtree, data, ignore_errors=True)
        svc = Service(data, ENV)
        exits.callback(svc.stop)
        return svc.start(), check_store

    return Backend(start)


NAMED_BLOBS = "SELECT blob_key FROM checkpoints UNION SELECT blob_key FROM parts"


def check_bucket(database_url: str, env: dict[str, str]) -> Callable[[Service, object], None]:
    """The S3 counterpart of ``check_store``: once the service collected (grace 0), the
    bucket holds exactly the blobs the PostgreSQL catalog names, and its garbage table is
    empty."""

    def check(svc: Service, client: object) -> None:
        wait_idle(svc.url)
        engine = create_engine(database_url)
        try:
            with engine.connect() as db:
                named = {k for (k,) in db.execute(text(NAMED_BLOBS)) if k}
                garbage = db.execute(text("SELECT count(*) FROM garbage")).scalar_one()
        finally:
            engine.dispose()
        store = s3_store(env)
        try:
            assert set(store.iter_keys()) == named
        finally:
            store.close()
        assert garbage == 0

    return check


def postgres_s3_backend(tmp_path: Path, backends: dict[str, str]) -> Backend:
    """For each example a fresh PostgreSQL database and a fresh prefix of the bucket of
    ``backends`` (tests/integration/conftest.py)."""

    def start(exits: ExitStack) -> tuple[Service, Callable[[Service, CheckpointClient], object]]:
        url = exits.enter_context(pg_database())
        prefix = f"{backends['CKPTSTORE_BLOB_URL']}/{uuid.uuid4().hex[:8]}"
        env = {**backends, **ENV, "CKPTSTORE_DATABASE_URL": url, "CKPTSTORE_BLOB_URL": prefix}
        data = tmp_path / uuid.uuid4().hex[:8]
        exits.callback(shutil.rmtree, data, ignore_errors=True)
        svc = Service(data, env)
        exits.callback(svc.stop)
        return svc.start(), check_bucket(url, env)

    return Backend(start)


def run_machine(backend: Backend, examples: int) -> None:
    """Run the machine on ``backend`` with this test's bounded, reproducible settings:
    ``examples`` sequences (unless CKPTSTORE_STATEFUL_EXAMPLES says otherwise)."""
    machine = type("Machine", (LifecycleMachine,), {"backend": backend})
    options = settings(
        max_examples=int(EXAMPLES or examples),
        stateful_step_count=STEPS,
        deadline=None,
        database=None,
        derandomize=SEED is None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        print_blob=True,
        phases=list(Phase) if SHRINK else [Phase.explicit, Phase.reuse, Phase.generate],
    )
    if SEED is not None:
        print(f"CKPTSTORE_STATEFUL_SEED={SEED}")
        machine = seed(int(SEED))(machine)
    run_state_machine_as_test(machine, settings=options)


@pytest.mark.slow
def test_lifecycle_state_machine_on_sqlite(tmp_path: Path) -> None:
    run_machine(sqlite_backend(tmp_path), examples=6)  # about 45 s here


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.s3
def test_lifecycle_state_machine_on_postgres_and_s3(
    tmp_path: Path, backends: dict[str, str]
) -> None:
    run_machine(postgres_s3_backend(tmp_path, backends), examples=3)  # about 60 s here
