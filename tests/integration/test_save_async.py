"""``CheckpointClient.save_async`` through a real service, with a small real AdamW training.

What it promises: control returns once the state is copied; the checkpoint is the state as it
was at the call (in-place training steps after the return do not leak in) and byte-identical
to a synchronous ``save`` of it; one save in flight (the next call waits); errors on the
future, never in the loop; ``wait``/``close``/``with``/interpreter exit wait for the upload.

Where a test must hold an upload back to make an ordering certain, it wraps the client's own
upload or POST in a gate (an ``Event``); everything past the gate is the real client talking
to a real uvicorn service.
"""

from __future__ import annotations

import copy
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ckptstore import CheckpointClient, ServiceUnavailable, staging
from ckptstore.staging import StagingBuffers, _copy_all, _split
from ckptstore.state import flatten, tensor_bytes
from support.serviceproc import Service, free_port
from support.states import assert_same_state

State = dict[str, Any]


class Trainer:
    """A small MLP with LayerNorm, AdamW and a cosine schedule, trained on random data.

    ``state()`` returns live views, as a trainer passes them: ``model.state_dict()`` and
    ``optimizer.state_dict()`` tensors share memory with the parameters and Adam's moments,
    so every ``step()`` rewrites them in place. ``extra`` holds a large numpy array (sent as
    a tensor, sharing memory with the array) and a list the loop appends to.
    """

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 8))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=50)
        self.table = np.random.default_rng(seed).standard_normal((64, 256))  # 128 KiB
        self.losses: list[float] = []
        self.n = 0

    def step(self) -> None:
        x = torch.randn(16, 32)
        loss = self.model(x).square().mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.table += 1.0
        self.losses.append(loss.item())
        self.n += 1

    def state(self) -> State:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "scheduler": self.sched.state_dict(),
            "rng": torch.get_rng_state(),
            "step": self.n,
            "extra": {"table": self.table, "losses": self.losses},
        }


def trained(steps: int = 3) -> Trainer:
    t = Trainer()
    for _ in range(steps):
        t.step()
    return t


def awkward() -> State:
    """Tensors a copy could get wrong: NaN payloads and -0.0, half types, a transposed
    view, a tied pair, an empty tensor, a tensor that requires grad, a lazy negation."""
    bits = [0x7FC00001, 0x7F800001, 0xFFC0DEAD, 0x80000000]  # quiet/signalling NaNs, -0.0
    nan_bits = torch.tensor(np.array(bits, dtype=np.uint32).view(np.int32))
    w = torch.randn(6, 5)
    return {
        "nan": nan_bits.view(torch.float32),
        "bf16": torch.randn(7, 3).to(torch.bfloat16),
        "f16": torch.randn(9).to(torch.float16),
        "f64": torch.randn(4, dtype=torch.float64),
        "mask": torch.rand(11) > 0.5,
        "ids": torch.arange(-5, 5, dtype=torch.int64),
        "transposed": w.t(),
        "tied": [w, w],
        "empty": torch.empty(0, 3),
        "grad": torch.randn(3, requires_grad=True),
        "neg": torch._neg_view(torch.randn(5)),  # a lazy negation: memcpy would miss it
    }


@pytest.fixture
def client(service: Service) -> Iterator[CheckpointClient]:
    with CheckpointClient(service.url) as c:
        yield c


