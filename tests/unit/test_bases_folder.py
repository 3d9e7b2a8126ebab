"""A direct writer's folder of base files (``ckptstore.direct.BasesFolder``): a writer that
dies without cleaning up (SIGKILL, ``os._exit``: a crash, which is what checkpoints are for)
leaves a raw copy of what it last saved in the temporary directory; the next writer on the
machine removes it, and never a live writer's."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ckptstore.direct import BASES_PREFIX, BasesFolder, DirectWriter, remove_orphans

# a child process that opens a folder in ROOT, writes a base-sized file into it, prints the
# folder's name, then either dies at once without cleaning up or waits for its stdin
CHILD = """
import os, sys
from ckptstore.direct import BasesFolder
folder = BasesFolder(sys.argv[1])
with open(os.path.join(folder.name, "base"), "wb") as f:
    f.write(b"x" * 4096)
print(folder.name, flush=True)
if sys.argv[2] == "die":
    os._exit(0)
sys.stdin.read()
"""


def child(root: Path, mode: str) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


def test_a_dead_writers_folder_goes_and_a_live_ones_stays(tmp_path: Path) -> None:
    live, live_dir = child(tmp_path, "wait")
    dead, dead_dir = child(tmp_path, "die")
    assert dead.wait(30) == 0
    try:
        assert dead_dir.is_dir() and (dead_dir / "base").is_file()  # left behind
        older = tmp_path / f"{BASES_PREFIX}older"  # no lock: an older version's, left alone
        older.mkdir()
        other = tmp_path / "unrelated"
        other.mkdir()

        folder = BasesFolder(str(tmp_path))
        assert not dead_dir.exists()
        assert (live_dir / "base").is_file() and older.is_dir() and other.is_dir()
        assert remove_orphans(str(tmp_path)) == []  # the new one is held too
        folder.cleanup()
        assert not Path(folder.name).exists()
    finally:
        assert live.stdin is not None
        live.stdin.close()
        live.wait(30)
    # the live writer ended normally: its folder went with it
    assert not live_dir.exists()


def test_a_direct_writer_sweeps_the_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dead, dead_dir = child(tmp_path, "die")
    assert dead.wait(30) == 0
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    writer = DirectWriter(workers=1)
    try:
        assert not dead_dir.exists()
        (mine,) = tmp_path.glob(f"{BASES_PREFIX}*")
        assert (mine / "owner.lock").is_file()
    finally:
        writer.close()
    assert not mine.exists()
