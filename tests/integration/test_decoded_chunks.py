"""Loads of many steps decode no link twice where their order allows it (issue 29): the
chunks a load decodes are kept decoded (``CKPTSTORE_DECODED_CACHE_BYTES``), and the next
loads start their chains from the newest chunk kept. Counted by the service's
``ckptstore_chain_links_decoded`` metric, not timed."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ckptstore import CheckpointClient, CheckpointInfo
from ckptstore_core import codec
from ckptstore_service.chains import DecodeStats
from ckptstore_service.runtime import Runtime
from ckptstore_service.settings import Settings
from support.serviceproc import Service, forget_cache, wait_idle
from support.states import assert_same_state, training_states
from support.waiting import poll, wait_until

STEPS = 6
ENV = {
    "CKPTSTORE_KEYFRAME_INTERVAL": "16",  # one chain
    "CKPTSTORE_MAX_CHAIN_DEPTH": "16",
    "CKPTSTORE_CHUNK_BYTES": str(64 << 10),  # several chunks per tensor
}


@pytest.fixture(scope="module")
def states() -> list[dict[str, Any]]:
    return training_states(STEPS)


def counted(svc: Service, name: str) -> float:
    text = httpx.get(f"{svc.url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"no {name} sample")


def links_decoded(svc: Service) -> float:
    return counted(svc, "ckptstore_chain_links_decoded_total")


def stored_links(data_dir: Path) -> int:
    """The chunk rows that hold stored bytes to decode: not refs, not bf16 copies that are
    exactly their fp32 master's cast."""
    con = sqlite3.connect(data_dir / "catalog.sqlite3")
    try:
        codecs = [row[0] for row in con.execute("SELECT codec FROM chunks")]
    finally:
        con.close()
    return sum(
        1
        for name in codecs
        if name != codec.REF and (codec.split_cast(name) or ("", ""))[1] != codec.REF
    )


def saved(
    make_service: Callable[..., Service], data_dir: Path, states: list[dict[str, Any]]
) -> list[CheckpointInfo]:
    """``states`` saved as steps 0, 1, ... of run ``run`` (re-rooted once the service is
    idle), the service stopped; the run's listing."""
    svc = make_service(ENV, data_dir)
    with CheckpointClient(svc.url) as client:
        for step, state in enumerate(states):
            client.save("run", step, state)
        wait_idle(svc.url)  # the re-root the last saves set off
        listing = client.list("run")
    svc.stop()
    forget_cache(data_dir)  # the latest too decodes from storage
    return listing


def sweep(
    make_service: Callable[..., Service],
    data_dir: Path,
    states: list[dict[str, Any]],
    env: dict[str, str],
    order: list[int] | None = None,
) -> tuple[float, float]:
    """Links decoded by a sweep over every step (in ``order``, default by step) on a fresh
    replica, then by a second."""
    svc = make_service({**ENV, **env}, data_dir)  # a restart: nothing cached
    decoded = []
    with CheckpointClient(svc.url) as client:
        for _ in range(2):
            before = links_decoded(svc)
            for step in order or range(len(states)):
                assert_same_state(states[step], client.load("run", step))
            decoded.append(links_decoded(svc) - before)
    svc.stop()
    return decoded[0], decoded[1]


