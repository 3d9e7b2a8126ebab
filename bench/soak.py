"""A soak: two replicas on PostgreSQL + S3 (moto) under writers, readers, retention, slow
clients and a replica SIGKILLed at random, then every guarantee checked (issue 21, item 8).

    .venv/bin/python bench/soak.py --minutes 10 [--replicas 2] [--writers 4] [--readers 2]
        [--slow-clients 2] [--kill-every 60] [--keep-last 3] [--keep-every 5] [--json OUT]

What runs, for ``--minutes``:

* ``--replicas`` service processes (``ckptstore-service serve``) sharing one fresh
  PostgreSQL database and one fresh bucket on a moto S3 server;
* ``--writers`` threads, each training a tiny model with AdamW (about 4 k parameters) and
  saving ``{"model", "optim", "step"}`` to a run of its own after every step, through a
  random replica (the other one when it cannot be reached), retrying its step until it is
  committed; each run has a retention policy (``--keep-last``, ``--keep-every``);
* ``--readers`` threads loading random committed checkpoints (and ``latest``) through
  random replicas and comparing every byte with what was saved (a fingerprint of each
  state: per tensor its dtype, shape and xxh3-128, per other leaf its type and value). A
  ``checkpoint_not_found`` is right only for a step the retention policy may have taken;
* ``--slow-clients`` threads on raw sockets, each in turn: a request whose body never
  comes, a body that stalls after its header and a few bytes, a body that trickles 4 bytes/s.
  Each must be cut with ``408 request_timeout`` within its bound, and leaves nothing;
* every ``--kill-every`` seconds (0.5x to 1.5x, at random) one replica at random is
  SIGKILLed and restarted at once on its port;
* every 2 s each replica's RSS is sampled and its ``/readyz`` timed.

Every HTTP request is timed by kind, and its failure classified: connection errors (a
killed replica) and ``503`` (``storage_unavailable``, ``lock_lost``, ``too_many_uploads``)
are the retriable kinds allowed; anything else fails the soak.

Then the checks (the exit status is 1 if any fails):

* ``exact``: no load ever returned other bytes than saved; ``no_disallowed_errors`` and
  ``no_failures``: no other failure (the load stops at the first one);
* ``retention``: once a last retention pass ran, each run lists exactly the committed steps
  its policy keeps (``ckptstore_core.retention.kept_steps``), and each of them loads
  bit-exactly; the slow clients' runs hold nothing;
* ``no_orphans``: with every replica stopped, crashed uploads and due garbage collected (as
  with grace 0), the bucket holds exactly the blobs the catalog names, no multipart upload is
  open, no ``writing`` row is left;
* ``latency``: the longest request of each kind is within its documented bound (printed
  beside it; from the settings the replicas run with: docs/configuration.md and
  docs/deployment.md);
* ``connection_errors_explained``: every connection error happened while its replica was
  down (killed, not yet restarted); one that no kill explains is a response the service
  cut short;
* ``no_data_errors_logged``: no replica logged ``blob_not_found``, ``corrupt_data``,
  ``internal_error`` or an unhandled error (its other ERROR lines are counted, a figure);
* ``rss``: printed per replica as a slope in MB/min (a least-squares fit over each
  incarnation's samples after its first 20 s, pooled: a restart does not count as a
  drop); checked against ``--max-rss-slope`` only when given.

Needs the PostgreSQL server of the tests (``CKPTSTORE_TEST_PG_URL``, docs/testing.md) and
moto; reuses the tests' helpers (``tests/support``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import random
import re
import socket
import statistics
import struct
import sys
import threading
import time
import traceback
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import httpx
import torch
import xxhash
from torch import nn

from ckptstore import CheckpointClient
from ckptstore.state import tensor_bytes
from ckptstore_core.errors import CheckpointNotFound, CkptStoreError, RunNotFound
from ckptstore_core.retention import Candidate, RetentionPolicy, kept_steps
from support.blobs import named_blobs
from support.bodies import partial_upload, read_response, valid_body
from support.pg import pg_database
from support.s3server import fake_aws_credentials, s3_store, start_moto_process
from support.serviceproc import Service, wait_idle

#: what the replicas run with besides their backends: small chunks, keyframes and re-roots so
#: that deltas, re-roots and the sweep all happen; short upload limits so that slow clients
#: are cut within seconds. The bounds below are computed from these.
SETTINGS = {
    "CKPTSTORE_CHUNK_BYTES": str(64 << 10),
    "CKPTSTORE_KEYFRAME_INTERVAL": "4",
    "CKPTSTORE_REROOT_DEPTH": "3",
    "CKPTSTORE_REROOT_QUIET_S": "0.5",
    "CKPTSTORE_SWEEP_INTERVAL_S": "5",
    "CKPTSTORE_UPLOAD_IDLE_TIMEOUT_S": "5",
    "CKPTSTORE_UPLOAD_MIN_RATE_BYTES_S": "1024",
    "CKPTSTORE_UPLOAD_RATE_WINDOW_S": "10",
    "CKPTSTORE_LOCK_LEASE_S": "15",
    "CKPTSTORE_S3_CONNECT_TIMEOUT_S": "5",
    "CKPTSTORE_S3_READ_TIMEOUT_S": "20",
    "CKPTSTORE_S3_DEADLINE_S": "60",
    "CKPTSTORE_READINESS_TIMEOUT_S": "3",
}

#: seconds added to a bound for a loaded machine (2 cores shared by the replicas, moto,
#: PostgreSQL and this process): the time to notice, answer and be scheduled
SLACK_S = 2.0

#: failure kinds a retry may fix: what a client sees while a replica is killed or restarted
ALLOWED = {
    "connection",
    "503 storage_unavailable",
    "503 lock_lost",
    "503 too_many_uploads",
    "503 service_unavailable",
}

WARMUP_S = 20.0  # RSS samples of a replica's first seconds are left out of its slope

#: the options the JSON repeats
CONFIG = ("minutes", "replicas", "writers", "readers", "slow_clients", "kill_every")
CONFIG += ("keep_last", "keep_every", "save_pause", "max_rss_slope", "seed")


def bounds(settings: dict[str, str]) -> dict[str, tuple[float, str]]:
    """The documented bound of each request kind, with where it comes from."""
    s = {k.removeprefix("CKPTSTORE_").lower(): float(v) for k, v in settings.items()}
    deadline, lease = s["s3_deadline_s"], s["lock_lease_s"]
    idle, window = s["upload_idle_timeout_s"], s["upload_rate_window_s"]
    return {
        "save": (
            lease + deadline + SLACK_S,
            "LOCK_LEASE_S (a killed replica's run lock) + S3_DEADLINE_S (one stalled S3 call)",
        ),
        "save_committed": (
            lease + deadline + SLACK_S,
            "the same: a save with its retries through the other replica, until committed",
        ),
        "load": (deadline + SLACK_S, "S3_DEADLINE_S (deployment.md: bounded waits)"),
        "final_load": (deadline + SLACK_S, "S3_DEADLINE_S"),
        "load_latest": (deadline + SLACK_S, "S3_DEADLINE_S"),
        "list": (deadline + SLACK_S, "S3_DEADLINE_S"),
        "set_retention": (deadline + SLACK_S, "S3_DEADLINE_S"),
        "readyz": (s["readiness_timeout_s"] + SLACK_S, "READINESS_TIMEOUT_S (deployment.md)"),
        "slow_silent": (idle + SLACK_S, "UPLOAD_IDLE_TIMEOUT_S (no body byte)"),
        "slow_stall": (idle + SLACK_S, "UPLOAD_IDLE_TIMEOUT_S (stalled after its header)"),
        "slow_trickle": (window + SLACK_S, "UPLOAD_RATE_WINDOW_S (under MIN_RATE_BYTES_S)"),
    }


# -- states and their fingerprints -------------------------------------------------------------


def fingerprint(state: object) -> dict[str, str]:
    """What bit-exactness compares, per path: a tensor's dtype, shape and xxh3-128 of its
    bytes; a float's bits; any other leaf's type and repr; a container's type and keys."""
    out: dict[str, str] = {}

    def walk(obj: object, path: str) -> None:
        kind = type(obj).__name__
        if isinstance(obj, torch.Tensor):
            digest = xxhash.xxh3_128_hexdigest(tensor_bytes(obj.detach()))
            out[path] = f"tensor {obj.dtype} {tuple(obj.shape)} {digest}"
        elif isinstance(obj, dict):
            keys = [f"{type(k).__name__}:{k!r}" for k in obj]
            out[path] = f"{kind} {keys} {getattr(obj, '_metadata', None)!r}"
            for k, v in obj.items():
                walk(v, f"{path}/{k!r}")
        elif isinstance(obj, list | tuple):
            out[path] = f"{kind} {len(obj)}"
            for i, v in enumerate(obj):
                walk(v, f"{path}/{i}")
        elif isinstance(obj, float):
            out[path] = f"float {struct.pack('<d', obj).hex()}"
        else:
            out[path] = f"{kind} {obj!r}"

    walk(state, "")
    return out


