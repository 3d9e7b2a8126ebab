"""The error tables say what the error tree is: errors.py's docstring (the core tree, parents
by indentation), docs/http-api.md's table (every class, its status, code and parent) and the
README's list of codes. Issue 31 found all three missing ``lock_lost``, ``too_many_uploads``
or ``request_timeout``; an error added to the tree without its rows fails here."""

from __future__ import annotations

import re
from pathlib import Path

import ckptstore_core.errors as errors_module
import ckptstore_service.storage  # noqa: F401  (defines BlobNotFound: part of the tree)
from ckptstore_core.errors import CkptStoreError, error_types

ROOT = Path(__file__).resolve().parents[2]

# (class, status, code, parent class or None for a child of CkptStoreError)
Row = tuple[str, int, str, str | None]


def _tree(core_only: bool) -> set[Row]:
    rows = set()
    for cls in error_types():
        if core_only and cls.__module__ != errors_module.__name__:
            continue
        if cls.__module__.split(".")[0] == "ckptstore":
            continue  # the client's own refinements (transport.RetriedOut) travel no wire
        base = cls.__base__
        parent = None if base is CkptStoreError else base.__name__  # type: ignore[union-attr]
        rows.add((cls.__name__, cls.status, cls.code, parent))
    return rows


def _docstring_rows() -> set[Row]:
    """``├── Name   400 code   text`` lines; the parent is the nearest line above at one
    level less of indentation (4 columns a level)."""
    rows = set()
    stack: list[str] = []
    line_re = re.compile(r"^(?P<prefix>[ │├└─]*?)[├└]── (\w+)\s+(\d{3}) (\w+)")
    for line in (errors_module.__doc__ or "").splitlines():
        found = line_re.match(line)
        if found is None:
            continue
        level = (len(found.group("prefix")) - 4) // 4
        name, status, code = found.group(2), int(found.group(3)), found.group(4)
        del stack[level:]
        rows.add((name, status, code, stack[-1] if stack else None))
        stack.append(name)
    return rows


def test_errors_docstring_is_the_core_tree() -> None:
    assert _docstring_rows() == _tree(core_only=True)


def test_http_api_table_is_the_tree() -> None:
    text = (ROOT / "docs" / "http-api.md").read_text()
    found = re.findall(
        r"^\| `(\w+)`(?: \(an? `(\w+)`\)| \(service, `[\w/.]+`\))? \| (\d{3}) \| `(\w+)` \|",
        text,
        re.MULTILINE,
    )
    rows = {(name, int(status), code, parent or None) for name, parent, status, code in found}
    rows.discard(("CkptStoreError", 500, "error", None))  # the base class has its row too
    assert rows == _tree(core_only=False)


def test_readme_lists_every_code() -> None:
    text = (ROOT / "README.md").read_text()
    paragraph = text.split("with a stable code:", 1)[1].split("Bad bodies", 1)[0]
    listed = set(re.findall(r"`(?:\d{3} )?([a-z_]+)`", paragraph))
    assert listed == {code for _, _, code, _ in _tree(core_only=False)}
