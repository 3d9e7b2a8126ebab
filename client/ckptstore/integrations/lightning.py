"""PyTorch Lightning checkpoints through a ckptstore service: a ``CheckpointIO`` plugin.

::

    from ckptstore.integrations.lightning import CkptStoreCheckpointIO

    io = CkptStoreCheckpointIO("http://ckptstore:8000", "my-run")
    trainer = Trainer(plugins=[io], callbacks=[ModelCheckpoint(every_n_train_steps=500)])
    trainer.fit(model)                                           # saves to the service
    trainer.fit(model, ckpt_path="ckptstore://my-run/latest")    # resumes from it

One script that starts a run and resumes it: ``CkptStoreCheckpointIO(url, run,
missing_ok=True)`` and always ``ckpt_path=io.checkpoint_path()``; while the run has no
checkpoint, the fit starts fresh (as Hugging Face's ``restore_checkpoint(missing_ok=True)``).

Written against ``pytorch_lightning`` (the ``pytorch-lightning`` package, 2.4+; its
``CheckpointIO`` is ``lightning_fabric``'s). The unified ``lightning`` package ships its own
copy of the class under ``lightning.fabric``, which its ``Trainer`` checks for: it is not
supported by this module.

Steps
    A checkpoint is stored as step ``checkpoint["global_step"]`` of the run, whatever the path
    Lightning names it by (``.../epoch=0-step=500.ckpt``, ``.../last.ckpt``); the plugin
    remembers which path named which step, so Lightning's own paths load again in the same
    process (``trainer.test(ckpt_path="best")`` after a ``fit``); in any process
    ``ckptstore://run/step`` and ``ckptstore://run/latest`` do. Two paths often name one
    step: ModelCheckpoint saves its top-k file and then ``last.ckpt`` at the same global
    step. Saved again with the same content, the service answers ``200`` and nothing
    changes. With different content -- ModelCheckpoint records ``last_model_path`` in its
    state just before saving ``last.ckpt``, so the first such pair differs there; two hooks
    saving at one step differ in their loop counters -- the service refuses (``409``): the
    plugin keeps the first save, logs at info level that the second path names it too, and
    goes on. The model, optimizer and scheduler states are the same in both (only an
    optimizer step moves ``global_step``). A ``409`` for a step that this plugin neither
    saved nor loaded in this process means the run holds a different history (a job
    started afresh under a used run name): that raises ``CheckpointExists``.

Values
    The checkpoint is stored as ckptstore's tagged JSON and tensors (no pickle), so it holds
    what :func:`ckptstore.state.flatten` accepts, plus three kinds Lightning's
    hyper-parameters often contain: ``argparse.Namespace``, Lightning's ``AttributeDict``
    (both) and ``pathlib`` paths. Those are stored as a dict or a string, and their key paths
    and types in a table under the top-level key :data:`TYPES_KEY` (present only when there
    is such a value), which loading reads to restore them. Anything else (an ``nn.Module``
    or an enum in the hyper-parameters, say) raises ``TypeError`` naming its key path before
    anything is sent.

Lossy saves and pairing
    ``CkptStoreCheckpointIO(url, run, lossy=True)`` stores every checkpoint in the lossy tier
    (docs/lossy.md). A lossy save (or a later archival, ``lossy_after``) pairs each weight
    with its Adam moments by the names of the live module and optimizers, which a
    ``CheckpointIO`` never sees: put the plugin's :attr:`~CkptStoreCheckpointIO.callback` in
    the Trainer's callbacks too, and each save passes them (``model=``, ``optimizer=``)::

        io = CkptStoreCheckpointIO(url, "my-run", lossy=True)
        trainer = Trainer(plugins=[io], callbacks=[io.callback, ModelCheckpoint(...)])

    Without it only what the checkpoint itself proves pairs (with two param groups, about
    nothing: the listing's ``pairing`` says so), and the first lossy save logs a warning.

Deleting
    :meth:`CkptStoreCheckpointIO.remove_checkpoint` (ModelCheckpoint's ``save_top_k``) and a
    path saved again at a newer step (``last.ckpt``) release the step the path named; a step
    that no path this plugin saved names any more is deleted from the service (the service
    re-bases the checkpoints that rested on it: the others load as before). Never deleted:
    a step this plugin loaded (the one a fit resumed from), a pinned one (the service
    refuses; logged), and anything when the token may not delete (``403``: logged once, the
    checkpoints stay). A step the run holds that this plugin never saved is left alone.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import pathlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final

from ckptstore.client import CheckpointClient
from ckptstore_core.errors import CheckpointExists, CheckpointPinned, Forbidden, NotFound
from ckptstore_core.lossy import Lossy
from ckptstore_core.names import check_run_name

try:
    import pytorch_lightning as pl
    import torch
    from lightning_fabric.utilities.data import AttributeDict as FabricAttributeDict
    from pytorch_lightning.callbacks import Callback
    from pytorch_lightning.plugins.io import CheckpointIO
    from pytorch_lightning.utilities.parsing import AttributeDict
except ImportError as exc:  # pragma: no cover - the extra is installed wherever this runs
    raise ImportError(
        "ckptstore.integrations.lightning needs PyTorch Lightning: "
        "pip install 'ckptstore[lightning]'"
    ) from exc

__all__ = [
    "SCHEME",
    "TYPES_KEY",
    "CkptStoreCheckpointIO",
    "LiveObjects",
    "from_storable",
    "to_storable",
]

#: Paths of the form ``ckptstore://run/step`` (or ``/latest``) name a stored checkpoint.
SCHEME: Final = "ckptstore://"
#: The top-level key of the table of values stored in another form (see the module's doc).
TYPES_KEY: Final = "ckptstore.lightning.types"

logger = logging.getLogger(__name__)

_Key = str | int | float | bool | None
_KeyPath = tuple[_Key, ...]

# Value types stored as a dict (a Namespace: its vars()), by the name the table records.
_DICT_LIKE: Final[dict[str, type]] = {
    "namespace": argparse.Namespace,
    "AttributeDict": AttributeDict,
    "fabric.AttributeDict": FabricAttributeDict,
}
# pathlib's classes, stored as their str().
_PATHS: Final[dict[str, type[pathlib.PurePath]]] = {
    f"path.{cls.__name__}": cls
    for cls in (
        pathlib.PurePosixPath,
        pathlib.PureWindowsPath,
        pathlib.PosixPath,
        pathlib.WindowsPath,
    )
}
_KIND_OF: Final[dict[type, str]] = {
    cls: kind for kind, cls in (*_DICT_LIKE.items(), *_PATHS.items())
}


class CkptStoreCheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` that stores checkpoints as steps of ``run`` at ``url``.

    ``Trainer(plugins=[CkptStoreCheckpointIO(url, run)])``. ``url`` ``None`` means
    ``CKPTSTORE_URL`` or the client's default; ``timeout``, ``retries``, ``backoff`` and
    ``token`` are :class:`~ckptstore.CheckpointClient`'s. Composes with Lightning's
    ``AsyncCheckpointIO(CkptStoreCheckpointIO(url, run))`` (saves in a background thread).
    Safe to pickle (``ddp_spawn``): it holds configuration and the path table, and opens its
    connections on first use.

    ``missing_ok=True``: loading ``latest`` of a run that has no checkpoint yet (or does
    not exist) is no checkpoint: ``fit(ckpt_path=io.checkpoint_path())`` starts fresh
    (logged at warning level), so one script both starts and resumes a run. Opt-in, as
    Hugging Face's ``missing_ok``: a mistyped run name or URL would otherwise start from
    scratch silently. An explicit step the service does not have still raises.

    ``lossy``: ``True`` (the default parameters) or a :class:`ckptstore.Lossy` stores every
    checkpoint in the lossy tier (docs/lossy.md); with :attr:`callback` among the Trainer's
    callbacks each save names the optimizers' parameters (see the module's doc).
    """

    def __init__(
        self,
        url: str | None,
        run: str,
        *,
        timeout: float = 120.0,
        retries: int = 5,
        backoff: float = 0.5,
        token: str | None = None,
        missing_ok: bool = False,
        lossy: bool | Lossy | None = None,
    ) -> None:
        super().__init__()
        self.missing_ok = missing_ok
        self.lossy = lossy
        #: Put it in the Trainer's callbacks: it hands each save the live module and
        #: optimizers, whose names pair the weights with their moments (module doc).
        self.callback = LiveObjects()
        self._told_about_pairing = False
        self.token = token  # None: CKPTSTORE_TOKEN, read where the client is made
        self.url = url
        self.run = check_run_name(run)
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self._client: CheckpointClient | None = None
        self._lock = threading.Lock()
        self._paths: dict[str, int] = {}  # path Lightning saved to -> the step it names
        self._known: dict[int, str] = {}  # step of self.run this plugin saved or loaded -> by
        self._loaded: set[int] = set()  # steps of self.run it loaded: never deleted
        self._told_about_remove = False

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def client(self) -> CheckpointClient:
        """The client this plugin talks through (made on first use)."""
        with self._lock:
            if self._client is None:
                self._client = CheckpointClient(
                    self.url,
                    timeout=self.timeout,
                    retries=self.retries,
                    backoff=self.backoff,
                    token=self.token,
                )
            return self._client

    def checkpoint_path(self, step: int | str = "latest", run: str | None = None) -> str:
        """``ckptstore://run/step``: a ``ckpt_path`` that loads ``step`` (or ``"latest"``)
        of ``run`` (default: this plugin's run) in any process."""
        return f"{SCHEME}{check_run_name(run or self.run)}/{step}"

    # -- CheckpointIO -----------------------------------------------------------------------

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: str | os.PathLike[str],
        storage_options: Any | None = None,
    ) -> None:
        """Store ``checkpoint`` as step ``checkpoint["global_step"]`` and remember ``path``
        as its name. A step stored already with other content: see the module's doc."""
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__} takes no storage_options (got {storage_options!r})"
            )
        step = checkpoint.get("global_step")
        if type(step) is not int or step < 0:
            raise ValueError(
                f"a Lightning checkpoint's 'global_step' must be an int >= 0, got {step!r}"
            )
        name = _path_key(path)
        stored = to_storable(checkpoint)
        model, optimizers = self.callback.live()
        if model is None and self.lossy and not self._told_about_pairing:
            self._told_about_pairing = True
            logger.warning(
                "%s(lossy=%r) without its .callback in the Trainer's callbacks: the lossy "
                "saves pair only what the checkpoint itself proves (the listing's 'pairing' "
                "says what): Trainer(plugins=[io], callbacks=[io.callback, ...])",
                type(self).__name__,
                self.lossy,
            )
        try:
            self.client.save(
                self.run, step, stored, lossy=self.lossy, model=model, optimizer=optimizers
            )
        except TypeError as exc:
            raise TypeError(_unstorable(name, exc)) from exc
        except CheckpointExists as exc:
            with self._lock:
                first = self._known.get(step)
            if first is None:
                raise CheckpointExists(
                    f"step {step} of run {self.run!r} holds a different checkpoint, not saved "
                    f"or loaded by this trainer: the run has another history. Use a new run "
                    f"name, or resume from the run (ckpt_path={self.checkpoint_path()!r})"
                ) from exc
            logger.info(
                "step %d of run %r is stored already (as %s); %s names that checkpoint too "
                "(ckptstore keeps one checkpoint per step; this save differed from it in "
                "Lightning's bookkeeping only: callback paths or loop counters)",
                step,
                self.run,
                first,
                name,
            )
        with self._lock:
            before = self._paths.get(name)
            self._paths[name] = step
            self._known.setdefault(step, name)
        if before is not None and before != step:  # the file was overwritten: its old step
            self._release(before)

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """The checkpoint ``path`` names: ``ckptstore://run/step``, ``ckptstore://run/latest``
        (``ckptstore://step`` and ``ckptstore://latest``: this plugin's run), or a path this
        plugin saved to in this process. ``FileNotFoundError`` for any other path and for a
        checkpoint the service does not have -- except ``latest`` of a run with no checkpoint
        under ``missing_ok=True``: then an empty checkpoint that Lightning restores nothing
        from (:class:`_NoCheckpoint`), and the fit starts fresh.

        ``map_location``: ``None`` (the CPU), a device or a device string; Lightning moves
        the states onto the model's devices itself. ``weights_only`` is accepted and ignored:
        nothing stored is pickled, so loading runs no code whatever it is.
        """
        run, step = self._resolve(path)
        device = "cpu" if map_location is None else map_location
        if not isinstance(device, str | torch.device):
            raise TypeError(
                f"map_location must be None, a torch.device or a device string, got "
                f"{type(map_location).__qualname__}"
            )
        try:
            stored = self.client.load(run, step, map_location=device)
        except NotFound as exc:
            if step == "latest" and self.missing_ok:
                logger.warning(
                    "%s: run %r has no checkpoint yet (%s); starting fresh (missing_ok=True)",
                    self.checkpoint_path(step, run),
                    run,
                    exc.message,
                )
                return _NoCheckpoint()
            hint = "" if step != "latest" else "; to start fresh then, pass missing_ok=True"
            raise FileNotFoundError(
                f"no checkpoint {self.checkpoint_path(step, run)!r} ({exc.message}){hint}"
            ) from exc
        checkpoint = from_storable(stored)
        loaded_step = checkpoint.get("global_step")
        if run == self.run and type(loaded_step) is int:
            with self._lock:
                self._known.setdefault(loaded_step, self.checkpoint_path(loaded_step))
                self._loaded.add(loaded_step)
        return checkpoint

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Forget ``path``; delete its step from the service once no path this plugin saved
        names it (see the module's doc: what is never deleted)."""
        with self._lock:
            step = self._paths.pop(_path_key(path), None)
        if step is not None:
            self._release(step)

    def _release(self, step: int) -> None:
        """Delete ``step`` of the run unless a saved path still names it or it was loaded."""
        with self._lock:
            if step in self._loaded or step in self._paths.values():
                return
            self._known.pop(step, None)
        try:
            self.client.delete(self.run, step)
        except NotFound:
            pass  # deleted already (by retention, another process)
        except CheckpointPinned:
            logger.info("step %d of run %r is pinned: the service keeps it", step, self.run)
        except Forbidden as exc:
            if not self._told_about_remove:
                self._told_about_remove = True
                logger.warning(
                    "ckptstore keeps the checkpoints Lightning removes: this token may not "
                    "delete (%s); the run's retention policy can delete them instead",
                    exc.message,
                )

    def teardown(self) -> None:
        """Close the idle connections (the client reopens them if the plugin is used again)."""
        with self._lock:
            client = self._client
        if client is not None:
            client.close()

    # -- paths ------------------------------------------------------------------------------

    def _resolve(self, path: str | os.PathLike[str]) -> tuple[str, int | str]:
        """``(run, step)`` that ``path`` names."""
        name = _path_key(path)
        if name.startswith(SCHEME):
            from ckptstore.dcp import parse_checkpoint_id

            run, step = parse_checkpoint_id(name[len(SCHEME) :], allow_latest=True)
            return run or self.run, step
        with self._lock:
            saved = self._paths.get(name)
        if saved is None:
            raise FileNotFoundError(
                f"{name!r} names no checkpoint this plugin saved in this process; load a "
                f"stored one as {self.checkpoint_path()!r} or {self.checkpoint_path(1000)!r}"
            )
        return self.run, saved


class LiveObjects(Callback):
    """The callback of a :class:`CkptStoreCheckpointIO` (its ``callback``): before each save
    (``on_save_checkpoint``) it records the LightningModule and the Trainer's optimizers,
    whose ``state_dict``s the checkpoint holds, for the plugin's save to name. Holds them
    until the next save; not pickled (``ddp_spawn``: each process records its own)."""

    def __init__(self) -> None:
        self._model: torch.nn.Module | None = None
        self._optimizers: list[torch.optim.Optimizer] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_model": None, "_optimizers": None}

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._model, self._optimizers = pl_module, list(trainer.optimizers)

    def live(self) -> tuple[torch.nn.Module | None, list[torch.optim.Optimizer] | None]:
        """The module and optimizers recorded at the last save (None, None: none yet)."""
        return self._model, self._optimizers


class _NoCheckpoint(dict[str, Any]):
    """What ``load_checkpoint`` returns for "no checkpoint yet" (``missing_ok``): a
    checkpoint of the running Lightning's version (its migration step reads that key) that
    is false, as Lightning's ``_CheckpointConnector`` holds "nothing loaded" (``{}``): each
    of its ``restore_*`` steps then returns at once. Tested under a real ``fit``."""

    def __init__(self) -> None:
        from importlib.metadata import version

        super().__init__({"pytorch-lightning_version": version("pytorch-lightning")})

    def __bool__(self) -> bool:
        return False


def _path_key(path: str | os.PathLike[str]) -> str:
    """How a path is remembered: as given, normalised unless it is a ``ckptstore://`` one."""
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"checkpoint paths must be text, got {path!r}")
    return text if text.startswith(SCHEME) else os.path.normpath(text)


