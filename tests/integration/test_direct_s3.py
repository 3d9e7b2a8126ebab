"""Direct saves straight to S3 (presigned multipart uploads) on PostgreSQL + moto over real
HTTP: the writer PUTs its encoded part to the bucket and registers its rows, the service
completes the upload without reading it; loads come back through presigned ranged GETs. And
the failures: a rank killed mid-upload, S3 down mid-upload, a registration that does not
match what was uploaded, another run's key, a URL used past its expiry or for another
key: nothing visible, ``latest`` unchanged, the sweep aborts what was left open, the next
save works. moto checks no presigned URL, so the tests that need S3's checks reach it
through a proxy that makes them (``support.presign``)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import numpy as np
import pytest
import torch

from ckptstore import CheckpointClient, Forbidden, UrlExpired
from ckptstore.direct import PUT_ATTEMPTS, DirectWriter, pieces_of, put_part
from ckptstore.transport import Transport
from ckptstore_core.errors import StorageUnavailable
from ckptstore_core.wire import TensorPiece
from ckptstore_service.names import BlobKey, parse_blob_key
from ckptstore_service.storage.base import presigned_since
from support.bodies import assert_error
from support.faultproxy import SLOWDOWN_BODY, FaultProxy
from support.presign import PresignChecker, s3_error
from support.s3server import frozen, s3_store
from support.serviceproc import Service
from support.states import assert_same_state, training_states
from support.waiting import wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.s3]


def read_bytes(pid: int) -> int:
    """Bytes the process read through sockets and files (``rchar`` of /proc/PID/io)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar")


def steps(url: str, run: str) -> list[int]:
    response = httpx.get(f"{url}/v1/runs/{run}/checkpoints")
    return [c["step"] for c in response.json()["checkpoints"]] if response.is_success else []


@pytest.fixture
def s3_front(
    backends: dict[str, str],
) -> Iterator[tuple[dict[str, str], FaultProxy, PresignChecker]]:
    """``backends`` with the bucket reached through a proxy that checks presigned URLs as
    S3 does (expiry, signature: ``support.presign``), the proxy (to count requests and
    inject S3's answers) and the checker: the service's endpoint is the proxy, so the URLs
    it presigns name the proxy."""
    moto = urlsplit(backends["CKPTSTORE_S3_ENDPOINT_URL"])
    assert moto.hostname and moto.port
    checker = PresignChecker(secret_key=os.environ["AWS_SECRET_ACCESS_KEY"])
    with FaultProxy(moto.hostname, moto.port, http=True, check=checker) as proxy:
        yield {**backends, "CKPTSTORE_S3_ENDPOINT_URL": proxy.url}, proxy, checker


@pytest.fixture
def checked(
    s3_front: tuple[dict[str, str], FaultProxy, PresignChecker],
) -> tuple[dict[str, str], PresignChecker]:
    """``s3_front`` without its proxy."""
    return s3_front[0], s3_front[2]


def upload_key(key: str, run: str, step: int) -> BlobKey:
    """A presigned upload's key, checked to be one of ``run/step`` spread over prefixes:
    ``runs/<run>/<spread>-<step>-<uuid>.<unix time>.presigned.blob``."""
    parsed = parse_blob_key(key)
    assert parsed is not None and parsed.since is not None, key
    assert (parsed.run, parsed.step) == (run, step), key
    assert key.startswith(f"runs/{run}/{parsed.spread}-{step}-{parsed.uid}."), key
    assert parsed.spread == parsed.uid[:2]
    assert presigned_since(key) == parsed.since  # what the sweep reads
    assert abs(parsed.since - time.time()) < 600
    return parsed


