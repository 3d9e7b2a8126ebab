"""The ``ckptstore`` command: inspect a service's runs and checkpoints.

The service's own commands (``serve``, ``db``) are ``ckptstore-service``'s.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import; the client is imported when a command needs it
    from ckptstore.client import CheckpointClient

__all__ = ["main"]


def _client(args: argparse.Namespace) -> CheckpointClient:
    from ckptstore.client import CheckpointClient

    try:
        return CheckpointClient(args.url)
    except ValueError as exc:  # a URL without http(s)://: one line, not a traceback
        raise SystemExit(f"ckptstore: {exc}") from None


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    raise AssertionError("unreachable")


def _runs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(f"{'run':<32} {'ckpts':>6} {'latest':>10} {'raw':>12} {'stored':>12} {'ratio':>7}")
        for r in client.runs():
            ratio = r.raw_bytes / r.stored_bytes if r.stored_bytes else float("inf")
            print(
                f"{r.name:<32} {r.checkpoints:>6} {r.latest_step:>10} {_human(r.raw_bytes):>12} "
                f"{_human(r.stored_bytes):>12} {ratio:>6.2f}x"
            )
    return 0


def _ls(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(f"{'step':>10} {'parent':>10} {'key':>4} {'depth':>5} {'raw':>12} {'stored':>12}")
        for c in client.list(args.run):
            parent = "-" if c.parent_step is None else str(c.parent_step)
            print(
                f"{c.step:>10} {parent:>10} {'K' if c.keyframe else '':>4} {c.chain_depth:>5} "
                f"{_human(c.raw_bytes):>12} {_human(c.stored_bytes):>12}"
            )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ckptstore", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    url = os.environ.get("CKPTSTORE_URL", "http://127.0.0.1:8000")
    for name, func, help_ in (
        ("runs", _runs, "list runs"),
        ("ls", _ls, "list a run's checkpoints"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--url", default=url, help="service URL (env CKPTSTORE_URL)")
        if name == "ls":
            p.add_argument("run")
        p.set_defaults(func=func)

    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except Exception as exc:  # a CLI prints errors, it does not dump tracebacks
        from ckptstore_core.errors import CkptStoreError

        if isinstance(exc, CkptStoreError) or type(exc).__module__.startswith("httpx"):
            print(f"ckptstore: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
