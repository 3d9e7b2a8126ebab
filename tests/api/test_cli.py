"""The ``ckptstore`` and ``ckptstore-service`` commands against a real service."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointClient
from support.serviceproc import Service

SERVICE = "ckptstore_service.cli"


def cli(
    *args: str,
    url: str | None = None,
    env: dict[str, str] | None = None,
    module: str = "ckptstore.cli",
) -> subprocess.CompletedProcess[str]:
    """``ckptstore`` (or, with ``module="ckptstore_service.cli"``, ``ckptstore-service``)."""
    extra = ["--url", url] if url else []
    return subprocess.run(
        [sys.executable, "-m", module, *args, *extra],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_runs_and_ls(service: Service) -> None:
    with CheckpointClient(service.url) as client:
        for step in (3, 6):
            client.save("cli-run", step, {"w": torch.full((1000,), float(step))})
    runs = cli("runs", url=service.url)
    assert runs.returncode == 0, runs.stderr
    assert "cli-run" in runs.stdout and " 6 " in runs.stdout
    ls = cli("ls", "cli-run", url=service.url)
    assert ls.returncode == 0, ls.stderr
    lines = [line.split() for line in ls.stdout.splitlines()[1:]]
    assert [row[0] for row in lines] == ["3", "6"]
    assert lines[1][1] == "3"  # parent step
    missing = cli("ls", "no-such-run", url=service.url)
    assert missing.returncode == 1 and "no-such-run" in missing.stderr


def test_a_url_without_a_scheme_is_one_line() -> None:
    bad = cli("runs", url="localhost:8000")
    assert bad.returncode == 1
    assert bad.stderr.startswith("ckptstore: service URL must be http(s)://")
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["db", "current"]])
def test_a_bad_setting_names_its_variable_in_one_line_each(
    tmp_path: Path, command: list[str]
) -> None:
    env = {
        "CKPTSTORE_CHUNK_BYTES": "5",
        "CKPTSTORE_AUTO_MIGRATE": "maybe",
        "CKPTSTORE_DATA_DIR": str(tmp_path),
    }
    bad = cli(*command, env=env, module=SERVICE)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.stderr
    lines = bad.stderr.splitlines()
    assert lines[0] == "ckptstore-service: invalid configuration"
    assert sorted(line.split("=")[0].strip() for line in lines[1:]) == [
        "CKPTSTORE_AUTO_MIGRATE",
        "CKPTSTORE_CHUNK_BYTES",
    ]


def test_db_upgrade(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cat.sqlite3'}"
    assert "none" in cli("db", "current", "--database-url", url, module=SERVICE).stdout
    done = cli("db", "upgrade", "--database-url", url, module=SERVICE)
    assert done.returncode == 0, done.stderr
    assert "0009" in done.stdout


def test_progress_bars(service: Service, capsys: pytest.CaptureFixture[str]) -> None:
    with CheckpointClient(service.url, progress=True) as client:
        client.save("bars", 1, {"w": torch.zeros(1 << 20)})
        back = client.load("bars", 1)
    assert torch.equal(back["w"], torch.zeros(1 << 20))
    err = capsys.readouterr().err
    assert "save bars/1" in err and "load bars/1" in err


def test_the_trainers_cli_has_no_service_commands() -> None:
    assert cli("serve").returncode == 2  # ckptstore-service's, not ckptstore's