def gate_uploads(client: CheckpointClient, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold every upload of ``client`` (staged already, no connection taken) until the
    returned event is set. Call before the client's first ``save_async``."""
    release = threading.Event()
    upload = client._upload

    def gated(*args: Any) -> Any:
        assert release.wait(60), "the test never released the upload"
        return upload(*args)

    monkeypatch.setattr(client, "_upload", gated)
    return release


def returns_within(
    fn: Callable[[], object], seconds: float
) -> tuple[threading.Thread, list[object]]:
    """Run ``fn`` in a thread; the thread and a list that gets its result."""
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    return thread, out


# --------------------------------------------------------------------------------- exact


def test_saved_checkpoint_is_the_state_bit_for_bit_and_what_save_stores(
    client: CheckpointClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(staging, "_COPY_THREADS", 3)  # whatever this host's CPU count
    trainer = trained()
    # 18 MiB more: large states are copied over several threads, in byte ranges
    big = {"a": torch.randn(4 << 20), "b": torch.randn(1 << 20).to(torch.bfloat16)}
    state = {**trainer.state(), "awkward": awkward(), "big": big}
    expected = copy.deepcopy(state)

    future = client.save_async("exact", 1, state)
    info = future.result(timeout=60)

    assert (info.run, info.step) == ("exact", 1)
    assert_same_state(expected, client.load("exact", 1))
    # the same step again with the same content is an idempotent 200 returning the stored
    # record, different bytes a 409: a synchronous save of the state sent the same body
    assert client.save("exact", 1, expected) == info
    assert client.list("exact") == [info]


# ------------------------------------------------------------------------------ mutation


def test_in_place_training_after_return_does_not_leak_into_the_checkpoint(
    client: CheckpointClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = gate_uploads(client, monkeypatch)
    trainer = trained()
    state = trainer.state()
    expected = copy.deepcopy(state)

    future = client.save_async("mutate", 1, state)
    # the upload has not even started: everything below happens before a byte is sent
    for _ in range(3):
        trainer.step()  # AdamW rewrites parameters, exp_avg, exp_avg_sq and step in place
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.mul_(-2.0)
    trainer.losses.append(123.0)
    state["scheduler"]["last_epoch"] = 10_000
    assert not future.done()
    release.set()
    future.result(timeout=60)

    loaded = client.load("mutate", 1)
    assert_same_state(expected, loaded)
    # and the live state really did move on
    live = trainer.model.state_dict()["0.weight"]
    assert not torch.equal(live, loaded["model"]["0.weight"])
    assert trainer.table[0, 0] == expected["extra"]["table"][0, 0] + 3.0


# ----------------------------------------------------------------------- one in flight


def test_the_next_save_waits_for_the_previous_and_both_land(
    client: CheckpointClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = gate_uploads(client, monkeypatch)
    trainer = trained()
    first = copy.deepcopy(trainer.state())
    f1 = client.save_async("twice", 1, trainer.state())
    trainer.step()
    second = copy.deepcopy(trainer.state())

    thread, out = returns_within(lambda: client.save_async("twice", 2, trainer.state()), 0.5)
    assert thread.is_alive(), "the second save_async returned while the first was uploading"
    assert not f1.done()
    release.set()
    thread.join(60)
    assert not thread.is_alive()
    (f2,) = out
    assert isinstance(f2, Future)
    assert f1.done()  # finished before the second staged over the shared buffers
    trainer.step()  # after the second returned: must not leak into it either

    i1, i2 = f1.result(), f2.result(timeout=60)
    assert [c.step for c in client.list("twice")] == [1, 2]
    assert i2.parent_step == 1  # stored as a delta against the first, in order
    assert_same_state(first, client.load("twice", 1))
    assert_same_state(second, client.load("twice", 2))
    assert i1.step == 1


def test_staging_buffers_are_reused_when_names_dtypes_and_shapes_match() -> None:
    buffers = StagingBuffers()
    a = buffers.stage(flatten({"w": torch.ones(4, 4), "b": torch.zeros(3), "x": torch.ones(2)}))
    ptrs = {name: t.data_ptr() for name, t in a.tensors}
    b = buffers.stage(
        flatten({"w": torch.full((4, 4), 2.0), "b": torch.zeros(5), "y": torch.ones(2)})
    )
    staged = dict(b.tensors)
    assert staged["w"].data_ptr() == ptrs["w"]  # same name, dtype, shape: same memory
    assert torch.equal(staged["w"], torch.full((4, 4), 2.0))
    assert staged["b"].shape == (5,) and staged["b"].data_ptr() != ptrs["b"]
    assert buffers.nbytes == (16 + 5 + 2) * 4  # "x" went with the save that dropped it
    buffers.clear()
    assert buffers.nbytes == 0


def test_split_copies_cover_every_byte_once() -> None:
    sizes = [5, 0, 17, 1, 64, 3]
    pairs = [(np.zeros(n, np.uint8), np.full(n, i + 1, np.uint8)) for i, n in enumerate(sizes)]
    for n in (1, 2, 3, 4, 7, 200):
        for dst, _ in pairs:
            dst[:] = 0
        parts = _split(pairs, n)
        assert len(parts) <= n
        lengths = [sum(d.nbytes for d, _ in part) for part in parts]
        assert sum(lengths) == sum(sizes) and max(lengths) <= -(-sum(sizes) // n)
        for part in parts:
            _copy_all(part)
        assert all(np.array_equal(dst, src) for dst, src in pairs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_accelerator_tensors_are_staged_to_host_buffers_bit_for_bit() -> None:
    state = {
        k: v.cuda() if isinstance(v, torch.Tensor) else v
        for k, v in {**awkward(), "big": torch.randn(1 << 20)}.items()
    }
    flat = flatten(state)
    expected = [(name, bytes(tensor_bytes(t))) for name, t in flat.tensors]
    staged = StagingBuffers().stage(flat)
    for t in state.values():
        if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
            t.detach().add_(1)  # after staging: must not show in the copies
    assert all(t.device.type == "cpu" for _, t in staged.tensors)
    assert [(name, bytes(tensor_bytes(t))) for name, t in staged.tensors] == expected
    big = dict(staged.tensors)["big"]
    assert big.is_pinned()  # a CUDA tensor's buffer is page-locked: its copy is a DMA


# ------------------------------------------------------------------------------- errors


@pytest.mark.timing
def test_service_down_the_error_is_on_the_future_and_training_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    trainer = trained(1)
    with CheckpointClient(url, retries=2, backoff=0.1) as client:
        t0 = time.perf_counter()
        future = client.save_async("down", 1, trainer.state())
        returned = time.perf_counter() - t0
        steps = 0
        while not future.done():
            trainer.step()
            steps += 1
        failed_after = time.perf_counter() - t0

        error = future.exception()
        assert isinstance(error, ServiceUnavailable), error
        assert "cannot reach the ckptstore service" in str(error)
        assert steps > 0  # the loop trained while the client retried
        assert failed_after >= 0.1 * (1 + 2) * 0.5 > returned  # the back-off ran after return
        assert any("save_async of down/1 failed" in r.getMessage() for r in caplog.records)

        # the next save does not raise either; wait() is where the caller asks for the error
        again = client.save_async("down", 2, trainer.state())
        with pytest.raises(ServiceUnavailable):
            client.wait(timeout=60)
        assert isinstance(again.exception(), ServiceUnavailable)
    # leaving the with block (close) did not raise the saves' errors


def test_a_state_that_cannot_be_flattened_fails_on_the_future(
    client: CheckpointClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        future = client.save_async("bad-state", 1, {"ids": {1, 2, 3}})
    with pytest.raises(TypeError, match="unsupported type set"):
        future.result(timeout=0)
    assert caplog.records
    with pytest.raises(TypeError):
        client.wait()
    # the client goes on saving
    assert client.save_async("bad-state", 1, {"w": torch.ones(2)}).result(timeout=60).step == 1


def test_a_done_callback_cannot_wait_for_uploads(
    client: CheckpointClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # callbacks run on the upload thread: save_async/wait/close there would wait for it
    release = gate_uploads(client, monkeypatch)
    future = client.save_async("callback", 1, {"w": torch.ones(3)})
    refused: list[BaseException] = []
    called = threading.Event()

    def callback(_: object) -> None:
        for call in (
            lambda: client.save_async("callback", 2, {"w": torch.ones(3)}),
            client.wait,
            client.close,
        ):
            try:
                call()
            except RuntimeError as exc:
                refused.append(exc)
        called.set()

    future.add_done_callback(callback)
    release.set()
    assert future.result(timeout=60).step == 1
    assert called.wait(60)
    assert len(refused) == 3 and all("done-callback" in str(e) for e in refused)
    assert client.save_async("callback", 2, {"w": torch.ones(3)}).result(timeout=60).step == 2


# ------------------------------------------------------------------------- concurrency


def test_loads_and_listings_run_beside_an_upload_in_flight(
    client: CheckpointClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = {"w": torch.arange(10.0)}
    client.save("beside", 1, small)
    # hold the background POST half sent, its connection taken
    started, release = threading.Event(), threading.Event()
    post = client.transport.post

    def paused_post(path: str, body: Iterator[Any], length: int, sent: Any) -> Any:
        def paused() -> Iterator[Any]:
            it = iter(body)
            yield next(it)
            started.set()
            assert release.wait(60)
            yield from it

        return post(path, paused(), length, sent)

    monkeypatch.setattr(client.transport, "post", paused_post)
    trainer = trained()
    expected = copy.deepcopy(trainer.state())
    future = client.save_async("beside", 2, trainer.state())
    assert started.wait(60)
    try:
        # the foreground uses other connections of the pool while the upload holds its own
        for _ in range(3):
            assert [c.step for c in client.list("beside")] == [1]
            assert_same_state(small, client.load("beside", 1))
            assert [r.name for r in client.runs()].count("beside") == 1
        assert not future.done()
    finally:
        release.set()
    assert future.result(timeout=60).step == 2
    assert_same_state(expected, client.load("beside", 2))


# -------------------------------------------------------------------------------- exit


def test_wait_returns_the_last_checkpoint_or_times_out(
    client: CheckpointClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert client.wait() is None  # no save_async yet
    release = gate_uploads(client, monkeypatch)
    future = client.save_async("wait", 1, trained().state())
    with pytest.raises(TimeoutError):
        client.wait(timeout=0.2)
    release.set()
    info = client.wait(timeout=60)
    assert info is not None and info == future.result() and info.step == 1


def test_close_waits_for_the_save_in_flight(
    client: CheckpointClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = gate_uploads(client, monkeypatch)
    trainer = trained()
    expected = copy.deepcopy(trainer.state())
    future = client.save_async("close", 1, trainer.state())

    thread, _ = returns_within(client.close, 0.5)
    assert thread.is_alive(), "close() returned with an upload in flight"
    assert not future.done()
    release.set()
    thread.join(60)
    assert not thread.is_alive() and future.done()
    assert future.result().step == 1
    assert_same_state(expected, client.load("close", 1))
    # a closed client saves again (a fresh worker)
    assert client.save_async("close", 2, trainer.state()).result(timeout=60).step == 2


def test_leaving_the_with_block_waits_for_the_save(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    with CheckpointClient(service.url) as client:
        release = gate_uploads(client, monkeypatch)
        future = client.save_async("with", 1, trained().state())
        threading.Timer(0.3, release.set).start()
    assert future.done() and future.result().step == 1
    with CheckpointClient(service.url) as other:
        assert [c.step for c in other.list("with")] == [1]


def test_interpreter_exit_finishes_the_upload_in_flight(service: Service) -> None:
    # a trainer that forgets wait()/close(): the process still exits after the upload
    script = f"""
import torch
from ckptstore import CheckpointClient
client = CheckpointClient({service.url!r})
future = client.save_async("exit", 1, {{"w": torch.randn(4 << 20)}})
print("returned", future.done(), flush=True)
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "returned False"  # 16 MiB: the upload was still in flight
    with CheckpointClient(service.url) as client:
        assert [c.step for c in client.list("exit")] == [1]
