"""The ``ckptstore`` command: run the service, inspect runs and checkpoints."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import; the client is imported when a command needs it
    from ckptstore.client import CheckpointClient
    from ckptstore_service.settings import Settings

__all__ = ["main"]


def _settings(data_dir: str | None = None) -> Settings:
    """The service's settings from the environment; a bad value exits with one line per
    variable, naming it, instead of pydantic's traceback."""
    from pydantic import ValidationError

    from ckptstore_service.settings import Settings

    try:
        return Settings(data_dir=Path(data_dir)) if data_dir else Settings()
    except ValidationError as exc:
        lines = [
            f"  CKPTSTORE_{'_'.join(map(str, e['loc'])).upper()}={e.get('input')!r}: {e['msg']}"
            for e in exc.errors()
        ]
        raise SystemExit("ckptstore: invalid configuration\n" + "\n".join(lines)) from None


def _serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from ckptstore_service.api.protocol import BodyPiecesProtocol
        from ckptstore_service.app import create_app
    except ImportError as exc:
        print(
            f"the service needs its extra: pip install 'ckptstore[server]' ({exc})", file=sys.stderr
        )
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = _settings(args.data_dir)
    uvicorn.run(
        create_app(settings),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_keep_alive=30,
        http=BodyPiecesProtocol,
    )
    return 0


def _db(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from ckptstore.errors import CkptStoreError
    from ckptstore_service.catalog import Catalog, shown_url

    url = args.database_url or _settings().resolved_database_url()
    try:
        catalog = Catalog(url)
    except ValueError as exc:
        print(f"ckptstore: {exc}", file=sys.stderr)
        return 1
    sqlite_file = catalog.sqlite_file
    try:
        if args.action == "upgrade":
            if sqlite_file is not None:
                sqlite_file.parent.mkdir(parents=True, exist_ok=True)
            catalog.upgrade()
        elif sqlite_file is not None and not sqlite_file.exists():
            # no database yet: say so, without creating one (nor its folder)
            print("schema revision: none")
            return 0
        print(f"schema revision: {catalog.revision() or 'none'}")
    except (SQLAlchemyError, CkptStoreError, OSError) as exc:  # OSError: the SQLite folder
        print(f"ckptstore: cannot use the database at {shown_url(url)}: {exc}", file=sys.stderr)
        return 1
    finally:
        catalog.close()
    return 0


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

    serve = sub.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--data-dir", help="folder for the embedded SQLite + blobs + cache")
    serve.add_argument("--log-level", default="info")
    serve.set_defaults(func=_serve)

    db = sub.add_parser("db", help="database schema: upgrade to the newest revision, or show it")
    db.add_argument("action", choices=["upgrade", "current"])
    db.add_argument("--database-url", help="default: CKPTSTORE_DATABASE_URL or the SQLite file")
    db.set_defaults(func=_db)

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
        from ckptstore.errors import CkptStoreError

        if isinstance(exc, CkptStoreError) or type(exc).__module__.startswith("httpx"):
            print(f"ckptstore: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
