"""The ``ckptstore-service`` command: run the HTTP service, manage its database schema.

The trainers' ``ckptstore`` command (runs, ls) lives in the client package, which never
imports the service.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckptstore_service.settings import Settings

__all__ = ["main"]

PROG = "ckptstore-service"


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
        raise SystemExit(f"{PROG}: invalid configuration\n" + "\n".join(lines)) from None


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

    from ckptstore_core.errors import CkptStoreError
    from ckptstore_service.catalog import Catalog, shown_url

    url = args.database_url or _settings().resolved_database_url()
    try:
        catalog = Catalog(url)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
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
        print(f"{PROG}: cannot use the database at {shown_url(url)}: {exc}", file=sys.stderr)
        return 1
    finally:
        catalog.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
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

    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