def _unstorable(path: str, exc: TypeError) -> str:
    return (
        f"cannot store the Lightning checkpoint {path!r} in ckptstore: {exc}. ckptstore "
        "stores tensors, numbers, strings, bytes, None, numpy values, torch dtypes and sizes, "
        "argparse Namespaces, AttributeDicts and pathlib paths, in dicts, lists and tuples, "
        "and never pickles: make hyper-parameters plain values (or leave one out with "
        "save_hyperparameters(ignore=[...])) and return plain values from state_dict() "
        "and on_save_checkpoint()"
    )


# -- values stored in another form ----------------------------------------------------------


def to_storable(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with its Namespaces and AttributeDicts as dicts, its paths as
    strings, and the table to undo that under :data:`TYPES_KEY` -- or ``checkpoint`` itself
    when it holds none. Containers on the way to a changed value are shallow copies; the
    rest (tensors, the model's state dict) is shared, never copied."""
    table: list[tuple[_KeyPath, str]] = []
    out = _encode_mapping(checkpoint, (), table)
    if not table:
        return checkpoint
    if TYPES_KEY in checkpoint:
        raise ValueError(f"a Lightning checkpoint may not hold the key {TYPES_KEY!r}")
    return {**out, TYPES_KEY: table}


def from_storable(stored: object) -> dict[str, Any]:
    """Undo :func:`to_storable` (in place: ``stored`` is a freshly loaded state)."""
    if type(stored) is not dict:
        raise ValueError(
            f"the stored checkpoint is a {type(stored).__qualname__}, not a Lightning "
            "checkpoint's dict"
        )
    table = stored.pop(TYPES_KEY, [])
    if type(table) is not list:
        raise ValueError(f"malformed {TYPES_KEY!r} table")
    for entry in table:  # deepest first: the order _encode recorded them in
        if type(entry) is not tuple or len(entry) != 2 or type(entry[0]) is not tuple:
            raise ValueError(f"malformed {TYPES_KEY!r} entry {entry!r}")
        key_path, kind = entry
        _replace(stored, key_path, _decoder(kind))
    return stored


def _encode(value: object, key_path: _KeyPath, table: list[tuple[_KeyPath, str]]) -> object:
    """``value`` in storable form; records each value changed (children before parents)."""
    kind = type(value)
    if kind is dict or kind is OrderedDict:
        return _encode_mapping(value, key_path, table)  # type: ignore[arg-type]
    if kind is list or kind is tuple:
        items = list(value)  # type: ignore[call-overload]
        new = [_encode(v, (*key_path, i), table) for i, v in enumerate(items)]
        if all(a is b for a, b in zip(new, items, strict=True)):
            return value
        return new if kind is list else tuple(new)
    name = _KIND_OF.get(kind)
    if name is None:
        return value  # flatten stores it, or names it in its TypeError
    if name in _PATHS:
        out: object = str(value)
    else:
        out = _encode(dict(vars(value) if kind is argparse.Namespace else value), key_path, table)  # type: ignore[call-overload]
    table.append((key_path, name))
    return out


def _encode_mapping(
    value: dict[Any, Any], key_path: _KeyPath, table: list[tuple[_KeyPath, str]]
) -> dict[Any, Any]:
    changed = {}
    for k, v in value.items():
        new = _encode(v, (*key_path, k), table)
        if new is not v:
            changed[k] = new
    if not changed:
        return value
    out = copy.copy(value)  # keeps the type, the key order and an OrderedDict's _metadata
    out.update(changed)
    return out


def _decoder(kind: object) -> Callable[[object], object]:
    if isinstance(kind, str) and kind in _DICT_LIKE:
        cls = _DICT_LIKE[kind]

        def to_dict_like(value: object) -> object:
            if type(value) is not dict:
                raise ValueError(f"a stored {kind} must be a dict, got {value!r}")
            return cls(**value) if kind == "namespace" else cls(value)

        return to_dict_like
    if isinstance(kind, str) and kind in _PATHS:
        cls_path = _PATHS[kind]

        def to_path(value: object) -> object:
            if type(value) is not str:
                raise ValueError(f"a stored {kind} must be a str, got {value!r}")
            return cls_path(value)

        return to_path
    raise ValueError(f"unknown type {kind!r} in the {TYPES_KEY!r} table")


def _replace(node: Any, key_path: _KeyPath, convert: Callable[[object], object]) -> Any:
    """``node`` with the value at ``key_path`` converted (tuples rebuilt, the rest in place)."""
    if not key_path:
        return convert(node)
    key, rest = key_path[0], key_path[1:]
    try:
        child = node[key]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"the {TYPES_KEY!r} table names a missing key {key!r}") from None
    new = _replace(child, rest, convert)
    if type(node) is tuple:
        assert type(key) is int  # node[key] worked
        return (*node[:key], new, *node[key + 1 :])
    node[key] = new
    return node
