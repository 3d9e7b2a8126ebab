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
    assert "0012" in done.stdout


def test_progress_bars(service: Service, capsys: pytest.CaptureFixture[str]) -> None:
    with CheckpointClient(service.url, progress=True) as client:
        client.save("bars", 1, {"w": torch.zeros(1 << 20)})
        back = client.load("bars", 1)
    assert torch.equal(back["w"], torch.zeros(1 << 20))
    err = capsys.readouterr().err
    assert "save bars/1" in err and "load bars/1" in err


def test_the_trainers_cli_has_no_service_commands() -> None:
    assert cli("serve").returncode == 2  # ckptstore-service's, not ckptstore's


def test_url_before_the_command(service: Service) -> None:
    """``ckptstore --url U runs`` as well as ``ckptstore runs --url U``; after the command
    it wins."""
    with CheckpointClient(service.url) as client:
        client.save("url-first", 1, {"w": torch.ones(2)})
    before = cli("--url", service.url, "--retries", "0", "runs")
    assert before.returncode == 0, before.stderr
    assert "url-first" in before.stdout
    both = cli("--url", "http://127.0.0.1:9", "runs", url=service.url)
    assert both.returncode == 0 and "url-first" in both.stdout, both.stderr


def test_a_reader_that_stops_early_is_no_error(service: Service) -> None:
    """``ckptstore ... --json | head``: the pipe is closed before the command writes; no
    BrokenPipeError traceback, no "Exception ignored" at exit, status 0."""
    with CheckpointClient(service.url) as client:
        client.save("piped", 1, {"w": torch.ones(2)})
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptstore.cli", "ls", "piped", "--json", "--url", service.url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # as head does once it has its lines
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err and err == "", err


def test_ls_columns_fit_large_steps_and_empty_checkpoints(service: Service) -> None:
    """A 12-digit step keeps the columns under their headers; an empty checkpoint's ratio
    is ``-``, not ``inf``; ``--legend`` explains the chain columns."""
    with CheckpointClient(service.url) as client:
        client.save("wide", 123456789012, {"w": torch.ones(4)})
        client.save("wide", 123456789013, {})
    ls = cli("ls", "wide", "--legend", url=service.url)
    assert ls.returncode == 0, ls.stderr
    header, first, second, blank, *legend = ls.stdout.splitlines()
    for row in (first, second):
        for column in ("step", "parent", "raw", "stored", "ratio"):
            end = header.index(column) + len(column)
            assert row[end - 1] != " " and row[end] == " ", (column, row)
    assert second.split()[-2:] == ["-", "-"]  # ratio (nothing saved), lossy (none)
    assert blank == "" and legend[0].startswith("parent ") and "keyframe" in ls.stdout
    assert "keyframe" not in cli("ls", "wide", url=service.url).stdout  # not a terminal
    runs = cli("runs", url=service.url)
    header, *rows = runs.stdout.splitlines()
    row = next(r for r in rows if r.startswith("wide "))
    end = header.index("latest") + len("latest")
    assert row[end - 6 : end] == "789013", row


def test_a_first_start_logs_the_schema_in_one_line(tmp_path: Path) -> None:
    """The first ``serve`` on an empty data folder created the catalog schema in ~25 lines
    of Alembic's (a plugin set-up each, every migration's docstring); now one line."""
    from support.serviceproc import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", SERVICE, "serve", "--port", str(port)],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "CKPTSTORE_DATA_DIR": str(tmp_path / "data")},
    )
    assert proc.stderr is not None
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line.rstrip())
            if "Application startup complete" in line:
                break
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    log = "\n".join(lines)
    assert "Application startup complete" in log, log
    assert "alembic" not in log and "Running upgrade" not in log, log
    assert sum("catalog schema: created at " in line for line in lines) == 1, log
    assert len(lines) <= 8, log
