"""The Hugging Face integration: a real ``Trainer`` checkpoints into a real service and resumes
from it bit-exactly (ckptstore.integrations.transformers)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from ckptstore import CheckpointClient, CheckpointNotFound, RunNotFound
from ckptstore.integrations.transformers import (
    FORMAT,
    CheckpointUploadError,
    CkptStoreCallback,
    restore_checkpoint,
    write_checkpoint_folder,
)
from support.serviceproc import Service, free_port
from support.states import assert_same_state

MAX_STEPS = 8  # 20 samples in batches of 4: 5 steps an epoch, so the resume crosses an epoch
SAVE_STEPS = 2
STOP_AT = 6  # the "crash" comes right after this step's checkpoint


class TokenDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random token sequences, made by hand (no tokenizer, nothing downloaded)."""

    def __init__(self, n: int = 20, length: int = 16) -> None:
        gen = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, 64, (n, length), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StopAt(TrainerCallback):
    """Stops training after ``step`` (its checkpoint is written first): a job that dies."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: object
    ) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


def make_trainer(out: Path, *callbacks: TrainerCallback) -> Trainer:
    """A tiny GPT-2 (dropout on: the RNG matters) and a Trainer that checkpoints every 2 steps."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=MAX_STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        save_steps=SAVE_STEPS,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=7,
        data_seed=11,
        full_determinism=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    model = GPT2LMHeadModel(config)
    return Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=list(callbacks))


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@dataclass
class Straight:
    """An uninterrupted run: its output folder, its final weights and log history."""

    out: Path
    final: dict[str, torch.Tensor]
    log_history: list[dict[str, float]]


@pytest.fixture(scope="module", autouse=True)
def _deterministic() -> Iterator[None]:
    """``full_determinism`` switches torch's global flag and sets env vars: undo both."""
    with pytest.MonkeyPatch.context() as mp:
        for name in (
            "CUDA_LAUNCH_BLOCKING",
            "CUBLAS_WORKSPACE_CONFIG",
            "FLASH_ATTENTION_DETERMINISTIC",
        ):
            mp.delenv(name, raising=False)
        before = torch.are_deterministic_algorithms_enabled()
        yield
        torch.use_deterministic_algorithms(before)


@pytest.fixture(scope="module")
def straight(service: Service, tmp_path_factory: pytest.TempPathFactory) -> Straight:
    out = tmp_path_factory.mktemp("straight")
    trainer = make_trainer(out, CkptStoreCallback(service.url, "hf-straight"))
    trainer.train()
    return Straight(out, weights(trainer), trainer.state.log_history)


def _folder_contents(folder: Path) -> dict[str, object]:
    """A Trainer folder read the way the Trainer reads it (safetensors, torch.load with its
    allow-list), independently of the integration's own reader."""
    from transformers.trainer_pt_utils import safe_globals

    with safe_globals():
        return {
            "model": safetensors.torch.load_file(folder / "model.safetensors"),
            **{
                name: torch.load(folder / name, weights_only=True)
                for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth")
            },
            "trainer_state": (folder / "trainer_state.json").read_bytes(),
            "config": (folder / "config.json").read_bytes(),
        }


def _stored_contents(state: dict[str, object]) -> dict[str, object]:
    files = state["files"]
    assert isinstance(files, dict)
    return {
        "model": files["model.safetensors"]["tensors"],
        **{
            name: files[name]["state"] for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth")
        },
        "trainer_state": files["trainer_state.json"]["data"].numpy().tobytes(),
        "config": files["config.json"]["data"].numpy().tobytes(),
    }


def test_every_checkpoint_is_stored_as_the_trainer_wrote_it(
    service: Service, straight: Straight
) -> None:
    with CheckpointClient(service.url) as client:
        steps = [info.step for info in client.list("hf-straight")]
        assert steps == list(range(SAVE_STEPS, MAX_STEPS + 1, SAVE_STEPS))
        for step in steps:
            folder = straight.out / f"checkpoint-{step}"
            state = client.load("hf-straight", step)
            assert state["step"] == step
            assert "training_args.bin" not in state["files"]  # a pickle: never stored
            assert_same_state(
                _folder_contents(folder), _stored_contents(state), path=f"step {step}"
            )
            # only the weights, for an evaluation job
            only_model = client.load("hf-straight", step, prefix="files/model.safetensors/")
            assert list(only_model["files"]) == ["model.safetensors"]


