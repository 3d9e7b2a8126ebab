"""The ``ckptstore`` command: list, measure, download, upload and delete a service's
checkpoints.

The service's own commands (``serve``, ``db``) are ``ckptstore-service``'s. Reference:
docs/cli.md. Exit status: 0 done, 1 an error (the service's, an unreachable service, a bad
file), 2 a usage error, 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch-free at import; the client is imported when a command needs it
    from ckptstore.client import CheckpointClient
    from ckptstore.transport import Transport
    from ckptstore_core.records import CheckpointInfo, RunInfo

__all__ = ["main"]

#: Retries of a command (the library's default is 5 with a 0.5 s backoff, ~15 s in all): a
#: person at a terminal learns within about 2 s that the service is down.
_RETRIES = 3
_BACKOFF = 0.25
_SAFETENSORS = (".safetensors",)
_TORCH = (".pt", ".pth")


def _transport(args: argparse.Namespace) -> Transport:
    from ckptstore.transport import Transport

    try:
        return Transport(args.url, retries=args.retries, backoff=_BACKOFF)
    except ValueError as exc:  # a URL without http(s)://: one line, not a traceback
        raise SystemExit(f"ckptstore: {exc}") from None


def _client(args: argparse.Namespace) -> CheckpointClient:
    from ckptstore.client import CheckpointClient

    return CheckpointClient(transport=_transport(args))


def _token(args: argparse.Namespace) -> int:
    """``token create|list|revoke`` through the service's ``/v1/tokens`` (an admin token)."""
    from ckptstore.tokens import create_token, list_tokens, revoke_token
    from ckptstore_core.access import token_table

    with _transport(args) as client:
        if args.action == "create":
            secret, info = create_token(client, args.name, args.scope, args.runs)
            print(secret)
            runs = f"runs {info.runs}" if info.runs else "every run"
            print(
                f"ckptstore: created token {info.name!r} (id {info.id}, scope {info.scope}, "
                f"{runs}); this is the only time it is shown",
                file=sys.stderr,
            )
        elif args.action == "list":
            tokens = list_tokens(client, revoked=args.all)
            if args.json:
                _print_json({"tokens": [t.to_json() for t in tokens]})
            else:
                print("\n".join(token_table(tokens)))
        else:
            revoked = revoke_token(client, args.token)
            print(f"revoked token {revoked.name!r} (id {revoked.id})")
    return 0


def _token_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    from ckptstore_core.access import PATTERN_RULE, SCOPES

    token = sub.add_parser(
        "token", help="bearer tokens (needs an admin token): create, list, revoke"
    )
    token.set_defaults(func=_token)
    actions = token.add_subparsers(dest="action", required=True)
    p = actions.add_parser("create", parents=[common], help="make a token; print its secret")
    p.add_argument("name", help="a label, unique among the tokens in use (ci-team-a)")
    p.add_argument("--scope", required=True, choices=SCOPES, help="read < write < admin")
    p.add_argument(
        "--runs", required=True, help=f"the runs it covers ('*': every run): {PATTERN_RULE}"
    )
    p = actions.add_parser("list", parents=[common], help="the tokens (never their secrets)")
    p.add_argument("--all", action="store_true", help="the revoked tokens too")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = actions.add_parser("revoke", parents=[common], help="revoke a token, at once")
    p.add_argument("token", help="its name or id")


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    raise AssertionError("unreachable")


def _ratio(raw: int, stored: int) -> str:
    """How many times smaller than raw the stored bytes are, as the tables print it: ``-``
    for nothing saved (an empty checkpoint, a run without any), ``inf`` for bytes that
    cost nothing (all shared with other checkpoints)."""
    if not raw:
        return "-"
    return f"{raw / stored:.2f}x" if stored else "inf"


def _width(header: str, cells: Sequence[object]) -> int:
    """A column's width: its header's or its widest cell's (a step of 12 digits, a run
    name of 40 characters)."""
    return max([len(header), *(len(str(cell)) for cell in cells)])


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


def _runs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        runs = client.runs()
    if args.json:
        _print_json({"runs": [r.to_json() for r in runs]})
        return 0
    name = max(32, _width("run", [r.name for r in runs]))
    latest = max(10, _width("latest", [r.latest_step for r in runs]))
    print(
        f"{'run':<{name}} {'ckpts':>6} {'latest':>{latest}} {'raw':>12} {'stored':>12} {'ratio':>7}"
    )
    for r in runs:
        print(
            f"{r.name:<{name}} {r.checkpoints:>6} {r.latest_step:>{latest}} "
            f"{_human(r.raw_bytes):>12} {_human(r.stored_bytes):>12} "
            f"{_ratio(r.raw_bytes, r.stored_bytes):>7}"
        )
    return 0


