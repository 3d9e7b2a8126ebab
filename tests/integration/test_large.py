"""A 2 GiB checkpoint round-trips while the service's memory stays bounded."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointClient
from support.serviceproc import Service

GiB = 1 << 30
MiB = 1 << 20
BOUND = 512 * MiB
# what the test writes: the first checkpoint's blob (~1.9 GB: randn does not compress), the
# delta's, and the 2 GiB base cache file (measured: 3.7 GB in its folder at the end)
DISK = 5 * GiB


@pytest.mark.slow
def test_two_gib_checkpoint_with_bounded_service_memory(
    make_service: Callable[..., Service], tmp_path: Path
) -> None:
    free = shutil.disk_usage(tmp_path).free
    assert free >= DISK, f"the 2 GiB test needs {DISK / GiB:.0f} GiB free, {free / GiB:.1f} left"
    # the streaming bound: the decoded chunks that loads keep for the next ones are a
    # budget of their own, CKPTSTORE_DECODED_CACHE_BYTES (docs/architecture.md#memory)
    svc = make_service({"CKPTSTORE_DECODED_CACHE_BYTES": "0"})
    gen = torch.Generator().manual_seed(0)
    # 2 GiB of weights in 8 tensors, plus a bf16 copy of one to mix dtypes
    state = {
        "model": {f"layer{i}.weight": torch.randn(64 * MiB, generator=gen) for i in range(8)},
        "step": 1,
    }
    raw = sum(t.numel() * t.element_size() for t in state["model"].values())
    assert raw >= 2 * GiB
    with CheckpointClient(svc.url, timeout=600) as client:
        baseline = svc.rss_bytes()
        svc.reset_peak_rss()
        t0 = time.perf_counter()
        info = client.save("big", 1, state)
        save_s = time.perf_counter() - t0
        peak_save = svc.rss_bytes("VmHWM") - baseline
        assert info.raw_bytes == raw

        # the next checkpoint moves a little: a delta against the cached base
        for t in state["model"].values():
            t[:: 1 << 12] += 1.0
        svc.reset_peak_rss()
        info2 = client.save("big", 2, state)
        peak_delta = svc.rss_bytes("VmHWM") - baseline
        assert info2.parent_step == 1 and info2.stored_bytes < info.stored_bytes

        svc.reset_peak_rss()
        t0 = time.perf_counter()
        back = client.load("big", 2)
        load_s = time.perf_counter() - t0
        peak_load = svc.rss_bytes("VmHWM") - baseline
        for name, t in state["model"].items():
            assert torch.equal(back["model"][name], t), name
        del back

        svc.reset_peak_rss()
        first = client.load("big", 1, prefix="model/layer0")  # decoded from storage
        peak_decode = svc.rss_bytes("VmHWM") - baseline
        assert list(first["model"]) == ["layer0.weight"]

    print(
        f"\n2 GiB: save {raw / save_s / 1e6:.0f} MB/s, load {raw / load_s / 1e6:.0f} MB/s; "
        f"service peak growth: save {peak_save / MiB:.0f} MiB, delta save "
        f"{peak_delta / MiB:.0f} MiB, load {peak_load / MiB:.0f} MiB, "
        f"decode {peak_decode / MiB:.0f} MiB"
    )
    for peak in (peak_save, peak_delta, peak_load, peak_decode):
        assert peak < BOUND
