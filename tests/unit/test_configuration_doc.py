"""docs/configuration.md's "Service settings" documents every setting the service reads, and
nothing else."""

from __future__ import annotations

import re
from pathlib import Path

from ckptstore_service.settings import Settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_every_setting_has_a_row_and_every_row_a_setting() -> None:
    section = DOC.read_text().split("## Service settings", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `(CKPTSTORE_[A-Z0-9_]+)` \|", section, re.MULTILINE))
    settings = {f"CKPTSTORE_{name.upper()}" for name in Settings.model_fields}
    assert settings - rows == set(), "settings without a row in docs/configuration.md"
    assert rows - settings == set(), "rows in docs/configuration.md naming no setting"