#: What ``ls``'s chain columns mean, printed under its table (docs/cli.md#ls).
_LS_LEGEND = """\
parent  the checkpoint its deltas were taken against; -: none in this run (its first save,
        a fork's first checkpoint, a parent since deleted, its deltas re-based)
key     K: a keyframe, which holds no deltas (it loads without any other checkpoint)
depth   the longest delta chain a load decodes, whatever the parent column says
pin     P: pinned (no delete takes it)"""


def _ls(args: argparse.Namespace) -> int:
    with _client(args) as client:
        checkpoints = client.list(args.run)
    if args.json:
        _print_json({"run": args.run, "checkpoints": [c.to_json() for c in checkpoints]})
        return 0
    steps = max(10, _width("step", [c.step for c in checkpoints]))
    # what lossy saves paired: a column only where one of them is listed
    paired = any(c.pairing is not None for c in checkpoints)
    print(
        f"{'step':>{steps}} {'parent':>{steps}} {'key':>4} {'depth':>5} {'raw':>12} "
        f"{'stored':>12} {'ratio':>9} {'pin':>4}  lossy"
        + ("  [paired: with moments / weights only / exact]" if paired else "")
    )
    for c in checkpoints:
        parent = "-" if c.parent_step is None else str(c.parent_step)
        print(
            f"{c.step:>{steps}} {parent:>{steps}} {'K' if c.keyframe else '':>4} "
            f"{c.chain_depth:>5} {_human(c.raw_bytes):>12} {_human(c.stored_bytes):>12} "
            f"{_ratio(c.raw_bytes, c.stored_bytes):>9} {'P' if c.pinned else '':>4}  "
            f"{_lossy(c.lossy)}{_pairing(c.pairing)}"
        )
    legend = sys.stdout.isatty() if args.legend is None else args.legend
    if checkpoints and legend:
        print(f"\n{_LS_LEGEND}")
    return 0


def _lossy(params: dict[str, Any] | None) -> str:
    """A checkpoint's lossy parameters as ``ls`` shows them: ``-`` for a bit-exact one."""
    if params is None:
        return "-"
    return ",".join(f"{k}={json.dumps(v)}" for k, v in params.items())


def _pairing(pairing: dict[str, Any] | None) -> str:
    """What a lossy save paired, as ``ls`` shows it after the parameters: the fp32 weights
    (and their bytes) paired with their Adam moments, paired without, and left exact;
    nothing for a checkpoint no lossy save was asked for (docs/lossy.md)."""
    if pairing is None:
        return ""
    parts = [
        f"{pairing.get(k, 0)} ({_human(int(pairing.get(f'{k}_bytes', 0)))})"
        for k in ("with_moments", "without_moments", "exact")
    ]
    return f"  [paired: {' / '.join(parts)}]"


def _pin(args: argparse.Namespace) -> int:
    """Pin (``pin``) or unpin (``unpin``) checkpoints, in order; the first error stops."""
    with _client(args) as client:
        for run, step in args.targets:
            if args.command == "pin":
                client.pin(run, step)
                print(f"pinned {run}@{step}: no delete takes it until it is unpinned")
            else:
                client.unpin(run, step)
                print(f"unpinned {run}@{step}")
    return 0


def _retention(args: argparse.Namespace) -> int:
    """Show a run's retention policy, set it (the rules given replace the whole policy) or
    clear it (``--clear``: the service's default applies)."""
    from ckptstore_core.retention import RetentionPolicy

    rules = (args.keep_last, args.keep_every, args.keep_best)
    if args.clear and (rules != (None, None, None) or args.lossy_after is not None):
        print("ckptstore: --clear takes no rules (--keep-*, --lossy-after)", file=sys.stderr)
        return 2
    with _client(args) as client:
        if args.clear:
            applied = client.clear_retention(args.run)
            print(f"retention of {args.run}: cleared (the service's default applies)")
        elif rules != (None, None, None) or args.lossy_after is not None:
            applied = client.set_retention(args.run, *rules, lossy_after=args.lossy_after)
            print(f"retention of {args.run}: {applied} (applied in the background)")
        else:
            info = client.run_info(args.run)
            applied = info.effective_retention
            own = "none of its own" if info.retention is None else str(info.retention)
            print(f"retention of {args.run}: {own}")
            if info.pinned:
                print(f"pinned: {', '.join(str(s) for s in info.pinned)}")
    print(f"applied: {applied or RetentionPolicy()}")
    return 0


