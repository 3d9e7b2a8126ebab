"""Hugging Face ``transformers``: checkpoint a ``Trainer`` into ckptstore, and resume from it.

:class:`CkptStoreCallback` uploads every checkpoint folder the ``Trainer`` writes
(``checkpoint-<global_step>``) as one ckptstore checkpoint at step ``state.global_step``;
:func:`restore_checkpoint` writes one back as a folder that
``trainer.train(resume_from_checkpoint=...)`` resumes from::

    trainer = Trainer(..., callbacks=[CkptStoreCallback(URL, "my-run")])
    trainer.train(resume_from_checkpoint=restore_checkpoint(URL, "my-run", missing_ok=True,
                                                            output_dir=args.output_dir))

Why the files, not the live objects: the callback runs right after the ``Trainer`` wrote its
folder, and what the ``Trainer`` resumes from is that folder -- the weights as
``save_pretrained`` wrote them (tied weights once, names as the loader expects), the optimizer,
scheduler and grad-scaler states, the RNG states captured at the save point, and
``trainer_state.json`` (step, epoch, log history, the stateful callbacks). Uploading those
files' contents, and writing the same files back, makes a resume exactly the ``Trainer``'s own
resume from a local folder, whatever the ``Trainer``'s version and options put in it. The files
are read through memory maps, so reading them back costs no second copy in memory.

The stored state (``FORMAT``)::

    {"format": "hf-trainer/1", "step": <global_step>, "files": {<relative path>: <file>}}

where each file is one of

* ``{"kind": "safetensors", "header": uint8 tensor, "tensors": {name: tensor}}`` -- the
  model weights (every shard of a sharded model, adapters); the header is kept verbatim, so
  the file is rewritten byte for byte, and the tensors are ckptstore tensors: the service
  stores each as a delta against the previous checkpoint, and ``prefix="files/model.safetensors/"``
  fetches the weights alone;
* ``{"kind": "torch", "state": ...}`` -- ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``,
  ``rng_state*.pth``: read with ``torch.load(weights_only=True)`` and stored as a state
  (no pickle is stored; the restore writes them with ``torch.save``, which the ``Trainer``
  loads back to the same values);
* ``{"kind": "bytes", "data": uint8 tensor}`` -- everything else (``trainer_state.json``,
  ``config.json``, tokenizer files), byte for byte.

``training_args.bin`` is left out: it is a pickle of ``TrainingArguments`` (the resumed
``Trainer`` has its own), and ckptstore stores no pickle.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager
from pathlib import Path, PurePosixPath
from typing import Any, Final

import numpy as np
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ckptstore.client import CheckpointClient
from ckptstore.state import dtype_from_wire, tensor_bytes, tensor_from_bytes
from ckptstore_core.errors import CheckpointNotFound, RunNotFound
from ckptstore_core.lossy import Lossy
from ckptstore_core.records import CheckpointInfo

__all__ = [
    "FORMAT",
    "CheckpointUploadError",
    "CkptStoreCallback",
    "read_checkpoint_folder",
    "restore_checkpoint",
    "write_checkpoint_folder",
]

logger = logging.getLogger("ckptstore")

FORMAT: Final = "hf-trainer/1"

# transformers.trainer_utils.PREFIX_CHECKPOINT_DIR: the Trainer's folder is "checkpoint-<step>"
_FOLDER_PREFIX: Final = "checkpoint"
# A pickle of TrainingArguments: not loadable without unpickling code, not needed to resume.
_SKIPPED: Final = frozenset({"training_args.bin"})
_TORCH_SUFFIXES: Final = (".pt", ".pth", ".bin")


class CheckpointUploadError(RuntimeError):
    """Uploads of some checkpoints failed; ``failures`` maps each step to its error."""

    def __init__(self, message: str, failures: dict[int, BaseException]) -> None:
        super().__init__(message)
        self.failures = failures


# -- the folder as a state, and back -------------------------------------------------------


def _numpy_globals() -> AbstractContextManager[None]:
    """Allow the numpy objects of ``rng_state.pth`` (``np.random.get_state()``) through
    ``torch.load(weights_only=True)``: the list the ``Trainer``'s own loader allows."""
    core = np._core if hasattr(np, "_core") else np.core
    allowed: list[Any] = [core.multiarray._reconstruct, np.ndarray, np.dtype]
    allowed.append(type(np.dtype(np.uint32)))
    return torch.serialization.safe_globals(allowed)