def differences(want: dict[str, str], got: dict[str, str]) -> list[str]:
    """The paths where two fingerprints differ (first few)."""
    paths = sorted(p for p in want.keys() | got.keys() if want.get(p) != got.get(p))
    return paths[:5]


class Trainer:
    """A tiny model and AdamW, one step of training at a time: a state that changes a
    little everywhere at each step, as a real run's checkpoints do."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.gen = torch.Generator().manual_seed(seed)

    def step(self, step: int) -> dict[str, Any]:
        x = torch.randn(16, 32, generator=self.gen)
        loss = (self.model(x) - x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return {
            "model": self.model.state_dict(),
            "optim": self.opt.state_dict(),
            "step": step,
            "loss": loss.item(),
        }


# -- what the threads record -------------------------------------------------------------------


def classify(exc: BaseException) -> str:
    """A failure's kind: ``connection``, ``<status> <code>``, or the exception's type."""
    if isinstance(exc, CkptStoreError):
        if exc.code == "service_unavailable":  # the client could not reach the replica
            return "connection"
        code = exc.code
        text = str(exc)
        if type(exc) is CkptStoreError and text.startswith("["):  # a code the client lacks
            code = text[1:].partition("]")[0]
        return f"{exc.status} {code}"
    if isinstance(exc, OSError | http.client.HTTPException):
        return "connection"
    return type(exc).__name__


@dataclass
class Record:
    """Everything the soak measured; shared by its threads under ``lock``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    latency: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: dict[str, dict[str, int]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(int))
    )
    failures: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    kills: list[dict[str, Any]] = field(default_factory=list)
    rss: dict[str, list[tuple[float, int, float]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    backlog: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    #: connection failures: (kind, replica, start, end), monotonic seconds
    cut: list[tuple[str, int, float, float]] = field(default_factory=list)
    #: each replica's time down: [SIGKILL, restarted] (inf while restarting)
    down: dict[int, list[list[float]]] = field(default_factory=lambda: defaultdict(list))

    def took(
        self, kind: str, seconds: float, error: str | None = None, replica: int | None = None
    ) -> None:
        """A request of ``kind`` took ``seconds``; ``error``: how it failed (a connection
        failure is kept with ``replica``, to be matched with that replica's kills)."""
        with self.lock:
            self.latency[kind].append(seconds)
            if error == "connection" and replica is not None:
                now = time.monotonic()
                self.cut.append((kind, replica, now - seconds, now))
            if error is not None:
                self.errors[kind][error] += 1
                if error not in ALLOWED:
                    self.failures.append(f"{kind}: disallowed error {error}")

    def count(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.counts[what] += n

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)


@dataclass
class Run:
    """One writer's run: the fingerprints of the steps it began saving, and those committed."""

    name: str
    prints: dict[int, dict[str, str]] = field(default_factory=dict)
    committed: list[int] = field(default_factory=list)
    begun: int = -1


class Soak:
    """The replicas, the threads, and what they record."""

    def __init__(self, args: argparse.Namespace, env: dict[str, str], root: Path) -> None:
        self.args = args
        self.env = env
        self.rec = Record()
        self.stop = threading.Event()
        self.lock = threading.Lock()  # runs' fields
        self.replicas = [Service(root / f"replica{i}", env) for i in range(args.replicas)]
        self.starts = [0] * args.replicas
        self.down: set[int] = set()  # replicas between their kill and their restart
        self.policy = RetentionPolicy(keep_last=args.keep_last, keep_every=args.keep_every)
        self.runs = [Run(f"w{i}") for i in range(args.writers)]
        self.t0 = time.monotonic()
        self.phases: dict[str, float] = {}
        self.clients = [CheckpointClient(r.url, retries=0, timeout=120) for r in self.replicas]

    # -- replicas

    def start(self, i: int) -> None:
        self.replicas[i].start(timeout=180)
        self.starts[i] += 1

    def kill_loop(self) -> None:
        """Every ``--kill-every`` s (0.5x to 1.5x): one replica SIGKILLed and restarted."""
        rng = random.Random(self.args.seed)
        while not self.stop.wait(self.args.kill_every * rng.uniform(0.5, 1.5)):
            i = rng.randrange(len(self.replicas))
            with self.lock:
                self.down.add(i)
            window = [time.monotonic(), math.inf]
            with self.rec.lock:
                self.rec.down[i].append(window)
            self.replicas[i].kill()
            killed = time.monotonic()
            try:
                self.start(i)
            except Exception as exc:
                self.rec.fail(f"replica {i} did not restart: {exc}")
                return
            finally:
                with self.lock:
                    self.down.discard(i)
                window[1] = time.monotonic()
            self.rec.kills.append(
                {
                    "replica": i,
                    "at_s": round(killed - self.t0, 1),
                    "restart_s": round(time.monotonic() - killed, 2),
                }
            )

    def sample_loop(self) -> None:
        """Every 2 s: each live replica's RSS, how long its /readyz and /healthz take, and
        its maintenance backlog (/healthz: the runs whose background pass is queued or runs)."""
        with httpx.Client(timeout=60) as http:
            while not self.stop.wait(2.0):
                for i, svc in enumerate(self.replicas):
                    with self.lock:
                        if i in self.down:
                            continue
                    try:
                        rss = svc.rss_bytes() / 1e6
                    except (OSError, RuntimeError, AssertionError):
                        continue
                    with self.rec.lock:
                        self.rec.rss[f"replica{i}"].append(
                            (time.monotonic() - self.t0, self.starts[i], rss)
                        )
                    t = time.perf_counter()
                    try:
                        code = http.get(f"{svc.url}/readyz").status_code
                        error = None if code == 200 else f"{code} not_ready"
                    except httpx.TransportError:
                        error = "connection"
                    self.rec.took("readyz", time.perf_counter() - t, error, i)
                    self.sample_health(http, i)

    def sample_health(self, http: httpx.Client, i: int) -> None:
        t = time.perf_counter()
        try:
            response = http.get(f"{self.replicas[i].url}/healthz")
        except httpx.TransportError:
            self.rec.took("healthz", time.perf_counter() - t, "connection", i)
            return
        ok = response.status_code == 200
        self.rec.took("healthz", time.perf_counter() - t, None if ok else f"{response.status_code}")
        if ok:
            with self.rec.lock:
                self.rec.backlog[f"replica{i}"].append(int(response.json()["maintenance"]))

    # -- calls through the replicas

    def pick(self, rng: random.Random) -> list[int]:
        """The replicas in the order to try them: a random one first."""
        first = rng.randrange(len(self.replicas))
        return [(first + k) % len(self.replicas) for k in range(len(self.replicas))]

    def call(
        self, kind: str, rng: random.Random, fn: Callable[[CheckpointClient], Any], give_up_s: float
    ) -> Any:
        """``fn(client)`` through a random replica, again (the other replicas first) after
        each retriable failure, until it succeeds; each attempt timed and classified. Raises
        the error of a disallowed failure, or the last one after ``give_up_s``."""
        deadline = time.monotonic() + give_up_s
        n = 0
        while True:
            for i in self.pick(rng):
                t = time.perf_counter()
                try:
                    result = fn(self.clients[i])
                except (CheckpointNotFound, RunNotFound):
                    self.rec.took(kind, time.perf_counter() - t)
                    raise
                except Exception as exc:
                    error = classify(exc)
                    self.rec.took(kind, time.perf_counter() - t, error, i)
                    if error not in ALLOWED or time.monotonic() > deadline:
                        raise
                    n += 1
                    time.sleep(min(3.0, 0.1 * 2 ** min(n, 5)) * rng.uniform(0.5, 1.5))
                    continue
                self.rec.took(kind, time.perf_counter() - t)
                return result

    # -- the threads

    def writer(self, w: int) -> None:
        run = self.runs[w]
        rng = random.Random(1000 + w)
        trainer = Trainer(seed=w)
        self.call(
            "set_retention",
            rng,
            lambda c: c.set_retention(run.name, self.policy.keep_last, self.policy.keep_every),
            120,
        )
        step = 0
        while not self.stop.is_set():
            state = trainer.step(step)
            with self.lock:
                run.prints[step] = fingerprint(state)
                run.begun = step
            # a step is retried until it is committed, even past the end (a replica may
            # have committed it without answering): what was begun must be known
            t = time.perf_counter()
            self.call("save", rng, lambda c, s=state, k=step: c.save(run.name, k, s), 300)
            self.rec.took("save_committed", time.perf_counter() - t)
            with self.lock:
                run.committed.append(step)
            self.rec.count("saves")
            step += 1
            if self.args.save_pause:
                self.stop.wait(self.args.save_pause)

    def may_be_gone(self, run: Run, step: int) -> bool:
        """Whether the retention policy may have deleted ``run@step`` by now: not a
        multiple of keep_every, and at least keep_last newer steps begun."""
        with self.lock:
            begun = run.begun
        every, last = self.policy.keep_every, self.policy.keep_last
        return (every is None or step % every != 0) and last is not None and step <= begun - last

    def reader(self, r: int) -> None:
        rng = random.Random(2000 + r)
        while not self.stop.is_set():
            run = rng.choice(self.runs)
            with self.lock:
                steps = list(run.committed)
            if not steps:
                self.stop.wait(0.1)
                continue
            if rng.random() < 0.2:
                try:
                    got = self.call("load_latest", rng, lambda c, r=run.name: c.load(r), 120)
                except CheckpointNotFound:
                    self.rec.fail(f"{run.name}@latest not found")
                    continue
                self.compare(run, int(got["step"]), got, "latest")
                continue
            step = rng.choice(steps)
            try:
                got = self.call("load", rng, lambda c, r=run.name, k=step: c.load(r, k), 120)
            except CheckpointNotFound:
                if self.may_be_gone(run, step):
                    self.rec.count("loads_gone")
                else:
                    self.rec.fail(f"{run.name}@{step} lost: not found, and retention keeps it")
                continue
            self.compare(run, step, got, str(step))

    def compare(self, run: Run, step: int, got: object, asked: str) -> None:
        with self.lock:
            want = run.prints.get(step)
        if want is None:
            self.rec.fail(f"{run.name}@{asked} came back as step {step}, never saved")
            return
        diff = differences(want, fingerprint(got))
        if diff:
            self.rec.count("wrong_bytes")
            self.rec.fail(f"{run.name}@{asked} (step {step}) came back other: {diff}")
        else:
            self.rec.count("loads_exact")

    def slow_client(self, k: int) -> None:
        """Raw sockets, one misbehaviour after the other, each to be cut with a 408."""
        rng = random.Random(3000 + k)
        prefix, data = valid_body(seed=k + 1)
        body = prefix + data
        modes = ["slow_silent", "slow_stall", "slow_trickle"]
        n = 0
        while not self.stop.is_set():
            mode = modes[n % len(modes)]
            i = rng.randrange(len(self.replicas))
            self.slow_request(mode, i, f"slow-{k}", n + 1, body, len(prefix))
            n += 1

    def slow_request(self, mode: str, i: int, run: str, step: int, body: bytes, head: int) -> None:
        url = self.replicas[i].url
        sent = {"slow_silent": b"", "slow_stall": body[: head + 8], "slow_trickle": body[:16]}[mode]
        t = time.perf_counter()
        try:
            sock = partial_upload(url, run, step, sent, len(body), timeout=60)
        except OSError:
            self.rec.took(mode, time.perf_counter() - t, "connection", i)
            return
        try:
            if mode == "slow_trickle":
                self.trickle(sock, body, len(sent))
            status, answer = read_response(sock, timeout=60)
        except (OSError, ValueError, StopIteration):
            self.rec.took(mode, time.perf_counter() - t, "connection", i)  # its replica killed
            return
        finally:
            sock.close()
        code = answer.get("error", {}).get("code") if isinstance(answer, dict) else None  # type: ignore[union-attr]
        error = None if (status, code) == (408, "request_timeout") else f"{status} {code}"
        self.rec.took(mode, time.perf_counter() - t, error)

    def trickle(self, sock: socket.socket, body: bytes, at: int) -> None:
        """4 bytes/s (one every 0.25 s), never idle, until the service answers or closes."""
        sock.settimeout(0.25)
        while at < len(body):
            try:
                sock.recv(1, socket.MSG_PEEK)
                return  # the answer has come, or the connection was closed
            except TimeoutError:
                pass
            sock.sendall(body[at : at + 1])
            at += 1

    # -- the whole

    def guarded(self, name: str, fn: Callable[[], None]) -> threading.Thread:
        def run() -> None:
            try:
                fn()
            except Exception as exc:
                self.rec.fail(f"{name}: {classify(exc)}: {exc}\n{traceback.format_exc()}")

        return threading.Thread(target=run, name=name, daemon=True)

    def run(self) -> None:
        began = time.monotonic()
        for i in range(len(self.replicas)):
            self.start(i)
        self.t0 = time.monotonic()
        self.phases["start_s"] = round(self.t0 - began, 1)
        load = [
            self.guarded(f"writer{w}", lambda w=w: self.writer(w)) for w in range(self.args.writers)
        ]
        load += [
            self.guarded(f"reader{r}", lambda r=r: self.reader(r)) for r in range(self.args.readers)
        ]
        load += [
            self.guarded(f"slow{k}", lambda k=k: self.slow_client(k))
            for k in range(self.args.slow_clients)
        ]
        background = [self.guarded("sampler", self.sample_loop)]
        if self.args.kill_every > 0:
            background.append(self.guarded("killer", self.kill_loop))
        for t in load + background:
            t.start()
        end = self.t0 + self.args.minutes * 60
        while time.monotonic() < end and not self.rec.failures:
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))
        self.stop.set()
        stopped = time.monotonic()
        for t in background + load:
            t.join(400)
            if t.is_alive():
                self.rec.fail(f"{t.name} did not finish")
        self.duration = stopped - self.t0
        self.phases["wind_down_s"] = round(time.monotonic() - stopped, 1)