def _du(args: argparse.Namespace) -> int:
    """Stored against raw bytes: per run, or per checkpoint of one run; then the total."""
    with _client(args) as client:
        records: Sequence[RunInfo | CheckpointInfo]
        if args.run:
            records = checkpoints = client.list(args.run)
            rows = [(str(c.step), c.raw_bytes, c.stored_bytes) for c in checkpoints]
            count = len(checkpoints)
        else:
            records = runs = client.runs()
            rows = [(r.name, r.raw_bytes, r.stored_bytes) for r in runs]
            count = sum(r.checkpoints for r in runs)
    raw = sum(row[1] for row in rows)
    stored = sum(row[2] for row in rows)
    if args.json:
        listed = [r.to_json() for r in records]
        total = {"checkpoints": count, "raw_bytes": raw, "stored_bytes": stored}
        if args.run:
            _print_json({"run": args.run, "checkpoints": listed, "total": total})
        else:
            _print_json({"runs": listed, "total": {"runs": len(records), **total}})
        return 0
    what = f"{count} checkpoints" if args.run else f"{len(records)} runs, {count} checkpoints"
    table = [*rows, (f"total ({what})", raw, stored)]
    label_header = "step" if args.run else "run"
    width = max(32, _width(label_header, [row[0] for row in table]))
    print(f"{label_header:<{width}} {'raw':>12} {'stored':>12} {'ratio':>7}")
    for label, row_raw, row_stored in table:
        print(
            f"{label:<{width}} {_human(row_raw):>12} {_human(row_stored):>12} "
            f"{_ratio(row_raw, row_stored):>7}"
        )
    return 0


def _pull(args: argparse.Namespace) -> int:
    """Checkpoint -> file: a safetensors file streamed as the service sends it, or a
    ``torch.save`` of the loaded state dict."""
    run, step = args.checkpoint
    path: Path = args.output
    with _client(args) as client:
        if path.suffix in _SAFETENSORS:
            from ckptstore.files import pull_file

            served = pull_file(client, run, step, path, progress=_progress(args))
        else:
            served = _pull_torch(client, run, step, path, _progress(args))
    print(f"pulled {run}@{served} to {path} ({_human(path.stat().st_size)})")
    return 0


def _pull_torch(
    client: CheckpointClient, run: str, step: int | str, path: Path, progress: bool
) -> int:
    """``torch.save`` of ``client.load`` to ``path`` (through ``FILE.tmp``); the step saved."""
    torch = _torch(f"writing {path.name} (torch.save)", "pull to FILE.safetensors")

    from ckptstore.files import temporary_path

    if step == "latest":  # resolved first, so the message names the step the file holds
        step = client.list(run)[-1].step
    state = client.load(run, step, progress=progress)
    tmp = temporary_path(path)
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return int(step)


def _push(args: argparse.Namespace) -> int:
    """File -> checkpoint: a safetensors file's bytes as the save's body, or a ``torch.load``
    (``weights_only``: no arbitrary pickles) of a ``.pt`` file saved as its state dict."""
    path: Path = args.file
    with _client(args) as client:
        state = None if path.suffix in _SAFETENSORS else _load_torch(path, args.unsafe_load)
        held = _holds(client, args.run, args.step)
        if state is None:
            from ckptstore.files import push_file

            info = push_file(client, path, args.run, args.step, progress=_progress(args))
        else:
            try:
                info = client.save(args.run, args.step, state, progress=_progress(args))
            except TypeError as exc:  # a value the format cannot hold (unsafe-loaded objects)
                raise _UserError(f"{path}: {exc}") from exc
    if args.json:
        _print_json(info.to_json())
    elif held:  # the service took it as a retry of the same save: 200, nothing written
        print(
            f"{info.run}@{info.step} already holds exactly this content ({info.tensors} "
            f"tensors, raw {_human(info.raw_bytes)}): nothing stored again"
        )
    else:
        print(
            f"pushed {path} to {info.run}@{info.step}: {info.tensors} tensors, raw "
            f"{_human(info.raw_bytes)}, stored {_human(info.stored_bytes)}"
        )
    return 0