def test_restored_folder_is_the_trainers_files_byte_for_byte(
    service: Service, straight: Straight, tmp_path: Path
) -> None:
    path = restore_checkpoint(service.url, "hf-straight", 4, output_dir=tmp_path)
    assert path == str(tmp_path / "checkpoint-4")
    original = straight.out / "checkpoint-4"
    for name in (
        "model.safetensors",
        "trainer_state.json",
        "config.json",
        "generation_config.json",
    ):
        assert (Path(path) / name).read_bytes() == (original / name).read_bytes(), name
    assert_same_state(_folder_contents(original), _folder_contents(Path(path)))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        restore_checkpoint(service.url, "hf-straight", 4, output_dir=tmp_path)
    assert restore_checkpoint(service.url, "hf-straight", 4, output_dir=tmp_path, overwrite=True)


def test_resume_from_the_service_matches_an_uninterrupted_run(
    service: Service, straight: Straight, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    first = make_trainer(out, CkptStoreCallback(service.url, "hf-resumed"), StopAt(STOP_AT))
    first.train()
    assert first.state.global_step == STOP_AT
    shutil.rmtree(out)  # the job's machine is gone; only the service remains

    path = restore_checkpoint(service.url, "hf-resumed", output_dir=out)
    assert path == str(out / f"checkpoint-{STOP_AT}")
    callback = CkptStoreCallback(service.url, "hf-resumed", delete_local=True)
    second = make_trainer(out, callback)
    second.train(resume_from_checkpoint=path)

    assert second.state.global_step == MAX_STEPS
    assert_same_state(straight.final, weights(second))
    losses = [(h["step"], h["loss"]) for h in second.state.log_history if "loss" in h]
    assert losses == [(h["step"], h["loss"]) for h in straight.log_history if "loss" in h]
    assert not (out / "checkpoint-8").exists()  # delete_local, after its upload succeeded
    with CheckpointClient(service.url) as client:
        assert [i.step for i in client.list("hf-resumed")] == [2, 4, 6, 8]
        resumed, reference = (client.load(r, MAX_STEPS) for r in ("hf-resumed", "hf-straight"))
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt"):
        assert_same_state(reference["files"][name], resumed["files"][name], path=name)


def test_failed_uploads_are_raised_when_training_ends(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    callback = CkptStoreCallback(dead, "hf-nowhere", delete_local=True, retries=0)
    trainer = make_trainer(tmp_path, callback)
    trainer.args.max_steps = 2
    with pytest.raises(CheckpointUploadError, match="1 of 1 checkpoint uploads") as info:
        trainer.train()
    assert list(info.value.failures) == [2]
    assert (tmp_path / "checkpoint-2" / "model.safetensors").exists()  # kept: not stored


def test_restore_refuses_what_it_cannot_resume(service: Service, tmp_path: Path) -> None:
    assert (
        restore_checkpoint(service.url, "hf-no-such-run", output_dir=tmp_path, missing_ok=True)
        is None
    )
    with pytest.raises(RunNotFound):
        restore_checkpoint(service.url, "hf-no-such-run", output_dir=tmp_path)
    with CheckpointClient(service.url) as client:
        client.save("hf-plain", 1, {"w": torch.ones(3)})
    with pytest.raises(CheckpointNotFound):
        restore_checkpoint(service.url, "hf-plain", 5, output_dir=tmp_path)
    with pytest.raises(ValueError, match="not a Hugging Face Trainer checkpoint"):
        restore_checkpoint(service.url, "hf-plain", output_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["../escape", "/etc/escape", "a/../../escape", "a//b", ""])
def test_stored_file_names_cannot_leave_the_folder(tmp_path: Path, name: str) -> None:
    state = {
        "format": FORMAT,
        "step": 1,
        "files": {name: {"kind": "bytes", "data": torch.ones(1, dtype=torch.uint8)}},
    }
    with pytest.raises(ValueError, match="file name"):
        write_checkpoint_folder(state, tmp_path / "checkpoint-1")
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == []


def test_lossy_saves_pair_the_trainers_two_param_groups(service: Service, tmp_path: Path) -> None:
    """The Trainer builds AdamW with two groups (decay, no decay): the callback names the
    optimizer's ids from the live model and optimizer, so every weight of
    ``model.safetensors`` pairs with its moments (docs/lossy.md#which-weights-pair)."""
    trainer = make_trainer(tmp_path, CkptStoreCallback(service.url, "hf-lossy", lossy=True))
    trainer.train()
    groups = trainer.optimizer.param_groups
    assert len(groups) == 2
    n_params = sum(len(g["params"]) for g in groups)
    with CheckpointClient(service.url) as client:
        infos = client.list("hf-lossy")
    assert len(infos) == MAX_STEPS // SAVE_STEPS
    for info in infos:
        assert info.pairing is not None, info.step
        assert (info.pairing["with_moments"], info.pairing["exact"]) == (n_params, 0)
        assert "integer ids named by the caller, 2 param groups" in info.pairing["layout"]
    assert all(info.lossy is not None for info in infos[1:])
