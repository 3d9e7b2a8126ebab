"""``CkptStoreCheckpointIO``: real ``Trainer.fit`` runs on the CPU saving to a real service.

What it promises: every checkpoint ModelCheckpoint saves is stored as its global step and
loads back bit for bit (hyper-parameters holding Namespaces and paths included); a fit
resumed from the service (``ckpt_path="ckptstore://run/latest"``, a fresh plugin as in a new
process) continues at the saved step and ends with the same weights and optimizer state as
a run that never stopped; two paths at one step are one checkpoint (same content: the
service's idempotent 200; different content from this trainer: the first kept, logged;
from another history: ``CheckpointExists``); values that cannot be stored fail before
anything is sent; ``remove_checkpoint`` deletes the steps no saved path names any more
(never one a fit resumed from); Lightning's ``AsyncCheckpointIO`` composes with it.
"""

from __future__ import annotations

import argparse
import copy
import logging
import pathlib
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins.io import AsyncCheckpointIO
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from ckptstore import CheckpointClient, CheckpointExists, RunNotFound
from ckptstore.integrations.lightning import (
    TYPES_KEY,
    CkptStoreCheckpointIO,
    from_storable,
    to_storable,
)
from support.serviceproc import Service
from support.states import assert_same_state

LOGGER = "ckptstore.integrations.lightning"
BATCHES_PER_EPOCH = 4