# -- the checks at the end ----------------------------------------------------------------------


def check_runs(soak: Soak) -> dict[str, Any]:
    """After a last retention pass: each run lists exactly the committed steps its policy
    keeps, on every replica, and each loads bit-exactly; the slow runs hold nothing."""
    out: dict[str, Any] = {"kept": 0, "extra_before_pass": 0, "wrong": 0, "problems": []}
    rng = random.Random(7)
    t = time.monotonic()
    for svc in soak.replicas:
        wait_idle(svc.url, timeout=max(300.0, soak.args.minutes * 60))
    soak.phases["idle_after_load_s"] = round(time.monotonic() - t, 1)
    for run in soak.runs:  # what the passes after the saves left (a killed one left more)
        kept = kept_steps(soak.policy, [Candidate(s) for s in run.committed])
        listed = {i.step for i in soak.clients[0].list(run.name)}
        out["extra_before_pass"] += len(listed - kept)
    for run in soak.runs:
        soak.call(
            "set_retention",
            rng,
            lambda c, r=run.name: c.set_retention(r, soak.policy.keep_last, soak.policy.keep_every),
            120,
        )
    t = time.monotonic()
    for svc in soak.replicas:
        wait_idle(svc.url, timeout=max(300.0, soak.args.minutes * 60))
    soak.phases["last_retention_pass_s"] = round(time.monotonic() - t, 1)
    for run in soak.runs:
        kept = sorted(kept_steps(soak.policy, [Candidate(s) for s in run.committed]))
        for client in soak.clients:
            listed = [i.step for i in client.list(run.name)]
            if listed != kept:
                out["problems"].append(
                    f"{run.name} on {client.url}: lists {listed[:20]}..., retention keeps "
                    f"{kept[:20]}... (missing {sorted(set(kept) - set(listed))[:10]}, "
                    f"extra {sorted(set(listed) - set(kept))[:10]})"
                )
        for n, step in enumerate(kept):
            client = soak.clients[n % len(soak.clients)]
            t = time.perf_counter()
            try:
                got = client.load(run.name, step)
            except CkptStoreError as exc:
                out["problems"].append(f"{run.name}@{step} kept but {classify(exc)}")
                continue
            finally:
                soak.rec.took("final_load", time.perf_counter() - t)
            diff = differences(run.prints[step], fingerprint(got))
            if diff:
                out["wrong"] += 1
                out["problems"].append(f"{run.name}@{step} came back other: {diff}")
            out["kept"] += 1
    names = {r.name for r in soak.clients[0].runs()}
    slow = sorted(n for n in names if n.startswith("slow-"))
    if slow:
        out["problems"].append(f"the slow clients' runs hold checkpoints: {slow}")
    return out


