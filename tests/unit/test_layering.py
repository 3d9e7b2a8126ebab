"""The package layers: core (torch-free) <- client, core <- service; never client <-> service."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imported_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return {name.split(".")[0] for name in out.stdout.split()}


@pytest.mark.parametrize(
    ("package", "banned"),
    [("client/ckptstore", "ckptstore_service"), ("core/ckptstore_core", "ckptstore_service")],
)
def test_no_source_file_names_a_higher_layer(package: str, banned: str) -> None:
    files = list((ROOT / package).rglob("*.py"))
    assert files
    for path in files:
        assert banned not in path.read_text(), path


def test_core_never_imports_the_client() -> None:
    for path in (ROOT / "core/ckptstore_core").rglob("*.py"):
        text = path.read_text()
        assert "from ckptstore " not in text and "from ckptstore." not in text, path
        assert "import ckptstore\n" not in text, path


def test_the_service_app_leaves_torch_and_the_client_out() -> None:
    modules = _imported_after("import ckptstore_service.app, ckptstore_service.cli")
    assert "ckptstore_service" in modules
    assert "torch" not in modules
    assert "ckptstore" not in modules  # the trainers' package


def test_import_ckptstore_does_not_import_torch() -> None:
    modules = _imported_after("import ckptstore")
    assert "torch" not in modules and "ckptstore_service" not in modules


def test_the_service_image_copies_every_package_of_the_wheel() -> None:
    import tomllib

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"][
        "targets"
    ]["wheel"]["packages"]
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    for package in packages:
        top = package.split("/")[0]
        assert f"COPY {top} ./{top}" in dockerfile, top


#: The client's modules, bottom up: each imports (at the top or lazily) only modules of
#: lower rows, and no private (``_x``) name of another module (docs/client.md#transport).
CLIENT_LAYERS = [
    {"transport", "state"},
    {"staging", "files", "tokens", "dcp_metadata", "direct_load"},
    {"direct"},  # a direct save reads its parent's tensors as a direct load does
    {"parts"},
    {"client"},
    {"dcp"},
    {"cli", "integrations.lightning", "integrations.transformers", "integrations", "__init__"},
]


def _client_imports(path: Path) -> list[tuple[str, str]]:
    """``(module, name)`` of every ``from ckptstore[.module] import name`` in ``path``."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            top, _, rest = node.module.partition(".")
            if top != "ckptstore":
                continue
            for alias in node.names:
                found.append((rest or alias.name, alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                top, _, rest = alias.name.partition(".")
                if top == "ckptstore" and rest:
                    found.append((rest, ""))
    return found


def test_client_modules_form_layers() -> None:
    layer = {name: i for i, names in enumerate(CLIENT_LAYERS) for name in names}
    package = ROOT / "client/ckptstore"
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)
        assert module in layer, f"{module}: add it to CLIENT_LAYERS"
        for imported, name in _client_imports(path):
            assert imported in layer, f"{module} imports ckptstore.{imported}: not a module?"
            assert layer[imported] < layer[module] or module == "__init__", (
                f"{module} (layer {layer[module]}) imports {imported} (layer {layer[imported]})"
            )
            assert not name.startswith("_"), f"{module} imports private {imported}.{name}"