def _holds(client: CheckpointClient, run: str, step: int) -> bool:
    """Whether ``run`` has committed ``step`` already (a push of other content is then
    refused with 409; of the same content it is a 200 that stores nothing)."""
    from ckptstore_core.errors import RunNotFound

    try:
        return any(c.step == step for c in client.list(run))
    except RunNotFound:
        return False


def _torch(doing: str, instead: str) -> Any:
    """torch, imported; else one line saying what needs it and what works without it."""
    try:
        import torch
    except ImportError:
        raise _UserError(
            f"{doing} needs torch, which is not installed here (pip install torch); "
            f"without it: {instead}"
        ) from None
    return torch


# what torch's weights_only refusal says about a class it would not build
_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")
_ESCAPES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _load_torch(path: Path, unsafe: bool) -> Any:
    """The state dict in ``path``, by ``torch.load(weights_only=True)``: tensors, containers
    and plain values only, no code run. A pickle of anything else is refused in one line
    naming the class and the ways out; ``unsafe`` (``--unsafe-load``) loads it with
    ``weights_only=False``, which runs whatever code the file holds."""
    import pickle

    torch = _torch(f"reading {path.name} (torch.load)", "push a .safetensors file")
    if unsafe:
        return torch.load(path, map_location="cpu", weights_only=False)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # what weights_only refuses: one line, not pages
        raise _UserError(_refused(path, str(exc))) from exc


def _refused(path: Path, message: str) -> str:
    """torch's weights_only refusal, for a person: the class it would not build (torch's
    message is a page with terminal escape codes) and what to do."""
    found = _GLOBAL.search(message)
    if found is None:
        lines = [line.strip() for line in _ESCAPES.sub("", message).splitlines() if line.strip()]
        detail = next(
            (ln for ln in lines if "WeightsUnpickler error" in ln), lines[0] if lines else ""
        )
        what = f"torch.load(weights_only=True) refused it ({detail})"
    else:
        what = (
            f"it holds a pickled {found.group(1)}, which torch.load(weights_only=True) "
            "will not build"
        )
    return (
        f"{path}: {what}. Push the tensors only: save them as a state dict of tensors and "
        f"plain values, or as .safetensors; or, if you trust the file, --unsafe-load (runs "
        f"the code it holds; the values must still be tensors, containers and plain values)"
    )


def _rm(args: argparse.Namespace) -> int:
    """Delete checkpoints (``RUN@STEP``) or whole runs (``RUN``, with ``--yes``), in order;
    the first error stops the command."""
    whole = [run for run, step in args.targets if step is None]
    if whole and not args.yes:
        raise _UserError(
            f"deleting every checkpoint of run {whole[0]!r}: add --yes (or name a step, "
            f"{whole[0]}@STEP)"
        )
    with _client(args) as client:
        for run, step in args.targets:
            if step is None:
                client.delete_run(run)
                print(f"deleted run {run}")
            else:
                client.delete(run, step)
                print(f"deleted {run}@{step}")
    return 0


def _fork(args: argparse.Namespace) -> int:
    """Fork ``SRC@STEP`` into the new run ``NEW`` (no bytes copied)."""
    run, step = args.source
    with _client(args) as client:
        info = client.fork(run, step, args.new_run)
    print(
        f"forked {run}@{step} into {info.run}@{info.step}: {_human(info.raw_bytes)} "
        f"loads, {_human(info.stored_bytes)} stored (its chunks refer to {run}'s)"
    )
    return 0


def _progress(args: argparse.Namespace) -> bool:
    """A bar when asked for (``--progress``, or refused with ``--no-progress``); otherwise
    when stderr is a terminal and tqdm is installed."""
    if args.progress is not None:
        return bool(args.progress)
    return sys.stderr.isatty() and importlib.util.find_spec("tqdm") is not None


class _UserError(Exception):
    """An error the command reports in one line (exit status 1)."""


def _checkpoint_ref(text: str) -> tuple[str, int | str]:
    """``RUN[@STEP]`` -> (run, step or "latest"); run names never hold ``@``."""
    run, _, step = text.partition("@")
    if not run:
        raise argparse.ArgumentTypeError(f"{text!r}: expected RUN or RUN@STEP")
    if not step or step == "latest":
        return run, "latest"
    try:
        return run, _step(step)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: STEP must be a non-negative integer or 'latest'"
        ) from None