def test_a_sweep_outward_from_the_keyframe_decodes_each_link_once(
    make_service: Callable[..., Service], states: list[dict[str, Any]], tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    listing = saved(make_service, data_dir, states)
    assert max(c.chain_depth for c in listing) >= 2
    links = stored_links(data_dir)

    # nearest the keyframe first: each chunk's base is kept by the time it is asked for
    outward = [c.step for c in sorted(listing, key=lambda c: (c.chain_depth, c.step))]
    cold, warm = sweep(make_service, data_dir, states, {}, outward)
    assert cold == links  # every stored link once
    assert warm == 0  # all kept: the chunks come from memory

    # without the decoded chunks kept, each load decodes its whole chains
    cold_off, warm_off = sweep(
        make_service, data_dir, states, {"CKPTSTORE_DECODED_CACHE_BYTES": "0"}
    )
    assert cold_off > links
    assert warm_off > links


def test_a_budget_smaller_than_a_checkpoint_still_loads_bit_exactly(
    make_service: Callable[..., Service], states: list[dict[str, Any]], tmp_path: Path
) -> None:
    data_dir = tmp_path / "data"
    saved(make_service, data_dir, states)
    # two chunks' worth: entries come and go while chains are decoded
    cold, warm = sweep(
        make_service, data_dir, states, {"CKPTSTORE_DECODED_CACHE_BYTES": str(128 << 10)}
    )
    assert cold > 0 and warm > 0


def test_latest_loaded_again_comes_from_memory_not_from_its_cache_file(
    make_service: Callable[..., Service], states: list[dict[str, Any]], tmp_path: Path
) -> None:
    """The latest that a load decoded is kept like any step: loaded again, it comes from
    memory (no read of the base-cache file the first load filled, no second hash), so a
    byte flipped in that file is never read."""
    data_dir = tmp_path / "data"
    saved(make_service, data_dir, states)
    svc = make_service(ENV, data_dir)
    with CheckpointClient(svc.url) as client:
        assert_same_state(states[-1], client.load("run"))  # decoded, kept, the file filled
        (cached,) = wait_until(
            lambda: list((data_dir / "cache").rglob("*.bin")), what="the cache file"
        )
        data = bytearray(cached.read_bytes())
        data[len(data) // 2] ^= 0x40
        cached.write_bytes(bytes(data))
        before = links_decoded(svc)
        assert_same_state(states[-1], client.load("run"))
        assert links_decoded(svc) == before


def test_the_latest_an_earlier_process_left_a_file_for_is_not_read_ahead(
    make_service: Callable[..., Service], states: list[dict[str, Any]], tmp_path: Path
) -> None:
    """After a restart, the step before the latest is loaded first (read-ahead reads the
    step after a run's first load): the latest is not decoded in the background, since the
    file the last process left serves it (checked when first asked for)."""
    data_dir = tmp_path / "data"
    saved(make_service, data_dir, states)
    svc = make_service(ENV, data_dir)
    with CheckpointClient(svc.url) as client:
        assert_same_state(states[-1], client.load("run"))  # decoded, the file filled
        wait_until(lambda: list((data_dir / "cache").rglob("*.bin")), what="the cache file")
    svc.stop()
    svc = make_service(ENV, data_dir)  # a restart: the file is left, not yet checked
    with CheckpointClient(svc.url) as client:
        assert_same_state(states[-2], client.load("run", STEPS - 2))
        before = links_decoded(svc)
        # the read-ahead of a step this small ends within a second: none begins in two
        assert not poll(lambda: counted(svc, "ckptstore_read_ahead_bytes_total"), 2.0)
        assert_same_state(states[-1], client.load("run"))
        assert links_decoded(svc) == before  # served from the file


@pytest.mark.parametrize("read_ahead", [True, False])
def test_loads_that_walk_a_run_in_order_find_the_next_step_read_ahead(
    make_service: Callable[..., Service],
    states: list[dict[str, Any]],
    tmp_path: Path,
    read_ahead: bool,
) -> None:
    data_dir = tmp_path / "data"
    raw = {c.step: c.raw_bytes for c in saved(make_service, data_dir, states)}
    svc = make_service({**ENV, "CKPTSTORE_READ_AHEAD": str(read_ahead).lower()}, data_dir)

    def read() -> float:
        return counted(svc, "ckptstore_read_ahead_bytes_total")

    last = STEPS - 1
    with CheckpointClient(svc.url) as client:
        assert_same_state(states[0], client.load("run", 0))  # the run's first load here
        if read_ahead:  # the step after it
            wait_until(lambda: read() > 0, 30, "step 1 read ahead")
            assert read() == raw[1]
        for step in (4, 3):  # a jump forward, then one back: no walk
            assert_same_state(states[step], client.load("run", step))
        assert read() == (raw[1] if read_ahead else 0)
        assert_same_state(states[4], client.load("run", 4))  # 3 then 4: a walk
        if read_ahead:  # the last step decoded in the background, and only it
            wait_until(lambda: read() > raw[1], 30, "the last step read ahead")
            assert read() == raw[1] + raw[last]
        before = links_decoded(svc)
        assert_same_state(states[last], client.load("run", last))  # the walk's end
        if read_ahead:
            assert links_decoded(svc) == before  # served from memory
        else:
            assert links_decoded(svc) > before
            assert read() == 0


def counted_trees(rt: Runtime) -> list[int]:
    """The checkpoint ids whose chunk tree ``rt``'s catalog reads from now on, in order."""
    trees: list[int] = []
    tree = rt.catalog.chunk_tree

    def counted_tree(checkpoint_id: int) -> Any:
        trees.append(checkpoint_id)
        return tree(checkpoint_id)

    rt.catalog.chunk_tree = counted_tree  # type: ignore[method-assign]
    return trees


def test_a_load_reads_its_checkpoints_chunk_tree_once(
    make_service: Callable[..., Service], tmp_path: Path, states: list[dict[str, Any]]
) -> None:
    """A load that finds some but not all of its chunks kept decoded goes on to decode the
    rest from storage with the decoder it built to look (one query of the catalog's chunk
    tree, one tiling check), not a second one."""
    data = tmp_path / "data"
    saved(make_service, data, states[:3])
    rt = Runtime.open(Settings(data_dir=data, chunk_bytes=64 << 10, read_ahead=False))
    try:
        trees = counted_trees(rt)
        for step in (0, 2):
            trees.clear()
            served = rt.loader.open("run", step, None)
            body = b"".join(bytes(piece) for piece in served.body)
            assert len(body) == served.total_len and trees == [served.info.id]
        # step 0 kept decoded holds as many bytes as step 2, which shares none of its
        # chunks' tops: the second load looked at what is kept before decoding
        stored = rt.catalog.tensors(served.info.id)
        assert rt.source.decoded.nbytes >= sum(t.nbytes for t in stored)
    finally:
        rt.close()


def test_a_step_loaded_again_from_memory_reads_no_chunk_tree(
    make_service: Callable[..., Service], tmp_path: Path, states: list[dict[str, Any]]
) -> None:
    """The second load of a step whose chunks are all still kept decoded is served from
    them without the catalog's chunk tree (``LoadedChunks``), the same bytes; once they are
    no longer kept, the load reads the tree and decodes again."""
    data = tmp_path / "data"
    saved(make_service, data, states[:3])
    rt = Runtime.open(Settings(data_dir=data, chunk_bytes=64 << 10, read_ahead=False))
    try:
        trees = counted_trees(rt)

        def load() -> tuple[bytes, list[int]]:
            trees.clear()
            served = rt.loader.open("run", 1, None)
            return b"".join(bytes(piece) for piece in served.body), list(trees)

        first, read = load()
        assert len(read) == 1  # decoded from storage
        again, read = load()
        assert again == first and read == []
        rt.source.decoded.clear()
        third, read = load()
        assert third == first and len(read) == 1
        load()  # remembered again
        info = rt.catalog.get("run", 1)
        tensors = rt.catalog.tensors(info.id)
        data = b"".join(bytes(p) for p in rt.source.load(info, tensors, DecodeStats()).stream())
        trees.clear()
        kept = rt.source.load(info, tensors, DecodeStats()).kept()
        assert kept is not None and trees == []  # to be served from the kept chunks
        rt.source.decoded.clear()  # evicted before they are sent
        assert b"".join(bytes(piece) for piece in kept) == data
        assert trees == [info.id]  # decoded from storage instead
    finally:
        rt.close()


def test_a_walk_done_again_reads_nothing_ahead(
    make_service: Callable[..., Service], tmp_path: Path, states: list[dict[str, Any]]
) -> None:
    """A sweep over steps that are all kept decoded (the second of an evaluation's sweeps)
    finds each next step in memory already: nothing is read ahead, nothing streamed."""
    data_dir = tmp_path / "data"
    raw = {c.step: c.raw_bytes for c in saved(make_service, data_dir, states[:4])}
    svc = make_service(ENV, data_dir)

    def read() -> float:
        return counted(svc, "ckptstore_read_ahead_bytes_total")

    with CheckpointClient(svc.url) as client:
        for step in range(3):  # the first load and a walk: 1, 2 and 3 read ahead
            assert_same_state(states[step], client.load("run", step))
        first = raw[1] + raw[2] + raw[3]
        wait_until(lambda: read() == first, 30, "steps 1 to 3 read ahead")
        before = links_decoded(svc)
        for step in range(4):  # the same walk again, every step kept
            assert_same_state(states[step], client.load("run", step))
        assert links_decoded(svc) == before
        assert not poll(lambda: read() > first, 2.0)
