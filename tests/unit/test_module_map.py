"""docs/architecture.md's module map names every module of the three packages, and its
sentence on which client modules import torch names exactly those that do on import."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = {
    "core/ckptstore_core": ROOT / "core" / "ckptstore_core",
    "client/ckptstore": ROOT / "client" / "ckptstore",
    "service/ckptstore_service": ROOT / "service" / "ckptstore_service",
}
SKIPPED = {"__pycache__", "migrations"}  # Alembic's revisions are listed by the folder


def _map() -> str:
    text = DOC.read_text()
    return text.split("<!-- module-map:begin", 1)[1].split("<!-- module-map:end -->", 1)[0]


def _rows(package: str) -> dict[str, str]:
    """The package's table: first column (a module or a folder) -> the row's text."""
    table = _map().split(f"**{package}**", 1)[1].split("\n**", 1)[0]
    rows = re.findall(r"^\| `([^`]+)`[^|]*\|(.*)\|\s*$", table, re.MULTILINE)
    assert rows, f"no table under **{package}**"
    return {name: role for name, role in rows}


def _missing(package: str, folder: Path) -> list[str]:
    rows = _rows(package)
    missing = []
    for path in sorted(folder.rglob("*.py")):
        relative = path.relative_to(folder)
        if SKIPPED & set(relative.parts) or path.name == "__init__.py":
            continue
        if len(relative.parts) == 1:
            if path.name not in rows:
                missing.append(str(relative))
            continue
        row = rows.get(f"{relative.parts[0]}/", "")
        if f"`{path.name}`" not in row and f"**{path.stem}**" not in row:
            missing.append(str(relative))
    return missing


def test_every_module_is_in_the_module_map() -> None:
    missing = {package: _missing(package, folder) for package, folder in PACKAGES.items()}
    assert missing == {package: [] for package in PACKAGES}, (
        "modules the module map of docs/architecture.md does not name"
    )


def _imports_torch_on_import(path: Path) -> bool:
    """A module-level ``import torch...`` (also inside a module-level ``try``)."""
    statements = list(ast.parse(path.read_text()).body)
    while statements:
        node = statements.pop()
        if isinstance(node, ast.Try):
            statements.extend(node.body)
        elif isinstance(node, ast.Import):
            if any(a.name.split(".")[0] == "torch" for a in node.names):
                return True
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            return True
    return False


def test_the_client_modules_said_to_import_torch_are_those_that_do() -> None:
    layers = DOC.read_text().split("## Layers", 1)[1].split("\n## ", 1)[0]
    sentence = layers.split("`import ckptstore` does not import", 1)[1].split("import it at", 1)
    named = set(re.findall(r"`([a-z_/]+\.py|[a-z_]+/)`", sentence[0]))
    client = PACKAGES["client/ckptstore"]
    importing = {
        str(p.relative_to(client)) for p in client.rglob("*.py") if _imports_torch_on_import(p)
    }
    said = {n for n in named if n.endswith(".py")}
    if "integrations/" in named:
        folder = client / "integrations"
        said |= {f"integrations/{p.name}" for p in folder.glob("*.py") if p.name != "__init__.py"}
    assert said == importing
