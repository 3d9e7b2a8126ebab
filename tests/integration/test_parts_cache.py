"""A checkpoint written in parts reaches the base cache (cache_policy.py): the replica that
committed it decodes it there in the background, so a resharded load of ``latest`` (DCP's
``select`` of stored pieces) is read from one local file instead of decoding every chunk's
chain, and the next checkpoint's parts read their bases there; a replica that missed it
(a restart) caches it after its first load. Real service, raw HTTP; what is observable:
the cache folder's files, the cache counters of ``GET /metrics``, and that the bytes stay
bit-exact when the blobs are gone."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from support.parts import commit, dcp_layout, save_in_parts, shards, tensors_of
from support.serviceproc import Service, cache_files, forget_cache
from support.waiting import wait_until

RUN = "dist"
PARTS = ["rank-0", "rank-1"]


def cached(data_dir: Path) -> set[str]:
    return {p.name for p in cache_files(data_dir)}


def cache_counts(http: httpx.Client) -> dict[tuple[str, str], float]:
    """The base cache's lookups so far, by outcome (``hits``/``misses``) and path
    (``load``/``save``), from ``GET /metrics``."""
    response = http.get("/metrics")
    assert response.status_code == 200
    return {
        (s.name.split("_")[-2], s.labels["path"]): s.value
        for family in text_string_to_metric_families(response.text)
        if family.name in ("ckptstore_base_cache_hits", "ckptstore_base_cache_misses")
        for s in family.samples
        if s.name.endswith("_total")
    }


def moved(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> dict[tuple[str, str], float]:
    return {key: after[key] - before.get(key, 0.0) for key in after}


def expected(step: int) -> dict[str, bytes]:
    return {name: a.tobytes() for part in shards(step) for name, a in part.items()}


def select(http: httpx.Client, step: int | str, names: list[str]) -> dict[str, bytes]:
    response = http.post(f"/v1/runs/{RUN}/checkpoints/{step}/select", json={"names": names})
    assert response.status_code == 200, response.text
    return tensors_of(response.content)


def save(svc: Service, step: int) -> None:
    save_in_parts(svc.url, RUN, step)
    done = commit(svc.url, RUN, step, PARTS, {"dcp": dcp_layout()})
    assert done.status_code == 201, done.text


def test_a_checkpoint_in_parts_is_cached_once_committed_and_superseded_by_the_next(
    make_service: Callable[..., Service], tmp_path: Path
) -> None:
    data_dir = tmp_path / "svc"
    svc = make_service(data_dir=data_dir)
    names = list(expected(1))
    with httpx.Client(base_url=svc.url, timeout=60) as http:
        save(svc, 1)
        (first,) = wait_until(lambda: cached(data_dir), what="step 1 in the cache")
        before = cache_counts(http)
        assert select(http, "latest", names[1:3]) == {n: expected(1)[n] for n in names[1:3]}
        save(svc, 2)  # its parts read their bases from step 1's cache file
        after_save = cache_counts(http)
        second = wait_until(
            lambda: cached(data_dir) - {first}, what="step 2 in the cache, in step 1's place"
        )
        assert cached(data_dir) == second  # only the run's latest stays installed
        assert select(http, 1, names) == expected(1)  # no longer cached: from storage
        mid = cache_counts(http)
        assert select(http, "latest", names) == expected(2)
        after = cache_counts(http)
        saved_mid = moved(before, after_save)
        assert saved_mid[("hits", "load")] == 1
        assert saved_mid[("hits", "save")] == len(PARTS)
        assert saved_mid[("misses", "save")] == 0
        assert moved(after_save, mid)[("misses", "load")] == 1
        assert moved(mid, after)[("hits", "load")] == 1
        # served from the cache alone: without a blob, latest still loads bit for bit
        shutil.rmtree(data_dir / "blobs")
        assert select(http, "latest", names) == expected(2)
        full = http.get(f"/v1/runs/{RUN}/checkpoints/latest")  # assembled, from the cache
        assert full.status_code == 200
        assert tensors_of(full.content)["b"] == b"".join(
            expected(2)[n] for n in names if n.startswith("b@")
        )


def test_a_replica_that_missed_the_commit_caches_latest_after_its_first_select(
    make_service: Callable[..., Service], tmp_path: Path
) -> None:
    data_dir = tmp_path / "svc"
    svc = make_service(data_dir=data_dir)
    save(svc, 1)
    wait_until(lambda: cached(data_dir), what="step 1 in the cache")
    svc.stop()
    forget_cache(data_dir)  # another replica: the commit's fill is not in its cache
    again = make_service(data_dir=data_dir)
    names = list(expected(1))
    with httpx.Client(base_url=again.url, timeout=60) as http:
        before = cache_counts(http)
        assert select(http, "latest", names[:1]) == {names[0]: expected(1)[names[0]]}
        wait_until(lambda: cached(data_dir), what="latest cached after a select missed")
        assert select(http, "latest", names) == expected(1)
        delta = moved(before, cache_counts(http))
    assert delta[("misses", "load")] == 1
    assert delta[("hits", "load")] == 1