def test_a_direct_save_goes_to_the_bucket_and_loads_back_exactly(
    make_service: Callable[..., Service], checked: tuple[dict[str, str], PresignChecker]
) -> None:
    """...through a peer that checks every presigned URL as S3 does: each one the service
    handed out (part PUTs, ranged GETs) passes."""
    backends, checker = checked
    env = {**backends, "CKPTSTORE_VERIFY_INTERVAL_S": "0.2", "CKPTSTORE_VERIFY_CPU_SHARE": "1"}
    service = make_service(env)
    big = torch.randn(4 << 20, generator=torch.Generator().manual_seed(0))  # 16 MiB
    states = [{**s, "big": big + i} for i, s in enumerate(training_states(3))]
    raw = sum(t.numel() * t.element_size() for s in states for t in _tensors(s))
    with (
        CheckpointClient(service.url, direct=True) as direct,
        CheckpointClient(service.url) as plain,
    ):
        before = read_bytes(service.pid)
        for step, state in enumerate(states, start=1):
            direct.save("s3", step, state)
        through = read_bytes(service.pid) - before
        for step, state in enumerate(states, start=1):
            assert_same_state(state, direct.load("s3", step), path=f"direct, step {step}")
            assert_same_state(state, plain.load("s3", step), path=f"plain, step {step}")
    # plans, rows and commits only: the encoded bytes went to the bucket (the issue's
    # bound, 2% of the checkpoint; about 25 KB a save here, for ~19 MB)
    assert through < 0.02 * raw, (through, raw)
    judged = wait_until(
        lambda: (
            (got := {c.step: c.verification for c in CheckpointClient(service.url).list("s3")})
            and "pending" not in got.values()
            and got
        ),
        what="the verifier's verdicts",
    )
    assert judged == {1: "verified", 2: "verified", 3: "verified"}
    assert s3_store(backends).list_open_uploads() == []
    # a PUT per part of each save, a ranged GET per window of each load: all checked, all
    # taken
    assert checker.checked >= 6 and checker.expired == checker.mismatched == 0
    keys = list(s3_store(backends).iter_keys("runs/s3/"))  # one listing finds a run's keys
    by_step = {parse_blob_key(k).step: k for k in keys}  # type: ignore[union-attr]
    assert sorted(by_step) == [1, 2, 3], keys
    for step, key in by_step.items():
        upload_key(key, "s3", step)


def _tensors(state: object) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, list | tuple):
        return [t for v in state for t in _tensors(v)]
    return []


def sweeping_soon(
    make_service: Callable[..., Service], service: Service, env: dict[str, str]
) -> Service:
    """``service`` restarted on its data with a parts TTL of 1 s, swept every 0.2 s: the
    uploads it left open are aborted within seconds rather than the TTL a save needs (a
    TTL this short would abort a save's own uploads under way on a loaded machine)."""
    service.stop()
    return make_service(
        {**env, "CKPTSTORE_PARTS_TTL_S": "1", "CKPTSTORE_SWEEP_INTERVAL_S": "0.2"},
        service.data_dir,
    )