class TinyModule(pl.LightningModule):
    """An MLP under AdamW and a per-step StepLR; no dropout and no shuffling, so two runs
    from the same weights are bit-identical on the CPU."""

    def __init__(
        self,
        lr: float = 0.05,
        config: argparse.Namespace | None = None,
        data_dir: pathlib.PurePath | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.steps_trained: list[int] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        self.steps_trained.append(self.global_step)
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class RecordingIO(CkptStoreCheckpointIO):
    """The plugin, keeping a deep copy of every dict Lightning hands it, and its removals."""

    def __init__(self, url: str, run: str) -> None:
        super().__init__(url, run)
        self.saved: list[tuple[str, dict[str, Any]]] = []
        self.removed: list[str] = []

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        self.saved.append((str(path), copy.deepcopy(checkpoint)))
        super().save_checkpoint(checkpoint, path, storage_options)

    def remove_checkpoint(self, path: Any) -> None:
        self.removed.append(str(path))
        super().remove_checkpoint(path)


def hparams() -> dict[str, Any]:
    """Hyper-parameters of the kinds Lightning checkpoints carry beyond plain values."""
    inner = argparse.Namespace(depth=2, tags=["a", "b"])
    return {
        "config": argparse.Namespace(width=16, inner=inner, dims=(8, inner)),
        "data_dir": pathlib.PurePosixPath("/data/tiny"),
    }


def model(seed: int) -> TinyModule:
    torch.manual_seed(seed)
    return TinyModule(**hparams())


def data() -> DataLoader[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4 * BATCHES_PER_EPOCH, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=4)


def trainer(root: Path, max_epochs: int, plugins: list[Any], callbacks: list[Any]) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=root,
        max_epochs=max_epochs,
        plugins=plugins,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        accelerator="cpu",
        devices=1,
        deterministic=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def first_saves(saved: list[tuple[str, dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    """What the service stores: the first checkpoint Lightning saved at each step."""
    out: dict[int, dict[str, Any]] = {}
    for _, ckpt in saved:
        out.setdefault(ckpt["global_step"], ckpt)
    return out


def messages(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and text in r.getMessage()]


def test_fit_stores_every_checkpoint_bit_exactly(
    service: Service, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    io = RecordingIO(service.url, "lit-fit")
    top2 = ModelCheckpoint(
        every_n_train_steps=2, save_top_k=2, monitor="train_loss", save_last=True
    )
    trainer(tmp_path, 2, [io], [top2]).fit(model(0), data())

    stored = first_saves(io.saved)
    assert sorted(stored) == [2, 4, 6, 8]
    # save_top_k=2 removed the worse ones: the service keeps the steps a live path names,
    # the two best and last.ckpt's (step 8)
    live = {p: ckpt["global_step"] for p, ckpt in io.saved if p not in io.removed}
    live[top2.last_model_path] = 8
    kept = sorted(set(live.values()))
    assert io.removed and len(kept) < 4 and 8 in kept
    with CheckpointClient(service.url) as client:
        assert [c.step for c in client.list("lit-fit")] == kept
    for step, expected in stored.items():
        if step in kept:
            assert_same_state(expected, io.load_checkpoint(f"ckptstore://lit-fit/{step}"))
        else:
            with pytest.raises(FileNotFoundError):
                io.load_checkpoint(f"ckptstore://lit-fit/{step}")
    assert isinstance(stored[8]["hyper_parameters"]["config"], argparse.Namespace)

    # Lightning's own live paths load the checkpoint of their step, last.ckpt the newest one
    for path, step in live.items():
        assert io.load_checkpoint(path)["global_step"] == step
    assert_same_state(stored[8], io.load_checkpoint(top2.last_model_path))
    assert_same_state(stored[8], io.load_checkpoint("ckptstore://latest"))

    # last.ckpt at step 2 differed (ModelCheckpoint set last_model_path just before): kept
    # the top-k save, logged; at steps 4-8 both saves were the same and the service said 200
    aliased = messages(caplog, "names that checkpoint too")
    assert len(aliased) == 1 and "step 2 " in aliased[0] and "last.ckpt" in aliased[0]
    for path in io.removed:  # a removed path no longer loads
        with pytest.raises(FileNotFoundError):
            io.load_checkpoint(path)
    assert not (tmp_path / "checkpoints").exists()  # nothing written locally


def test_resume_from_the_service_matches_an_uninterrupted_run(
    service: Service, tmp_path: Path
) -> None:
    whole = model(0)
    whole_trainer = trainer(tmp_path / "whole", 2, [], [])
    whole_trainer.fit(whole, data())

    first = model(0)
    io = CkptStoreCheckpointIO(service.url, "lit-resume")
    trainer(tmp_path / "job", 1, [io], [ModelCheckpoint(every_n_epochs=1)]).fit(first, data())
    assert first.steps_trained == [0, 1, 2, 3]

    # a new process: a fresh plugin that saved nothing, a model with other weights
    resumed = model(1)
    io2 = CkptStoreCheckpointIO(service.url, "lit-resume")
    resumed_trainer = trainer(tmp_path / "job", 2, [io2], [ModelCheckpoint(every_n_epochs=1)])
    resumed_trainer.fit(resumed, data(), ckpt_path=io2.checkpoint_path("latest"))

    assert resumed.steps_trained == [4, 5, 6, 7]
    assert resumed_trainer.global_step == whole_trainer.global_step == 8
    assert_same_state(whole.state_dict(), resumed.state_dict())
    assert_same_state(
        whole_trainer.optimizers[0].state_dict(),
        resumed_trainer.optimizers[0].state_dict(),
        same_objects=False,
    )
    with CheckpointClient(service.url) as client:
        assert [c.step for c in client.list("lit-resume")] == [4, 8]


def test_one_script_starts_and_resumes_with_missing_ok(
    service: Service, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``fit(ckpt_path=io.checkpoint_path())`` on a run with nothing saved: without
    ``missing_ok`` a FileNotFoundError that says how to start fresh; with it the fit starts
    at step 0 (a warning says so), and the same call in the next job resumes."""
    io = CkptStoreCheckpointIO(service.url, "lit-new-run")
    with pytest.raises(FileNotFoundError, match="missing_ok=True"):
        trainer(tmp_path / "refused", 1, [io], []).fit(
            model(0), data(), ckpt_path=io.checkpoint_path()
        )
    with pytest.raises(FileNotFoundError):  # an explicit step is never "start fresh"
        CkptStoreCheckpointIO(service.url, "lit-new-run", missing_ok=True).load_checkpoint(
            "ckptstore://lit-new-run/4"
        )

    caplog.set_level(logging.WARNING, logger=LOGGER)
    for job, expected in ((1, [0, 1, 2, 3]), (2, [4, 5, 6, 7])):
        module = model(job)
        io = CkptStoreCheckpointIO(service.url, "lit-new-run", missing_ok=True)
        fit = trainer(tmp_path / "job", job, [io], [ModelCheckpoint(every_n_epochs=1)])
        fit.fit(module, data(), ckpt_path=io.checkpoint_path())
        assert module.steps_trained == expected
    assert len(messages(caplog, "starting fresh")) == 1
    with CheckpointClient(service.url) as client:
        assert [c.step for c in client.list("lit-new-run")] == [4, 8]


def small_checkpoint(step: int, last_model_path: str) -> dict[str, Any]:
    return {
        "epoch": 0,
        "global_step": step,
        "state_dict": OrderedDict(w=torch.arange(6, dtype=torch.float32)),
        "callbacks": {"ModelCheckpoint{}": {"last_model_path": last_model_path}},
    }


def test_two_paths_at_one_step_and_the_paths_that_load(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    io = CkptStoreCheckpointIO(service.url, "lit-same-step")
    saved = small_checkpoint(3, "")
    io.save_checkpoint(saved, "ckpts/epoch=0-step=3.ckpt")
    io.save_checkpoint(saved, "ckpts/last.ckpt")  # the same content: the service's 200
    assert io.client.save("lit-same-step", 3, saved).step == 3  # (said directly)
    assert not messages(caplog, "names that checkpoint too")

    io.save_checkpoint(small_checkpoint(3, "ckpts/last.ckpt"), "ckpts/last.ckpt")
    assert len(messages(caplog, "names that checkpoint too")) == 1
    assert_same_state(saved, io.load_checkpoint("ckpts/last.ckpt"))  # the first one kept
    assert [c.step for c in io.client.list("lit-same-step")] == [3]

    # another trainer, another history under the same run name
    with pytest.raises(CheckpointExists, match="another history"):
        CkptStoreCheckpointIO(service.url, "lit-same-step").save_checkpoint(
            small_checkpoint(3, "elsewhere/last.ckpt"), "elsewhere/last.ckpt"
        )

    # pickled (ddp_spawn sends the plugin to its workers): the path table goes along
    assert_same_state(saved, pickle.loads(pickle.dumps(io)).load_checkpoint("ckpts/last.ckpt"))

    with pytest.raises(FileNotFoundError, match="ckptstore://lit-same-step/latest"):
        io.load_checkpoint("ckpts/never-saved.ckpt")
    with pytest.raises(FileNotFoundError, match="lit-same-step/4"):
        io.load_checkpoint("ckptstore://4")


def test_values_that_cannot_be_stored_fail_before_sending(service: Service) -> None:
    io = CkptStoreCheckpointIO(service.url, "lit-unstorable")
    ckpt = small_checkpoint(1, "")
    ckpt["hyper_parameters"] = {"lr": 0.1, "net": nn.Linear(2, 2)}
    with pytest.raises(TypeError, match=r"hyper_parameters/net.*save_hyperparameters\(ignore"):
        io.save_checkpoint(ckpt, "x.ckpt")
    with pytest.raises(RunNotFound):
        io.client.list("lit-unstorable")

    ckpt = small_checkpoint(1, "")
    ckpt[TYPES_KEY] = []
    ckpt["hyper_parameters"] = {"ns": argparse.Namespace(a=1)}
    with pytest.raises(ValueError, match=TYPES_KEY):
        io.save_checkpoint(ckpt, "x.ckpt")


def test_stored_form_of_namespaces_and_paths() -> None:
    """Nested in tuples, lists and each other, and the state dict shared, not copied."""
    ns = argparse.Namespace(p=pathlib.PurePosixPath("a/b"), t=(1, argparse.Namespace(x=[2])))
    ckpt = small_checkpoint(1, "")
    ckpt["hyper_parameters"] = {"ns": ns, "paths": [pathlib.PureWindowsPath("C:/x")]}
    original = copy.deepcopy(ckpt)
    stored = to_storable(ckpt)
    assert stored["state_dict"] is ckpt["state_dict"]
    assert stored["hyper_parameters"]["ns"] == {"p": "a/b", "t": (1, {"x": [2]})}
    assert_same_state(original, ckpt)  # the trainer's dict is left as it was
    assert_same_state(original, from_storable(copy.deepcopy(stored)))
    plain = small_checkpoint(1, "")
    assert to_storable(plain) is plain


def test_async_checkpoint_io_composes(service: Service, tmp_path: Path) -> None:
    io = RecordingIO(service.url, "lit-async")
    every2 = ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)
    trainer(tmp_path, 1, [AsyncCheckpointIO(io)], [every2]).fit(model(0), data())
    stored = first_saves(io.saved)
    assert sorted(stored) == [2, 4]
    for step, expected in stored.items():
        assert_same_state(expected, io.load_checkpoint(f"ckptstore://lit-async/{step}"))


class TwoGroupModule(pl.LightningModule):
    """Two same-shape hidden layers under an AdamW of two param groups, the no-decay group
    (biases) first, as real scripts build it: the optimizer's ids follow the groups, and
    shapes alone cannot tell the layers apart."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 96), nn.Tanh(), nn.Linear(96, 96), nn.Tanh(), nn.Linear(96, 96)
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        x, y = batch
        return F.mse_loss(self.net(x).sum(1, keepdim=True), y)

    def configure_optimizers(self) -> Any:
        params = list(self.parameters())
        no_decay = [p for p in params if p.dim() < 2]
        decay = [p for p in params if p.dim() >= 2]
        groups = [{"params": no_decay, "weight_decay": 0.0}, {"params": decay}]
        return torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1)


@pytest.mark.parametrize("async_io", [False, True], ids=["sync", "async"])
def test_lossy_saves_pair_every_weight_through_the_callback(
    service: Service, tmp_path: Path, caplog: pytest.LogCaptureFixture, async_io: bool
) -> None:
    """With ``io.callback`` among the Trainer's callbacks each save names the optimizer's
    ids from the live module and optimizer: every weight pairs with its moments
    (docs/lossy.md#which-weights-pair). Without it only the shapes no other weight has
    pair, the rest stays exact, and the plugin says why."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    n_params, unique = 6, 1  # only the first Linear's weight has a shape of its own
    # besides the module's, the one fp32 tensor of the checkpoint: ModelCheckpoint's
    # kth_value, a scalar, stays exact (no optimizer holds it)
    scalars = 1
    mode = "async" if async_io else "sync"  # one service for both: runs of their own
    for name, with_callback in (("named", True), ("unnamed", False)):
        run = f"lit-{name}-{mode}"
        io = CkptStoreCheckpointIO(service.url, run, lossy=True)
        every2 = ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)
        plugin = AsyncCheckpointIO(io) if async_io else io
        callbacks = [io.callback, every2] if with_callback else [every2]
        torch.manual_seed(0)
        trainer(tmp_path / run, 2, [plugin], callbacks).fit(TwoGroupModule(), data())
        with CheckpointClient(service.url) as client:
            infos = client.list(run)
        assert [i.step for i in infos] == [2, 4, 6, 8]
        for info in infos:
            assert info.pairing is not None, info.step
            pairs = (info.pairing["with_moments"], info.pairing["exact"])
            if with_callback:
                assert pairs == (n_params, scalars) and info.pairing["exact_bytes"] == 4
                assert "integer ids named by the caller, 2 param groups" in info.pairing["layout"]
            else:
                assert pairs == (unique, n_params - unique + scalars)
                assert "integer ids without param_names" in info.pairing["layout"]
        # the chain's first is exact; unnamed, only a weight too small to be lossy paired
        assert all((i.lossy is not None) == with_callback for i in infos[1:])
    warned = messages(caplog, "without its .callback")
    assert len(warned) == 1 and "lossy=True" in warned[0]
    # the callback's live objects are not pickled (ddp_spawn): the plugin still is
    io = CkptStoreCheckpointIO(service.url, "lit-named", lossy=True)
    io.callback._model = nn.Linear(1, 1)
    assert pickle.loads(pickle.dumps(io)).callback.live() == (None, None)
