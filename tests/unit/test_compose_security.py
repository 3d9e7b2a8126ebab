"""The compose deployment's exposure (docs/security.md#the-compose-deployment): tokens on,
only the service's port published, no default for any secret (the stack refuses to start
without them). ``.ci/run`` checks the file's syntax with ``docker-compose config -q``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

COMPOSE = Path(__file__).resolve().parents[2] / "docker-compose.yml"
SECRETS = ("POSTGRES_PASSWORD", "MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD")


def _services() -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())["services"]
    return services


def test_only_the_service_publishes_a_port_and_it_requires_tokens() -> None:
    services = _services()
    assert [name for name, svc in services.items() if svc.get("ports")] == ["ckptstore"]
    assert services["ckptstore"]["ports"] == ["${CKPTSTORE_PORT:-8000}:8000"]
    assert services["ckptstore"]["environment"]["CKPTSTORE_AUTH"] == "on"
    assert "--console-address" not in services["minio"]["command"]


def test_every_secret_must_be_set() -> None:
    text = COMPOSE.read_text()
    uses = re.findall(r"\$\{(" + "|".join(SECRETS) + r")(:?[-?])?([^}]*)\}", text)
    assert {name for name, _, _ in uses} == set(SECRETS)
    for name, operator, _ in uses:
        assert operator == ":?", f"${{{name}}} must have no default (use ${{{name}:?...}})"


def test_the_deployment_guide_tells_the_security_story() -> None:
    """docs/deployment.md points to docs/security.md and never says the service is open:
    tokens exist, and the guide that operators read first must not deny them."""
    guide = (COMPOSE.parent / "docs" / "deployment.md").read_text()
    section = guide.split("## Security", 1)[1].split("\n## ", 1)[0]
    assert "no authentication" not in guide.lower()
    assert "security.md" in section and "CKPTSTORE_AUTH" in section