def log_errors(root: Path) -> dict[str, int]:
    """The replicas' ERROR (and CRITICAL) log lines, counted by message with the quoted
    names and numbers left out: a figure, not a check (a warning is no failure)."""
    counts: dict[str, int] = defaultdict(int)
    for log in sorted(root.glob("replica*/service-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            level, _, message = line.partition(" ckptstore: ")
            if not level.endswith(("ERROR", "CRITICAL")):
                continue
            counts[re.sub(r"'[^']*'|\d+(\.\d+)?", "_", message)[:200]] += 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def check_store(env: dict[str, str], lease_s: float) -> dict[str, Any]:
    """With every replica stopped: crashed uploads collected (their leases run out first),
    due garbage collected as with grace 0; then the bucket against the catalog."""
    from ckptstore_service.catalog import Catalog
    from ckptstore_service.maintenance import collect_crashed_uploads, collect_garbage

    url = env["CKPTSTORE_DATABASE_URL"]
    catalog = Catalog(url)
    store = s3_store(env)
    try:
        writing_at_end = len(catalog.uploads_in_progress())
        garbage_at_end = len(catalog.garbage(None, datetime.now(UTC) + timedelta(days=1)))
        deadline = time.monotonic() + lease_s + 30
        crashed = 0
        while True:
            crashed += collect_crashed_uploads(catalog, store, 0)
            if not catalog.uploads_in_progress() or time.monotonic() > deadline:
                break
            time.sleep(1)
        collected = collect_garbage(catalog, store, None, now=datetime.now(UTC) + timedelta(days=1))
        keys, named = set(store.iter_keys()), named_blobs(url)
        return {
            "writing_rows_at_end": writing_at_end,
            "garbage_rows_at_end": garbage_at_end,
            "crashed_uploads_collected": crashed,
            "garbage_collected": collected,
            "writing_rows_left": len(catalog.uploads_in_progress()),
            "garbage_rows_left": len(catalog.garbage(None, datetime.now(UTC) + timedelta(days=1))),
            "blobs": len(keys),
            "orphans": sorted(keys - named)[:20],
            "orphan_count": len(keys - named),
            "missing": sorted(named - keys)[:20],
            "missing_count": len(named - keys),
            "open_uploads": len(store.list_open_uploads()),
        }
    finally:
        store.close()
        catalog.close()


def rss_slope(samples: list[tuple[float, int, float]]) -> dict[str, Any]:
    """MB/min by least squares over each incarnation's samples after its first WARMUP_S,
    pooled (one slope, an intercept per incarnation)."""
    groups: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for t, inc, mb in samples:
        groups[inc].append((t, mb))
    sxy = sxx = 0.0
    span = 0.0
    for points in groups.values():
        start = points[0][0]
        kept = [(t, mb) for t, mb in points if t - start >= WARMUP_S]
        if len(kept) < 3:
            continue
        tm = statistics.fmean(t for t, _ in kept)
        mm = statistics.fmean(mb for _, mb in kept)
        sxy += sum((t - tm) * (mb - mm) for t, mb in kept)
        sxx += sum((t - tm) ** 2 for t, _ in kept)
        span += kept[-1][0] - kept[0][0]
    mbs = [mb for _, _, mb in samples]
    return {
        "slope_mb_per_min": round(sxy / sxx * 60, 3) if sxx else None,
        "fitted_s": round(span, 1),
        "incarnations": len(groups),
        "samples": len(samples),
        "first_mb": round(mbs[0], 1) if mbs else None,
        "last_mb": round(mbs[-1], 1) if mbs else None,
        "max_mb": round(max(mbs), 1) if mbs else None,
    }


def unexplained_cuts(rec: Record, t0: float) -> list[dict[str, Any]]:
    """The connection failures that no kill explains: their replica was not down (killed,
    not yet restarted) at any time between the request's start and 1 s after its failure.
    A response cut short by the service itself (a failed read mid-stream) shows as one."""
    out = []
    for kind, replica, start, end in rec.cut:
        windows = rec.down.get(replica, [])
        if not any(k <= end + 1.0 and r >= start for k, r in windows):
            out.append(
                {
                    "kind": kind,
                    "replica": replica,
                    "at_s": round(start - t0, 2),
                    "took_s": round(end - start, 3),
                }
            )
    return out


#: logged by a replica when a request or a background pass finds data missing or corrupt,
#: or fails on a bug: each such line fails the soak
DATA_ERRORS = ("blob_not_found", "corrupt_data", "internal_error", "unhandled error")


def latency_table(rec: Record, limits: dict[str, tuple[float, str]]) -> dict[str, Any]:
    out = {}
    for kind in sorted(rec.latency):
        xs = sorted(rec.latency[kind])
        bound, why = limits.get(kind, (math.inf, "none documented"))
        out[kind] = {
            "count": len(xs),
            "errors": dict(rec.errors.get(kind, {})),
            "p50_s": round(xs[len(xs) // 2], 3),
            "p99_s": round(xs[min(len(xs) - 1, int(len(xs) * 0.99))], 3),
            "max_s": round(xs[-1], 3),
            "bound_s": bound if bound != math.inf else None,
            "bound_from": why,
            "within": xs[-1] <= bound,
        }
    return out


def report(result: dict[str, Any]) -> None:
    print(f"\nsoak: {result['duration_s']:.0f} s, {result['config']}")
    print("phases (s): " + ", ".join(f"{k} {v}" for k, v in result["phases"].items()))
    c = result["counts"]
    print(
        f"saves {c.get('saves', 0)}, loads exact {c.get('loads_exact', 0)}, loads of steps "
        f"retention took {c.get('loads_gone', 0)}, wrong bytes {c.get('wrong_bytes', 0)}, "
        f"kills {len(result['kills'])}"
    )
    print(
        f"\n{'request':<14}{'count':>7}{'p50 s':>9}{'p99 s':>9}{'max s':>9}{'bound s':>9}"
        "  ok  errors"
    )
    for kind, x in result["latency"].items():
        bound = "-" if x["bound_s"] is None else f"{x['bound_s']:.0f}"
        errors = ", ".join(f"{k}: {n}" for k, n in x["errors"].items()) or "-"
        ok = "yes" if x["within"] else "NO"
        print(
            f"{kind:<14}{x['count']:>7}{x['p50_s']:>9.3f}{x['p99_s']:>9.3f}{x['max_s']:>9.3f}"
            f"{bound:>9}  {ok:<4}{errors}"
        )
    print(
        f"\n{'replica':<10}{'RSS first':>10}{'last':>8}{'max':>8}{'slope MB/min':>14}"
        f"{'fitted s':>10}  incarnations"
    )
    for name, r in result["rss"].items():
        slope = "-" if r["slope_mb_per_min"] is None else f"{r['slope_mb_per_min']:+.2f}"
        print(
            f"{name:<10}{r['first_mb']:>10}{r['last_mb']:>8}{r['max_mb']:>8}{slope:>14}"
            f"{r['fitted_s']:>10}  {r['incarnations']}"
        )
    for name, b in result["maintenance_backlog"].items():
        print(
            f"{name} maintenance backlog (runs): mean {b['mean']}, max {b['max']}, last {b['last']}"
        )
    s, f = result["store"], result["final"]
    print(
        f"\nfinal: {f['kept']} kept checkpoints loaded, {f['wrong']} wrong; "
        f"{f['extra_before_pass']} steps retention had not yet taken"
    )
    print(
        f"store: {s['blobs']} blobs, {s['orphan_count']} orphans, {s['missing_count']} missing, "
        f"{s['open_uploads']} open uploads; at the end {s['writing_rows_at_end']} writing rows "
        f"(crashed uploads not yet collected), {s['crashed_uploads_collected']} collected after"
    )
    cuts = result["unexplained_connection_errors"]
    print(f"connection errors that no kill explains: {cuts['count']} {cuts['first'][:3]}")
    if result["log_errors"]:
        print("replicas' ERROR log lines (not a check):")
        for message, n in list(result["log_errors"].items())[:8]:
            print(f"  {n:>5}  {message}")
    print(
        "\nchecks: "
        + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in result["checks"].items())
    )
    for line in result["failures"][:20]:
        print(f"  failure: {line}")


@contextmanager
def backends(database_url: str | None, s3_endpoint: str | None) -> Iterator[dict[str, str]]:
    """The replicas' settings: the database ``database_url`` (an empty one), else a fresh
    one on the tests' PostgreSQL server; a fresh bucket on the moto server at
    ``s3_endpoint``, else on one of its own."""
    with ExitStack() as stack:
        stack.enter_context(fake_aws_credentials())
        url = s3_endpoint
        if url is None:
            url, stop, _ = start_moto_process()
            stack.callback(stop)
        db = database_url or stack.enter_context(pg_database())
        yield {
            "CKPTSTORE_DATABASE_URL": db,
            "CKPTSTORE_BLOB_URL": f"s3://soak-{uuid.uuid4().hex[:12]}/ckpt",
            "CKPTSTORE_S3_ENDPOINT_URL": url,
            "CKPTSTORE_S3_PATH_STYLE": "true",
            "CKPTSTORE_S3_CREATE_BUCKET": "true",
            "CKPTSTORE_S3_REGION": "us-east-1",
            "CKPTSTORE_CACHE_BYTES": str(64 << 20),
            **SETTINGS,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--slow-clients", type=int, default=2)
    parser.add_argument("--kill-every", type=float, default=60, help="seconds; 0: no kills")
    parser.add_argument("--keep-last", type=int, default=3)
    parser.add_argument("--keep-every", type=int, default=5)
    parser.add_argument("--save-pause", type=float, default=0.0, help="seconds between saves")
    parser.add_argument("--max-rss-slope", type=float, default=None, help="MB/min; fail above")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", type=Path, default=None, help="default: a temp folder")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--database-url", default=None, help="an empty database to use")
    parser.add_argument("--s3-endpoint", default=None, help="a moto server to use")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import tempfile

    with ExitStack() as stack:
        root = args.data_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        env = stack.enter_context(backends(args.database_url, args.s3_endpoint))
        soak = Soak(args, env, root)
        try:
            soak.run()
            for i, svc in enumerate(soak.replicas):  # a restart the end cut short
                if svc.proc is None or svc.proc.poll() is not None:
                    soak.start(i)
            began = time.monotonic()
            try:
                final = check_runs(soak)
            except Exception as exc:  # reported with the rest, not a traceback without figures
                final = {"kept": 0, "extra_before_pass": 0, "wrong": 0}
                final["problems"] = [f"final checks: {exc!r}\n{traceback.format_exc()}"]
            soak.phases["check_runs_s"] = round(time.monotonic() - began, 1)
        finally:
            began = time.monotonic()
            for svc in soak.replicas:
                svc.stop()
            for client in soak.clients:
                client.close()
            soak.phases["stop_s"] = round(time.monotonic() - began, 1)
        began = time.monotonic()
        store = check_store(env, float(SETTINGS["CKPTSTORE_LOCK_LEASE_S"]))
        soak.phases["check_store_s"] = round(time.monotonic() - began, 1)
        logged = log_errors(root)
    limits = bounds(SETTINGS)
    rec = soak.rec
    result: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k in CONFIG},
        "settings": SETTINGS,
        "duration_s": round(soak.duration, 1),
        "phases": soak.phases,
        "counts": dict(rec.counts),
        "kills": rec.kills,
        "latency": latency_table(rec, limits),
        "rss": {name: rss_slope(s) for name, s in sorted(rec.rss.items())},
        "maintenance_backlog": {
            name: {"max": max(xs), "mean": round(statistics.fmean(xs), 2), "last": xs[-1]}
            for name, xs in sorted(rec.backlog.items())
            if xs
        },
        "final": {k: v for k, v in final.items() if k != "problems"},
        "store": store,
        "log_errors": logged,
    }
    errors = {f"{kind}: {e}": n for kind, es in rec.errors.items() for e, n in es.items()}
    result["errors"] = errors
    result["disallowed_errors"] = {
        k: n for k, n in errors.items() if k.split(": ", 1)[1] not in ALLOWED
    }
    cuts = unexplained_cuts(rec, soak.t0)
    result["unexplained_connection_errors"] = {"count": len(cuts), "first": cuts[:10]}
    data_errors = {m: n for m, n in logged.items() if m.startswith(DATA_ERRORS)}
    result["failures"] = rec.failures + final["problems"]
    slopes = [r["slope_mb_per_min"] for r in result["rss"].values()]
    result["checks"] = {
        "exact": rec.counts.get("wrong_bytes", 0) == 0 and final["wrong"] == 0,
        "no_disallowed_errors": not result["disallowed_errors"],
        "no_failures": not result["failures"],
        "retention": not final["problems"] and final["kept"] > 0,
        "no_orphans": store["orphan_count"] == 0
        and store["missing_count"] == 0
        and store["open_uploads"] == 0
        and store["writing_rows_left"] == 0,
        "latency": all(x["within"] for x in result["latency"].values()),
        "connection_errors_explained": not cuts,
        "no_data_errors_logged": not data_errors,
        "rss": args.max_rss_slope is None
        or all(s is not None and s <= args.max_rss_slope for s in slopes),
    }
    result["passed"] = all(result["checks"].values())
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