def test_a_rank_killed_mid_upload_leaves_nothing_and_the_sweep_aborts_its_upload(
    make_service: Callable[..., Service], backends: dict[str, str]
) -> None:
    # uploads nobody registered are aborted once their checkpoint would be abandoned
    service = make_service(backends)
    w = torch.arange(100_000, dtype=torch.float32)
    with CheckpointClient(service.url, direct=True) as client:
        client.save("killed", 1, {"w": w})
    # a rank that opened its upload, PUT one part and died before registering
    base = f"{service.url}/v1/runs/killed/checkpoints/2/parts/rank-0"
    up = httpx.post(base + "/upload", json={"max_bytes": 20 << 20}).json()
    assert len(up["urls"]) == -(-(20 << 20) // up["part_size"])
    upload_key(up["key"], "killed", 2)  # spread, and its time where the sweep reads it
    put_part(up["urls"][0], bytes(up["part_size"]), 30)  # the upload is open: it took it
    assert steps(service.url, "killed") == [1]
    sweeper = sweeping_soon(make_service, service, backends)
    wait_until(lambda: s3_store(backends).list_open_uploads() == [], 60, "the upload aborted")
    # aborted, not completed: what was PUT never became a blob, its URLs are dead
    assert not s3_store(backends).exists(up["key"])
    with pytest.raises(StorageUnavailable):
        put_part(up["urls"][1], bytes(10), 30)
    assert steps(sweeper.url, "killed") == [1]
    sweeper.stop()
    service = make_service(backends, service.data_dir)
    with CheckpointClient(service.url, direct=True) as client:
        client.save("killed", 2, {"w": w + 1})
        assert torch.equal(client.load("killed")["w"], w + 1)
    assert steps(service.url, "killed") == [1, 2]


def test_a_registration_that_does_not_match_its_upload_or_run_is_refused(
    make_service: Callable[..., Service], backends: dict[str, str]
) -> None:
    service = make_service(backends)
    base = f"{service.url}/v1/runs/liar/checkpoints/1/parts/p"
    up = httpx.post(base + "/upload", json={"max_bytes": 100}).json()
    upload_key(up["key"], "liar", 1)
    put_part(up["urls"][0], bytes(100), 30)
    writer = DirectWriter(workers=1)
    transport = Transport(service.url, retries=0)
    try:
        data = np.arange(25, dtype=np.float32)
        sent = writer.save_part(
            transport,
            "/v1/runs/liar/checkpoints/1",
            "liar",
            "q",
            [("w", "F32", (25,))],
            lambda: pieces_of([memoryview(data.tobytes())]),
        )
        writer.discard(sent)
    finally:
        writer.close()
        transport.close()
    header = '{"w":{"dtype":"F32","shape":[25],"data_offsets":[0,100]}}'
    tail = {"parent": None, "chunks": [[0, 0, 100, "raw", "0" * 32]], "tensors": ["0" * 32]}
    doc = {"key": up["key"], "upload_id": up["upload_id"], "header": header, "tail": tail}
    # the upload holds 100 bytes: a row of 99 does not match it
    short = httpx.post(base + "/uploaded", json={**doc, "sizes": [99]})
    assert_error(short, 400, "invalid_stream")
    # another run's or step's key: the run and the step are read from the spread key
    for other_run, other_step in (("other", 1), ("liar", 2)):
        other = f"{service.url}/v1/runs/{other_run}/checkpoints/{other_step}/parts/p/uploaded"
        assert_error(httpx.post(other, json={**doc, "sizes": [100]}), 400, "invalid_request")
    assert steps(service.url, "liar") == []


def test_an_expired_url_fails_the_save_typed_and_leaves_nothing(
    make_service: Callable[..., Service], checked: tuple[dict[str, str], PresignChecker]
) -> None:
    """A part PUT past its URL's expiry: S3 answers 403 "Request has expired", the save
    raises UrlExpired (not retried: the URLs are the plan's, plan again), nothing is
    visible and ``latest`` stays; the upload it left open is aborted by the sweep; the next
    save, with fresh URLs, works. S3's clock is moved on past the expiry rather than waited
    for: a URL of ``CKPTSTORE_URL_TTL_S`` 60 s used 61 s "later"."""
    backends, checker = checked
    env = {**backends, "CKPTSTORE_URL_TTL_S": "60"}
    service = make_service(env)
    store = s3_store(backends)
    w = torch.arange(100_000, dtype=torch.float32)
    with CheckpointClient(service.url, direct=True) as client:
        client.save("late", 1, {"w": w})
        up = httpx.post(
            f"{service.url}/v1/runs/late/checkpoints/2/parts/probe/upload", json={"max_bytes": 1}
        ).json()
        assert up["url_ttl_s"] == 60
        assert parse_qs(urlsplit(up["urls"][0]).query)["X-Amz-Expires"] == ["60"]  # signed
        store.abort_presigned(up["key"], up["upload_id"])
        checker.skew_s = 61
        with pytest.raises(UrlExpired, match="expired"):
            client.save("late", 2, {"w": w + 1})
        assert checker.expired >= 1 and checker.mismatched == 0
        assert steps(service.url, "late") == [1]
        (left,) = store.list_open_uploads()  # the expired URLs' upload, for the sweep
        upload_key(left.key, "late", 2)
        checker.skew_s = 0  # the URLs handed out from now on are good (loads' GETs too)
        assert torch.equal(client.load("late")["w"], w)  # latest unchanged
        client.save("late", 2, {"w": w + 1})
        assert torch.equal(client.load("late")["w"], w + 1)
    assert store.list_open_uploads() == [left]
    service = sweeping_soon(make_service, service, env)
    wait_until(lambda: store.list_open_uploads() == [], 60, "the upload aborted")
    assert steps(service.url, "late") == [1, 2]


def test_a_url_serves_its_own_key_and_upload_only(
    make_service: Callable[..., Service], checked: tuple[dict[str, str], PresignChecker]
) -> None:
    """A part URL edited to name another key (of the same run, of another run) or another
    upload: S3 refuses it (403 SignatureDoesNotMatch, a Forbidden that is no UrlExpired)
    and nothing lands; the URL as handed out is taken."""
    backends, checker = checked
    service = make_service(backends)
    store = s3_store(backends)

    def upload(run: str, step: int) -> dict[str, object]:
        url = f"{service.url}/v1/runs/{run}/checkpoints/{step}/parts/p/upload"
        answer = httpx.post(url, json={"max_bytes": 100})
        assert answer.status_code == 200, answer.text
        return answer.json()  # type: ignore[no-any-return]

    mine, sibling, foreign = upload("mine", 1), upload("mine", 2), upload("theirs", 1)
    url = str(mine["urls"][0])  # type: ignore[index]
    assert str(mine["key"]) in url
    edits = [
        url.replace(str(mine["key"]), str(sibling["key"])),
        url.replace(str(mine["key"]), str(foreign["key"])),
        url.replace(str(mine["upload_id"]), str(sibling["upload_id"])),
        url.replace("partNumber=1", "partNumber=2"),
    ]
    for n, edited in enumerate(edits, start=1):
        assert edited != url
        with pytest.raises(Forbidden, match="SignatureDoesNotMatch") as caught:
            put_part(edited, bytes(100), 30)
        assert not isinstance(caught.value, UrlExpired)
        assert checker.mismatched == n
    for other in (sibling, foreign):  # nothing landed in the other uploads
        with pytest.raises(ValueError, match="holds parts"):
            store.complete_presigned(str(other["key"]), str(other["upload_id"]), 100)
    put_part(url, bytes(100), 30)
    assert store.complete_presigned(str(mine["key"]), str(mine["upload_id"]), 100) == 100
    assert store.get(str(mine["key"])) == bytes(100)


def test_s3_down_mid_upload_fails_typed_and_the_next_save_works(
    make_service: Callable[..., Service], backends: dict[str, str], own_moto: tuple[str, int]
) -> None:
    """The bucket stops answering after the writer's upload began (its URLs handed out,
    the first bytes encoded): the PUTs time out (each retried once here), the save fails
    StorageUnavailable (which a client retries), nothing is visible; once S3 is back the
    next save works."""
    service = make_service({**backends, "CKPTSTORE_S3_ENDPOINT_URL": own_moto[0]})
    w = np.random.default_rng(0).standard_normal(6 << 20).astype(np.float32)  # 24 MiB
    halfway, release = threading.Event(), threading.Event()

    def stalled() -> Iterator[TensorPiece]:
        pieces = list(pieces_of([memoryview(w.tobytes())]))
        yield pieces[0]
        halfway.set()
        release.wait(60)  # S3 freezes meanwhile
        yield from pieces[1:]

    writer = DirectWriter(workers=1, put_attempts=2, put_backoff=0.05)
    transport = Transport(service.url, timeout=3, retries=0)
    failed: list[BaseException] = []

    def send() -> None:
        try:
            writer.save_part(transport, "/v1/runs/down/checkpoints/1", "down", "p",
                             [("w", "F32", w.shape)], stalled)  # fmt: skip
        except BaseException as exc:
            failed.append(exc)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        assert halfway.wait(60)
        with frozen(own_moto[1]):
            release.set()
            sender.join(120)
    finally:
        release.set()
        writer.close()
        transport.close()
    assert len(failed) == 1 and isinstance(failed[0], StorageUnavailable), failed
    assert steps(service.url, "down") == []
    with CheckpointClient(service.url, direct=True) as client:
        client.save("down", 1, {"w": torch.from_numpy(w)})
        assert torch.equal(client.load("down", 1)["w"], torch.from_numpy(w))


SLOWDOWN = ("503 Slow Down", SLOWDOWN_BODY)
INTERNAL = ("500 Internal Server Error", s3_error("InternalError", "We encountered an error"))
UNAVAILABLE = ("503 Service Unavailable", s3_error("ServiceUnavailable", "Reduce your rate"))
EXPIRED = ("403 Forbidden", s3_error("AccessDenied", "Request has expired"))
MISMATCH = ("403 Forbidden", s3_error("SignatureDoesNotMatch", "The signature does not match"))


def part(n: int) -> bytes:
    """The marker of part ``n``'s presigned PUTs in a request line (botocore's query:
    ``?uploadId=...&partNumber=N&X-Amz-Algorithm=...``)."""
    return f"&partNumber={n}&".encode()


def part_puts(lines: list[bytes]) -> tuple[dict[int, int], set[str]]:
    """The presigned part PUTs among the request lines a proxy read: attempts by part
    number, and the upload ids they name."""
    attempts: Counter[int] = Counter()
    uploads: set[str] = set()
    for line in lines:
        method, target, _ = line.split(b" ")
        if method != b"PUT" or b"X-Amz-Signature=" not in target:
            continue
        query = parse_qs(urlsplit(target.decode()).query)
        attempts[int(query["partNumber"][0])] += 1
        uploads.add(query["uploadId"][0])
    return dict(attempts), uploads


def calls(lines: list[bytes], suffix: bytes) -> int:
    """Requests to the service whose path ends in ``suffix`` (``b"/plan"``)."""
    return sum(1 for line in lines if line.split(b" ")[1].endswith(suffix))


def random_state(seed: int) -> dict[str, torch.Tensor]:
    """9 MiB that no codec shrinks: 2 parts (of the store's 8 MiB), whatever the parent."""
    rng = np.random.default_rng(seed)
    big = rng.integers(-(2**31), 2**31, 9 << 18, dtype=np.int32)  # random bits
    return {"big": torch.from_numpy(big), "step": torch.tensor(seed)}


def test_a_throttled_or_failed_part_put_is_retried_alone(
    make_service: Callable[..., Service],
    s3_front: tuple[dict[str, str], FaultProxy, PresignChecker],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """S3 answers 503 SlowDown (twice), 500 InternalError, 503 ServiceUnavailable, or
    resets the connection after taking the part: the writer PUTs that part again, to the
    same URL with the same bytes, and the save succeeds with one plan, one upload and the
    PUT attempts counted at the proxy; every step loads bit-exactly."""
    backends, s3, checker = s3_front
    service = make_service(backends)
    # what each step's save meets, the PUT attempts by part number, the answers made
    faults: list[tuple[Callable[[], object], dict[int, int], int]] = [
        (lambda: s3.answer(part(1), 2, *SLOWDOWN), {1: 3, 2: 1}, 2),
        (
            lambda: (s3.answer(part(2), 1, *INTERNAL), s3.answer(part(1), 1, *UNAVAILABLE)),
            {1: 2, 2: 2},
            2,
        ),
        (lambda: s3.drop_answers(part(2), 1), {1: 1, 2: 2}, 0),  # reset after S3 took it
    ]
    states = {step: random_state(step) for step in range(1, len(faults) + 1)}
    with (
        FaultProxy("127.0.0.1", service.port, http=True) as front,
        CheckpointClient(front.url, direct=True) as client,
        caplog.at_level(logging.WARNING, logger="ckptstore"),
    ):
        for step, (arm, expected, made) in enumerate(faults, start=1):
            s3_mark, front_mark = len(s3.request_lines), len(front.request_lines)
            answered = s3.answered
            arm()
            client.save("retried", step, states[step])
            attempts, uploads = part_puts(s3.request_lines[s3_mark:])
            assert attempts == expected, (step, attempts)
            assert len(uploads) == 1  # one upload: the part was not retried whole
            assert calls(front.request_lines[front_mark:], b"/plan") == 1
            assert calls(front.request_lines[front_mark:], b"/upload") == 1
            assert s3.answered - answered == made
        assert s3.answers_dropped == 1
        for step, state in states.items():
            assert_same_state(state, client.load("retried", step), path=f"step {step}")
    retries = [r.getMessage() for r in caplog.records if "retrying in" in r.getMessage()]
    assert len(retries) == 5, retries
    assert "SlowDown" in retries[0] and "(part 1)" in retries[0]
    assert f"(retry 1 of {PUT_ATTEMPTS - 1})" in retries[0]
    assert "X-Amz-Signature" not in caplog.text  # a URL is a credential until it expires
    assert steps(service.url, "retried") == [1, 2, 3]
    assert s3_store(backends).list_open_uploads() == []
    assert checker.expired == checker.mismatched == 0


def test_a_part_put_failing_past_its_attempts_fails_the_save_typed(
    make_service: Callable[..., Service],
    s3_front: tuple[dict[str, str], FaultProxy, PresignChecker],
) -> None:
    """Part 2 throttled for good: its PUT is made ``put_attempts`` times, then the rank's
    save raises StorageUnavailable, which the transport's retries (2 here) do not repeat as
    a whole part (one upload); nothing is visible, ``latest`` stays, and once S3 takes PUTs
    again the next save works."""
    backends, s3, _ = s3_front
    service = make_service(backends)
    first, second = random_state(1), random_state(2)
    specs = [("big", "I32", tuple(first["big"].shape)), ("step", "I64", ())]
    writer = DirectWriter(workers=1, put_attempts=3, put_backoff=0.05)
    transport = Transport(service.url, retries=2, backoff=0.05)
    try:
        with CheckpointClient(service.url, direct=True) as client:
            client.save("throttled", 1, first)
            mark = len(s3.request_lines)
            s3.answer(part(2), 10**6, *SLOWDOWN)
            data = [second["big"].numpy(), second["step"].numpy()]
            with pytest.raises(StorageUnavailable, match="503") as caught:
                transport.retry(lambda: writer.save_part(
                    transport, "/v1/runs/throttled/checkpoints/2", "throttled", "rank-0",
                    specs, lambda: pieces_of(memoryview(a.tobytes()) for a in data),
                ))  # fmt: skip
            assert "SlowDown" in str(caught.value)
            attempts, uploads = part_puts(s3.request_lines[mark:])
            assert attempts[2] == 3 and len(uploads) == 1, attempts
            assert steps(service.url, "throttled") == [1]
            assert_same_state(first, client.load("throttled"), path="latest")
            s3.clear()
            client.save("throttled", 2, second)
            assert_same_state(second, client.load("throttled", 2), path="step 2")
    finally:
        writer.close()
        transport.close()
    assert steps(service.url, "throttled") == [1, 2]


@pytest.mark.parametrize(("answer", "error"), [(MISMATCH, Forbidden), (EXPIRED, UrlExpired)])
def test_a_403_to_a_part_put_is_not_retried(
    make_service: Callable[..., Service],
    s3_front: tuple[dict[str, str], FaultProxy, PresignChecker],
    answer: tuple[str, bytes],
    error: type[Forbidden],
) -> None:
    """A signature mismatch (Forbidden) or an expired URL (UrlExpired, plan again) is
    raised after one attempt, by the part PUT and by the client (no whole-part retry
    either); nothing is visible; the next save works."""
    backends, s3, _ = s3_front
    service = make_service(backends)
    state = random_state(3)
    with (
        FaultProxy("127.0.0.1", service.port, http=True) as front,
        CheckpointClient(front.url, direct=True) as client,
    ):
        s3.answer(part(1), 1, *answer)
        with pytest.raises(error) as caught:
            client.save("refused", 1, state)
        assert (error is UrlExpired) == isinstance(caught.value, UrlExpired)
        attempts, _ = part_puts(s3.request_lines)
        assert attempts[1] == 1, attempts
        assert calls(front.request_lines, b"/plan") == 1
        assert steps(service.url, "refused") == []
        client.save("refused", 1, state)
        assert_same_state(state, client.load("refused", 1), path="step 1")