def _delete_ref(text: str) -> tuple[str, int | None]:
    """``RUN[@STEP]`` -> (run, step, or None for the whole run); a delete names its step."""
    run, at, step = text.partition("@")
    if not run or (at and not step):
        raise argparse.ArgumentTypeError(f"{text!r}: expected RUN or RUN@STEP")
    if not at:
        return run, None
    if step == "latest":
        raise argparse.ArgumentTypeError(f"{text!r}: a delete names its step, not 'latest'")
    try:
        return run, _step(step)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r}: STEP must be a non-negative integer") from None


def _step_ref(text: str) -> tuple[str, int]:
    """``RUN@STEP`` -> (run, step): a pin names its step."""
    run, at, step = text.partition("@")
    if not run or not at:
        raise argparse.ArgumentTypeError(f"{text!r}: expected RUN@STEP")
    try:
        return run, _step(step)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r}: STEP must be a non-negative integer") from None


def _keep_best(text: str) -> Any:
    """``METRIC:min|max:N`` -> KeepBest."""
    from ckptstore_core.retention import parse_keep_best

    try:
        return parse_keep_best(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count(text: str) -> int:
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _step(text: str) -> int:
    if not text.isascii() or not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a step (a non-negative integer)")
    return int(text)


def _checkpoint_file(text: str) -> Path:
    """A file name whose extension says its format: safetensors or torch.save."""
    path = Path(text)
    if path.suffix not in (*_SAFETENSORS, *_TORCH):
        raise argparse.ArgumentTypeError(
            f"{text!r}: the file name must end in .safetensors (streamed as it is) or "
            ".pt/.pth (torch.save of the state dict)"
        )
    return path


def _connection_options(parser: argparse.ArgumentParser, *, given_only: bool) -> None:
    """``--url`` and ``--retries``, taken before the command (``ckptstore --url U runs``) and
    after it; ``given_only``: the command's copy sets them only when given, so that it does
    not reset what came before the command."""
    extra: dict[str, Any] = {"default": argparse.SUPPRESS} if given_only else {}
    parser.add_argument(
        "--url",
        help="service URL (default: $CKPTSTORE_URL, else http://127.0.0.1:8000)",
        **extra,
    )
    parser.add_argument(
        "--retries",
        type=int,
        help=f"retries when the service cannot be reached or answers 503 (default {_RETRIES})",
        **(extra or {"default": _RETRIES}),
    )


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    _connection_options(common, given_only=True)
    json_opt = argparse.ArgumentParser(add_help=False)
    json_opt.add_argument("--json", action="store_true", help="machine-readable output")
    progress = argparse.ArgumentParser(add_help=False)
    progress.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a progress bar on stderr (default: when stderr is a terminal)",
    )

    parser = argparse.ArgumentParser(
        prog="ckptstore",
        description="List, measure, download and upload the checkpoints of a ckptstore "
        "service. Every command takes --url (default: $CKPTSTORE_URL, else "
        "http://127.0.0.1:8000) and sends the token $CKPTSTORE_TOKEN if set.",
        epilog="exit status: 0 done, 1 an error (the service's, an unreachable service, a bad "
        "file), 2 a usage error, 130 interrupted. Reference: docs/cli.md",
    )
    _connection_options(parser, given_only=False)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("runs", parents=[common, json_opt], help="list runs")
    p.set_defaults(func=_runs)

    p = sub.add_parser("ls", parents=[common, json_opt], help="list a run's checkpoints")
    p.add_argument("run", metavar="RUN")
    p.add_argument(
        "--legend", action=argparse.BooleanOptionalAction, default=None,
        help="what the chain columns mean, under the table (default: when stdout is a terminal)",
    )  # fmt: skip
    p.set_defaults(func=_ls)

    p = sub.add_parser(
        "du", parents=[common, json_opt], help="stored vs raw bytes per run, or per checkpoint"
    )
    p.add_argument(
        "run", metavar="RUN", nargs="?", help="per checkpoint of this run (default: per run)"
    )
    p.set_defaults(func=_du)

    p = sub.add_parser("pull", parents=[common, progress], help="download a checkpoint to a file")
    p.add_argument(
        "checkpoint", metavar="RUN[@STEP]", type=_checkpoint_ref, help="STEP: default latest"
    )
    p.add_argument(
        "-o", "--output", metavar="FILE", required=True, type=_checkpoint_file,
        help="FILE.safetensors (the service's stream) or FILE.pt (torch.save)",
    )  # fmt: skip
    p.set_defaults(func=_pull)

    p = sub.add_parser(
        "push", parents=[common, json_opt, progress], help="upload a file as a checkpoint"
    )
    p.add_argument(
        "file", metavar="FILE", type=_checkpoint_file,
        help="FILE.safetensors (streamed as it is) or FILE.pt (torch.load(weights_only=True))",
    )  # fmt: skip
    p.add_argument("run", metavar="RUN")
    p.add_argument("step", metavar="STEP", type=_step, help="a non-negative integer")
    p.add_argument(
        "--unsafe-load", action="store_true",
        help="FILE.pt with torch.load(weights_only=False): runs any code the pickle holds; "
        "only for a file you trust (the values must still be tensors, containers, plain values)",
    )  # fmt: skip
    p.set_defaults(func=_push)

    p = sub.add_parser(
        "rm", parents=[common], help="delete checkpoints (RUN@STEP) or whole runs (RUN --yes)"
    )
    p.add_argument(
        "targets", metavar="RUN[@STEP]", nargs="+", type=_delete_ref,
        help="RUN@STEP: that checkpoint (the others keep their bytes); RUN: every checkpoint "
        "of the run (needs --yes)",
    )  # fmt: skip
    p.add_argument("-y", "--yes", action="store_true", help="allow deleting whole runs")
    p.set_defaults(func=_rm)

    p = sub.add_parser(
        "fork", parents=[common],
        help="make a new run whose first checkpoint is SRC@STEP's, without copying bytes",
    )  # fmt: skip
    p.add_argument("source", metavar="SRC@STEP", type=_step_ref, help="the checkpoint to fork")
    p.add_argument("new_run", metavar="NEW", help="the new run (must have no checkpoints)")
    p.set_defaults(func=_fork)

    for name, what in (("pin", "keep checkpoints from every delete"), ("unpin", "undo pin")):
        p = sub.add_parser(name, parents=[common], help=what)
        p.add_argument("targets", metavar="RUN@STEP", nargs="+", type=_step_ref)
        p.set_defaults(func=_pin)

    p = sub.add_parser(
        "retention",
        parents=[common],
        help="show, set or clear a run's retention policy (what is kept; the rest is deleted)",
    )
    p.add_argument("run", metavar="RUN")
    p.add_argument("--keep-last", metavar="N", type=_count, help="keep the newest N")
    p.add_argument(
        "--keep-every", metavar="K", type=_count, help="keep every step that is a multiple of K"
    )
    p.add_argument(
        "--keep-best", metavar="METRIC:min|max:N", type=_keep_best,
        help="keep the N best by a key of the checkpoints' metadata (eval_loss:min:3)",
    )  # fmt: skip
    p.add_argument(
        "--lossy-after", metavar="K", type=_count,
        help="no deletion rule: re-encode the checkpoints older than the newest K lossy, with "
        "the default parameters (docs/lossy.md#archival)",
    )  # fmt: skip
    p.add_argument(
        "--clear", action="store_true", help="clear the run's policy: the service's default applies"
    )
    p.set_defaults(func=_retention)

    _token_parser(sub, common)
    return parser