def _files(folder: Path) -> Iterator[tuple[str, Path]]:
    """``(relative POSIX path, path)`` of every regular file under ``folder``, sorted."""
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink():
            yield path.relative_to(folder).as_posix(), path


def _read_safetensors(path: Path) -> dict[str, object]:
    """A safetensors file as its verbatim header and its tensors, the tensors viewing a
    private (copy-on-write) memory map of the file: nothing is read until used."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError(f"{path} is not a safetensors file ({size} bytes)")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    view = memoryview(mapped)
    (header_len,) = struct.unpack("<Q", view[:8])
    start = 8 + header_len
    if start > size:
        raise ValueError(f"{path} is not a safetensors file (header of {header_len} bytes)")
    header = bytes(view[8:start])
    tensors: dict[str, torch.Tensor] = {}
    end = 0
    # the data must tile the file after the header, or a rewrite would differ
    for name, spec in _by_offset(header):
        lo, hi = spec["data_offsets"]
        if lo != end or hi < lo:
            raise ValueError(f"{path}: tensor {name!r} does not follow the one before it")
        tensors[name] = tensor_from_bytes(
            view[start + lo : start + hi], spec["dtype"], spec["shape"]
        )
        end = hi
    if start + end != size:
        raise ValueError(f"{path}: {size - start - end} bytes after the last tensor")
    return {"kind": "safetensors", "header": _u8(header), "tensors": tensors}


def _by_offset(header: bytes) -> list[tuple[str, dict[str, Any]]]:
    """The tensors a safetensors header describes, ``(name, spec)`` in file order."""
    specs = json.loads(header)
    if not isinstance(specs, dict):
        raise ValueError("a safetensors header is a JSON object")
    tensors = [(k, v) for k, v in specs.items() if k != "__metadata__"]
    return sorted(tensors, key=lambda kv: tuple(kv[1]["data_offsets"]))


def _u8(data: bytes) -> torch.Tensor:
    """``data`` as a uint8 tensor (a file's bytes travel as a tensor, not in the skeleton:
    large ones stream, unchanged ones cost the service a reference)."""
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )


def _read_file(path: Path) -> dict[str, object]:
    """One file of a checkpoint folder as a state (see the module docstring)."""
    if path.name.endswith(".safetensors"):
        return _read_safetensors(path)
    if path.name.endswith(_TORCH_SUFFIXES):
        try:
            with _numpy_globals():
                obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise ValueError(
                f"{path} does not load with torch.load(weights_only=True), so it cannot be "
                f"stored without pickle: {exc}"
            ) from exc
        return {"kind": "torch", "state": obj}
    return {"kind": "bytes", "data": _u8(path.read_bytes())}


def read_checkpoint_folder(folder: str | os.PathLike[str], step: int) -> dict[str, object]:
    """The state that stands for the ``Trainer`` checkpoint folder ``folder`` at ``step``.

    ``FileNotFoundError`` when the folder does not exist; ``ValueError`` naming the file when
    a file cannot be stored without pickle (a ``.pt`` file ``torch.load(weights_only=True)``
    refuses) or is a broken safetensors file.
    """
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"no Trainer checkpoint folder at {root}")
    files = {rel: _read_file(path) for rel, path in _files(root) if rel not in _SKIPPED}
    return {"format": FORMAT, "step": step, "files": files}


def _safe_relative(rel: object) -> PurePosixPath:
    """A stored file name as a path inside the folder; ``ValueError`` for anything that
    would land outside it (absolute, ``..``, empty)."""
    if not isinstance(rel, str) or not rel:
        raise ValueError(f"bad file name {rel!r} in the checkpoint")
    path = PurePosixPath(rel)
    if path.is_absolute() or any(p in ("", ".", "..") for p in rel.split("/")):
        raise ValueError(f"file name {rel!r} in the checkpoint points outside its folder")
    return path


def _write_safetensors(entry: dict[str, Any], path: Path) -> None:
    """Rewrite a safetensors file from its verbatim header and its tensors, byte for byte."""
    header = bytes(tensor_bytes(entry["header"]))
    tensors: dict[str, torch.Tensor] = entry["tensors"]
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for name, spec in _by_offset(header):
            t = tensors[name]
            if t.dtype != dtype_from_wire(spec["dtype"]) or list(t.shape) != spec["shape"]:
                raise ValueError(f"{path.name}: tensor {name!r} does not match its header")
            f.write(tensor_bytes(t))


def _write_file(entry: object, path: Path) -> None:
    if not isinstance(entry, dict):
        raise ValueError(f"{path.name}: not a stored file")
    kind = entry.get("kind")
    if kind == "safetensors":
        _write_safetensors(entry, path)
    elif kind == "torch":
        torch.save(entry["state"], path)
    elif kind == "bytes":
        path.write_bytes(bytes(tensor_bytes(entry["data"])))
    else:
        raise ValueError(f"{path.name}: unknown stored file kind {kind!r}")


def write_checkpoint_folder(state: object, folder: str | os.PathLike[str]) -> None:
    """Write the files of a state made by :func:`read_checkpoint_folder` into ``folder``
    (created; files in it with other names are left alone). ``ValueError`` when ``state``
    is not such a state."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"not a Hugging Face Trainer checkpoint (format {found!r}, not {FORMAT!r})"
        )
    files = state["files"]
    if not isinstance(files, dict):
        raise ValueError("not a Hugging Face Trainer checkpoint (no files)")
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    for rel, entry in files.items():
        path = root.joinpath(*_safe_relative(rel).parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_file(entry, path)


# -- the callback ----------------------------------------------------------------------------


class CkptStoreCallback(TrainerCallback):
    """Upload every checkpoint the ``Trainer`` saves to the ckptstore run ``run`` at ``url``
    (``None``: ``CKPTSTORE_URL``, else ``http://127.0.0.1:8000``, as ``CheckpointClient``);
    ``token`` as ``CheckpointClient``'s (``None``: ``CKPTSTORE_TOKEN``).

    In ``on_save`` (right after the ``Trainer`` wrote ``<output_dir>/checkpoint-<step>``) the
    folder's files are read (:func:`read_checkpoint_folder`) and handed to
    ``CheckpointClient.save_async``, which returns once they are copied to host buffers; the
    upload runs in a background thread while training goes on. A save waits for the upload
    before it, so one upload is in flight at a time. ``on_train_end`` waits for the last one.

    * Errors of an upload (service down after ``retries``, a conflicting step) never stop
      training: each is logged as a warning on the ``ckptstore`` logger when it happens, and
      ``on_train_end`` raises :class:`CheckpointUploadError` naming every failed step
      (``raise_on_error=False``: logged as an error instead). A folder that cannot be read
      (missing: a hyperparameter search's ``run-<trial>`` folders are not supported; a file
      that needs pickle) raises at once in ``on_save``: it would fail at every save.
    * ``delete_local=True`` removes the local folder once its upload has succeeded (a failed
      upload keeps it). Off by default; refused with ``load_best_model_at_end``, which reads
      the best folder back at the end.
    * ``lossy``: as ``CheckpointClient.save``'s (docs/lossy.md). Every save records which
      optimizer id is which of the model's parameters (from the ``model`` and ``optimizer``
      the ``Trainer`` hands its callbacks), so the Trainer's two param groups pair with
      the weights of ``model.safetensors`` in a lossy save or a later archival.
    * Only the main process (``state.is_world_process_zero``) uploads. Made for one-process
      training: in a multi-process run other ranks' ``rng_state_<rank>.pth`` files are
      uploaded only if they are there by then; use ``ckptstore.dcp`` for sharded states.
    """

    def __init__(
        self,
        url: str | None,
        run: str,
        *,
        delete_local: bool = False,
        raise_on_error: bool = True,
        timeout: float = 120.0,
        retries: int = 5,
        token: str | None = None,
        lossy: bool | Lossy | None = None,
    ) -> None:
        self.url = url
        self.lossy = lossy
        self.run = run
        self._token = token  # None: CKPTSTORE_TOKEN, as CheckpointClient
        self.delete_local = delete_local
        self.raise_on_error = raise_on_error
        self._timeout = timeout
        self._retries = retries
        self._client: CheckpointClient | None = None
        self._uploads: list[tuple[int, Future[CheckpointInfo]]] = []

    def _get_client(self) -> CheckpointClient:
        if self._client is None:
            self._client = CheckpointClient(
                self.url, timeout=self._timeout, retries=self._retries, token=self._token
            )
        return self._client

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.delete_local and args.load_best_model_at_end:
            raise ValueError(
                "CkptStoreCallback(delete_local=True) deletes the checkpoint folders that "
                "load_best_model_at_end reads back: use one or the other"
            )
        if args.world_size > 1:
            logger.warning(
                "ckptstore: CkptStoreCallback uploads from the main process only; the other "
                "%d processes' RNG states are included only when their files are written first",
                args.world_size - 1,
            )

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not state.is_world_process_zero:
            return
        step = state.global_step
        folder = Path(args.output_dir or "") / f"{_FOLDER_PREFIX}-{step}"
        checkpoint = read_checkpoint_folder(folder, step)
        # the live model and optimizer name the optimizer's ids (docs/lossy.md): its
        # weights pair with their moments in a lossy save or a later archival
        future = self._get_client().save_async(
            self.run,
            step,
            checkpoint,
            lossy=self.lossy,
            model=kwargs.get("model"),
            optimizer=kwargs.get("optimizer"),
        )
        del checkpoint  # the staged copy is the client's; let the memory maps go
        self._uploads.append((step, future))
        if self.delete_local:
            future.add_done_callback(_delete_when_stored(folder))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.wait()

    def wait(self) -> list[CheckpointInfo]:
        """Wait for every upload started since the last wait and close the client; return
        what was stored. Raises (or logs, ``raise_on_error=False``) the failures."""
        client, self._client = self._client, None
        if client is not None:
            client.close()
        uploads, self._uploads = self._uploads, []
        url = client.url if client is not None else self.url
        stored = [f.result() for _, f in uploads if f.exception() is None]
        failures = {step: exc for step, f in uploads if (exc := f.exception()) is not None}
        if failures:
            message = (
                f"ckptstore: {len(failures)} of {len(uploads)} checkpoint uploads to run "
                f"{self.run!r} at {url} failed: "
                + "; ".join(f"step {step}: {exc}" for step, exc in failures.items())
            )
            if self.raise_on_error:
                raise CheckpointUploadError(message, failures) from next(iter(failures.values()))
            logger.error("%s", message)
        return stored


def _delete_when_stored(folder: Path) -> Callable[[Future[CheckpointInfo]], None]:
    def delete(future: Future[CheckpointInfo]) -> None:
        if future.exception() is None:
            # the Trainer may rotate the same folder away meanwhile: a missing one is fine
            shutil.rmtree(folder, ignore_errors=True)

    return delete


# -- resuming --------------------------------------------------------------------------------


def restore_checkpoint(
    url: str | None,
    run: str,
    step: int | str = "latest",
    *,
    output_dir: str | os.PathLike[str],
    missing_ok: bool = False,
    overwrite: bool = False,
    timeout: float = 120.0,
    retries: int = 5,
    token: str | None = None,
) -> str | None:
    """Write checkpoint ``step`` of ``run`` (default: the latest) as the ``Trainer`` folder
    ``<output_dir>/checkpoint-<step>`` and return its path, for
    ``trainer.train(resume_from_checkpoint=path)``.

    The folder appears whole or not at all (written beside it, then renamed). An existing
    folder of that name raises ``FileExistsError`` unless ``overwrite=True``. With
    ``missing_ok=True`` a run or step the service does not have returns ``None`` (which
    ``trainer.train`` takes as "start from scratch"); otherwise its ``RunNotFound`` or
    ``CheckpointNotFound`` is raised. ``ValueError`` when the checkpoint was not written by
    :class:`CkptStoreCallback`.
    """
    with CheckpointClient(url, timeout=timeout, retries=retries, token=token) as client:
        try:
            state = client.load(run, step)
        except (RunNotFound, CheckpointNotFound):
            if missing_ok:
                return None
            raise
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise ValueError(f"{run}/{step} is not a Hugging Face Trainer checkpoint")
    target = Path(output_dir) / f"{_FOLDER_PREFIX}-{state['step']}"
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists (pass overwrite=True to replace it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write_checkpoint_folder(state, scratch)
        if target.exists():
            shutil.rmtree(target)
        scratch.rename(target)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return str(target)
