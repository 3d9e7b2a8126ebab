"""Every Prometheus metric of the service, in one place (docs/metrics.md describes them).

A :class:`Metrics` owns its own ``CollectorRegistry``: each app (tests build several in one
process) counts on its own, and nothing is registered at import time. The components call
one method per event (a checkpoint stored, a base-cache lookup, a maintenance task's run);
the requests themselves (outcome, duration, in flight) are counted around the routes by
:class:`ckptstore_service.api.instrument.MetricsMiddleware`, so the routes stay as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, get_args

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from ckptstore_service.catalog import CheckpointRecord, PartRecord

if TYPE_CHECKING:  # the maintenance package counts into Metrics: no import cycle
    from ckptstore_service.maintenance.reroot import Rerooted

__all__ = ["KINDS", "Metrics", "Op", "Outcome", "Task"]

Op = Literal["save", "load"]
Outcome = Literal["ok", "client_error", "server_error"]
Task = Literal["retention", "archive", "reroot", "garbage", "parts"]
CachePath = Literal["save", "load"]
# the kinds of request of each operation (api/instrument.py's OPERATIONS)
KINDS: dict[Op, tuple[str, ...]] = {
    "save": ("single", "part", "commit"),
    "load": ("checkpoint", "select"),
}

# 10 ms (a small save, a cached load) .. 10 min (a large cold save over a slow link)
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# deltas a load may decode in a row: max_chain_depth is 10 by default
DEPTH_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)


class Metrics:
    """The service's metrics and the events that move them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)  # process_*: CPU seconds, resident memory, open fds
        self._requests = {
            "save": Counter(
                "ckptstore_saves",
                "Save requests by kind (single: one writer's checkpoint; part: one part of a "
                "checkpoint written in parts; commit: its commit) and outcome",
                ["kind", "outcome"],
                registry=r,
            ),
            "load": Counter(
                "ckptstore_loads",
                "Load requests by kind (checkpoint: GET of a checkpoint; select: some of its "
                "tensors) and outcome",
                ["kind", "outcome"],
                registry=r,
            ),
        }
        self._durations = {
            op: Histogram(
                f"ckptstore_{op}_duration_seconds",
                f"Time of the {op} requests that succeeded, until the response's last byte",
                ["kind"],
                buckets=DURATION_BUCKETS,
                registry=r,
            )
            for op in ("save", "load")
        }
        self._in_flight = {
            "save": Gauge(
                "ckptstore_uploads_in_flight",
                "Uploads (single saves and parts) being received or stored, or waiting "
                "for their turn",
                registry=r,
            ),
            "load": Gauge("ckptstore_loads_in_flight", "Loads being served", registry=r),
        }
        self._loaded_bytes = Counter(
            "ckptstore_loaded_bytes", "Response bytes of the loads that succeeded", registry=r
        )
        self._raw_bytes = Counter(
            "ckptstore_saved_raw_bytes",
            "Tensor bytes received by new checkpoints and parts (not by retries)",
            ["kind"],
            registry=r,
        )
        self._stored_bytes = Counter(
            "ckptstore_saved_stored_bytes",
            "Bytes written to blob storage for them",
            ["kind"],
            registry=r,
        )
        self._parts = Counter(
            "ckptstore_parts_uploaded", "Parts stored (not counting retries)", registry=r
        )
        self._verified = Counter(
            "ckptstore_verifications",
            "Checkpoints with client-encoded chunks decoded by the verifier, by result "
            "(verified, corrupt)",
            ["result"],
            registry=r,
        )
        self._depth = Histogram(
            "ckptstore_saved_chain_depth",
            "Chain depth (the longest delta chain a load decodes) of each checkpoint made visible",
            buckets=DEPTH_BUCKETS,
            registry=r,
        )
        self._cache_hits = Counter(
            "ckptstore_base_cache_hits",
            "Base-cache lookups that found the checkpoint on local disk, by path",
            ["path"],
            registry=r,
        )
        self._cache_misses = Counter(
            "ckptstore_base_cache_misses",
            "Base-cache lookups that had to decode from storage, by path",
            ["path"],
            registry=r,
        )
        self._links_decoded = Counter(
            "ckptstore_chain_links_decoded",
            "Stored chunk links decoded from storage by loads and base-cache fills (a link "
            "kept decoded from an earlier load is not decoded again)",
            registry=r,
        )
        self._read_ahead = Counter(
            "ckptstore_read_ahead_bytes",
            "Raw bytes of checkpoints decoded ahead of their loads, when loads walk a run's "
            "steps in order",
            registry=r,
        )
        self._maintenance = Counter(
            "ckptstore_maintenance_runs",
            "Background maintenance runs by task (reroot, garbage, parts) and outcome",
            ["task", "outcome"],
            registry=r,
        )
        self._reroots = Counter(
            "ckptstore_reroots", "Re-roots that rewrote a run's chains", registry=r
        )
        self._reroot_chunks = Counter(
            "ckptstore_reroot_chunks_rewritten", "Chunks that re-roots re-encoded", registry=r
        )
        self._reroot_checkpoints = Counter(
            "ckptstore_reroot_checkpoints_rewritten",
            "Checkpoints whose blob a re-root replaced",
            registry=r,
        )
        self._reroot_bytes = Counter(
            "ckptstore_reroot_blob_bytes",
            "Bytes of the blobs re-roots replaced and wrote in their place (blobs label); "
            "replaced minus written is what their collection frees",
            ["blobs"],
            registry=r,
        )
        self._collected = Counter(
            "ckptstore_blobs_collected",
            "Blobs deleted by the background collection: garbage (replaced by re-roots) "
            "and parts (of checkpoints never committed, or not named by their commit)",
            ["task"],
            registry=r,
        )
        self._freed = Counter(
            "ckptstore_collected_part_bytes",
            "Stored bytes freed by deleting parts nobody committed (as recorded: none for "
            "a part whose upload never finished)",
            registry=r,
        )
        self._start_at_zero()

    def _start_at_zero(self) -> None:
        """Create every series of known labels, at 0: a rate over a series that appears
        only at its first event misses that event, and dashboards show no data until then."""
        outcomes = get_args(Outcome)
        for op, kinds in KINDS.items():
            for kind in kinds:
                self._durations[op].labels(kind)
                for outcome in outcomes:
                    self._requests[op].labels(kind, outcome)
        for kind in ("single", "part"):
            self._raw_bytes.labels(kind)
            self._stored_bytes.labels(kind)
        for path in get_args(CachePath):
            self._cache_hits.labels(path)
            self._cache_misses.labels(path)
        for task in get_args(Task):
            for outcome in ("ok", "error"):
                self._maintenance.labels(task, outcome)
        for blobs in ("replaced", "written"):
            self._reroot_bytes.labels(blobs)
        for task in ("garbage", "parts"):
            self._collected.labels(task)

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)

    # -- requests (api/instrument.py) ----------------------------------------------------------

    def request_started(self, op: Op) -> None:
        self._in_flight[op].inc()

    def request_ended(self, op: Op, kind: str, outcome: Outcome, seconds: float, sent: int) -> None:
        """A request ended; ``sent``: its response's body bytes."""
        self._in_flight[op].dec()
        self._requests[op].labels(kind, outcome).inc()
        if outcome == "ok":
            self._durations[op].labels(kind).observe(seconds)
            if op == "load":
                self._loaded_bytes.inc(sent)

    # -- the save path -------------------------------------------------------------------------

    def saved(self, record: CheckpointRecord) -> None:
        """A single writer's checkpoint was stored and made visible."""
        self._raw_bytes.labels("single").inc(record.raw_bytes)
        self._stored_bytes.labels("single").inc(record.stored_bytes)
        self._depth.observe(record.chain_depth)

    def part_saved(self, part: PartRecord) -> None:
        """A part was stored (invisible until its commit)."""
        self._parts.inc()
        self._raw_bytes.labels("part").inc(part.raw_bytes)
        self._stored_bytes.labels("part").inc(part.stored_bytes)

    def committed(self, record: CheckpointRecord) -> None:
        """A checkpoint written in parts was made visible (its bytes counted with its parts)."""
        self._depth.observe(record.chain_depth)

    def verified(self, result: str) -> None:
        """The verifier decoded a checkpoint's client-encoded chunks: ``verified`` or
        ``corrupt``."""
        self._verified.labels(result).inc()

    def parts_collected(self, parts: Sequence[PartRecord]) -> None:
        """Parts nobody will commit were deleted (by a commit that did not name them, a retry
        that found its part crashed, or the sweep)."""
        self._collected.labels("parts").inc(len(parts))
        self._freed.inc(sum(p.stored_bytes for p in parts))

    # -- the base cache ------------------------------------------------------------------------

    def base_cache(self, path: CachePath, hit: bool) -> None:
        (self._cache_hits if hit else self._cache_misses).labels(path).inc()

    def links_decoded(self, links: int) -> None:
        self._links_decoded.inc(links)

    def read_ahead(self, raw_bytes: int) -> None:
        self._read_ahead.inc(raw_bytes)

    # -- maintenance ---------------------------------------------------------------------------

    def maintenance_run(self, task: Task, ok: bool) -> None:
        self._maintenance.labels(task, "ok" if ok else "error").inc()

    def rerooted(self, done: Rerooted) -> None:
        self._reroots.inc()
        self._reroot_chunks.inc(done.chunks)
        self._reroot_checkpoints.inc(done.checkpoints)
        self._reroot_bytes.labels("replaced").inc(done.bytes_replaced)
        self._reroot_bytes.labels("written").inc(done.bytes_written)

    def garbage_collected(self, blobs: int) -> None:
        self._collected.labels("garbage").inc(blobs)