@contextlib.contextmanager
def _retries_on_stderr() -> Iterator[None]:
    """The client's retry warnings ("cannot reach ...; retrying") as ``ckptstore:`` lines on
    stderr while a command runs (the handler is removed after: ``main`` may run in-process)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("ckptstore: %(message)s"))
    handler.setLevel(logging.WARNING)
    logger = logging.getLogger("ckptstore")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        with _retries_on_stderr():
            code = int(args.func(args))
            sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
            return code
    except BrokenPipeError:  # `ckptstore ... --json | head`: the reader has had enough
        _drop_stdout()
        return 0
    except KeyboardInterrupt:
        print("ckptstore: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a CLI prints errors, it does not dump tracebacks
        from ckptstore_core.errors import CkptStoreError

        if isinstance(exc, CkptStoreError | _UserError | OSError | ImportError):
            print(f"ckptstore: {_one_line(exc)}", file=sys.stderr)
            return 1
        raise


def _drop_stdout() -> None:
    """Point stdout at /dev/null: the interpreter's flush at exit would fail on the closed
    pipe again and print "Exception ignored ... BrokenPipeError"."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _one_line(exc: Exception) -> str:
    """The error for a person: a file error names its file and says what went wrong."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror.lower()}"
    return _ESCAPES.sub("", str(exc))


if __name__ == "__main__":
    sys.exit(main())
