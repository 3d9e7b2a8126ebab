"""A real training job checkpoints, dies, and a new process resumes bit-exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from support.serviceproc import Service

TRAINER = Path(__file__).with_name("trainer.py")


def train(service: Service, run: str, out: Path, *args: str) -> dict[str, str]:
    subprocess.run(
        [sys.executable, str(TRAINER), service.url, run, "--losses", str(out), *args],
        check=True,
        timeout=300,
    )
    losses: dict[str, str] = json.loads(out.read_text())
    return losses


@pytest.mark.slow
def test_resume_in_a_new_process_is_bit_identical(service: Service, tmp_path: Path) -> None:
    straight = train(service, "straight", tmp_path / "a.json", "--steps", "40")
    first = train(service, "resumed", tmp_path / "b.json", "--steps", "20", "--save-every", "5")
    assert first == {k: v for k, v in straight.items() if int(k) <= 20}
    listed = httpx.get(f"{service.url}/v1/runs/resumed/checkpoints").json()["checkpoints"]
    assert [c["step"] for c in listed] == [5, 10, 15, 20]
    assert [c["parent_step"] for c in listed] == [None, 5, 10, 15]
    assert all(c["stored_bytes"] < c["raw_bytes"] for c in listed[1:])
    # the "crash": a brand-new process that knows nothing but the run name
    second = train(service, "resumed", tmp_path / "c.json", "--steps", "40", "--resume")
    assert sorted(map(int, second)) == list(range(21, 41))
    assert second == {k: v for k, v in straight.items() if int(k) > 20}
