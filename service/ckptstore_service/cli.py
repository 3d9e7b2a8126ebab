"""The ``ckptstore-service`` command: run the HTTP service, manage its database schema and
its bearer tokens (on the database directly, so an operator can make the first admin token).

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
    from ckptstore_service.catalog import Catalog
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
    if args.host is not None:
        settings = settings.model_copy(update={"host": args.host})
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=args.port,
        log_level=args.log_level,
        timeout_keep_alive=30,
        http=BodyPiecesProtocol,  # type: ignore[arg-type]  # typed as asyncio.Protocol only
    )
    return 0


def _open_catalog(args: argparse.Namespace) -> Catalog | None:
    """The catalog of ``--database-url`` (default: the settings'), or None after saying
    why it cannot be opened."""
    from ckptstore_service.catalog import Catalog

    settings = _settings()
    url = args.database_url or settings.resolved_database_url()
    try:
        return Catalog(url, timeout_s=settings.database_timeout_s)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return None


def _db(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from ckptstore_core.errors import CkptStoreError
    from ckptstore_service.catalog import shown_url

    catalog = _open_catalog(args)
    if catalog is None:
        return 1
    url = catalog.url
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


def _token(args: argparse.Namespace) -> int:
    """``token create|list|revoke`` on the catalog database (its schema brought up to date
    first, as ``serve`` does, unless CKPTSTORE_AUTO_MIGRATE is false)."""
    import json

    from sqlalchemy.exc import SQLAlchemyError

    from ckptstore_core.access import token_table
    from ckptstore_core.errors import CkptStoreError
    from ckptstore_service.auth import issue_token
    from ckptstore_service.catalog import shown_url

    catalog = _open_catalog(args)
    if catalog is None:
        return 1
    try:
        if catalog.sqlite_file is not None:
            catalog.sqlite_file.parent.mkdir(parents=True, exist_ok=True)
        if _settings().auto_migrate:
            catalog.upgrade()
        if args.action == "create":
            secret, info = issue_token(catalog.tokens, args.name, args.scope, args.runs)
            print(secret)
            runs = f"runs {info.runs}" if info.runs else "every run"
            print(
                f"created token {info.name!r} (id {info.id}, scope {info.scope}, {runs}); "
                "this is the only time it is shown",
                file=sys.stderr,
            )
        elif args.action == "list":
            tokens = catalog.tokens.list(revoked=args.all)
            if args.json:
                print(json.dumps({"tokens": [t.to_json() for t in tokens]}, indent=2))
            else:
                print("\n".join(token_table(tokens)))
        else:
            revoked = catalog.tokens.revoke(args.token)
            if revoked is None:
                print(
                    f"{PROG}: no token in use is named (or numbered) {args.token!r}",
                    file=sys.stderr,
                )
                return 1
            print(f"revoked token {revoked.name!r} (id {revoked.id})")
    except CkptStoreError as exc:
        print(f"{PROG}: {exc.message}", file=sys.stderr)
        return 1
    except (SQLAlchemyError, OSError) as exc:
        print(
            f"{PROG}: cannot use the database at {shown_url(catalog.url)}: {exc}", file=sys.stderr
        )
        return 1
    finally:
        catalog.close()
    return 0


def _token_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from ckptstore_core.access import PATTERN_RULE, SCOPES

    token = sub.add_parser(
        "token", help="bearer tokens: create (prints the secret once), list, revoke"
    )
    token.set_defaults(func=_token)
    actions = token.add_subparsers(dest="action", required=True)
    db_url = argparse.ArgumentParser(add_help=False)
    db_url.add_argument("--database-url", help="default: CKPTSTORE_DATABASE_URL or the SQLite file")
    create = actions.add_parser("create", parents=[db_url], help="make a token; print its secret")
    create.add_argument("name", help="a label, unique among the tokens in use (ci-team-a)")
    create.add_argument("--scope", required=True, choices=SCOPES, help="read < write < admin")
    create.add_argument(
        "--runs", required=True, help=f"the runs it covers ('*': every run): {PATTERN_RULE}"
    )
    listing = actions.add_parser("list", parents=[db_url], help="the tokens (never secrets)")
    listing.add_argument("--all", action="store_true", help="the revoked tokens too")
    listing.add_argument("--json", action="store_true")
    revoke = actions.add_parser("revoke", parents=[db_url], help="revoke a token, at once")
    revoke.add_argument("token", help="its name or id")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the HTTP service")
    serve.add_argument(
        "--host",
        help="address to listen on (default: CKPTSTORE_HOST or 127.0.0.1); tokens are "
        "required unless it is a loopback address or CKPTSTORE_AUTH says otherwise",
    )
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--data-dir", help="folder for the embedded SQLite + blobs + cache")
    serve.add_argument("--log-level", default="info")
    serve.set_defaults(func=_serve)

    db = sub.add_parser("db", help="database schema: upgrade to the newest revision, or show it")
    db.add_argument("action", choices=["upgrade", "current"])
    db.add_argument("--database-url", help="default: CKPTSTORE_DATABASE_URL or the SQLite file")
    db.set_defaults(func=_db)

    _token_parser(sub)

    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
