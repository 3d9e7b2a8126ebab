"""``ckptstore-service db upgrade | current`` as a newcomer runs them: on a fresh machine, in a
fresh folder, with the defaults (``./ckptstore-data``) or ``CKPTSTORE_DATABASE_URL``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CKPTSTORE_")}
    return subprocess.run(
        [sys.executable, "-m", "ckptstore_service.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env={**clean, **(env or {})},
    )


def test_current_before_anything_exists(tmp_path: Path) -> None:
    # the default database is ./ckptstore-data/catalog.sqlite3: not there yet
    done = cli("db", "current", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "schema revision: none"
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "ckptstore-data").exists()  # asking creates nothing

    done = cli("db", "upgrade", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "ckptstore-data" / "catalog.sqlite3").is_file()
    assert "0012" in cli("db", "current", cwd=tmp_path).stdout


def test_upgrade_creates_the_folder_of_an_explicit_sqlite_url(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'new' / 'folder' / 'cat.sqlite3'}"
    done = cli("db", "upgrade", cwd=tmp_path, env={"CKPTSTORE_DATABASE_URL": url})
    assert done.returncode == 0, done.stderr
    assert "0012" in done.stdout
    assert "0012" in cli("db", "current", "--database-url", url, cwd=tmp_path).stdout


def test_unreachable_database_is_a_message_not_a_traceback(tmp_path: Path) -> None:
    for url in ("postgresql+psycopg://nobody@127.0.0.1:1/none", "nonsense://"):
        done = cli("db", "current", "--database-url", url, cwd=tmp_path)
        assert done.returncode == 1
        assert done.stderr.startswith("ckptstore-service: "), done.stderr
        assert "Traceback" not in done.stderr


def test_the_message_hides_the_password_and_covers_a_folder_it_cannot_make(
    tmp_path: Path,
) -> None:
    # the message printed the URL whole, password included; and a folder that cannot be
    # made (here: under a file) was an OSError traceback
    done = cli(
        "db",
        "current",
        "--database-url",
        "postgresql+psycopg://u:s3cret@127.0.0.1:1/x",
        cwd=tmp_path,
    )
    assert done.returncode == 1 and done.stderr.startswith("ckptstore-service: "), done.stderr
    assert "s3cret" not in done.stderr and "***" in done.stderr
    # a driver that is not installed: the catalog refuses the URL before connecting
    url = "postgresql+nodriver://u:s3cret@h/x"
    done = cli("db", "current", "--database-url", url, cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.startswith("ckptstore-service: "), done.stderr
    assert "s3cret" not in done.stderr and "***" in done.stderr
    (tmp_path / "file").write_text("")
    url = f"sqlite:///{tmp_path / 'file' / 'sub' / 'cat.sqlite3'}"
    done = cli("db", "upgrade", "--database-url", url, cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.startswith("ckptstore-service: "), done.stderr
    assert "Traceback" not in done.stderr
