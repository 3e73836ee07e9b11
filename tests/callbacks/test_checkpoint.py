"""FinalStepCheckpoint: a run's `max_steps` step is saved, and `last.ckpt` follows a resumed run."""

import os
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from mhar_lightning.callbacks import FinalStepCheckpoint
from torchdata.stateful_dataloader import StatefulDataLoader


class Model(BoringModel):
    """Lightning's test model with a loader that resumes mid-epoch (as the kit's data modules do)."""

    def train_dataloader(self) -> StatefulDataLoader:
        return StatefulDataLoader(RandomDataset(32, 64), batch_size=2)


def fit(
    root: Path,
    max_steps: int,
    save_last: bool | str = "link",
    resume: str | None = None,
    max_epochs: int | None = None,
    **kwargs,
) -> Model:
    L.seed_everything(0)
    model = Model()
    every = kwargs.pop("every_n_train_steps", 4)
    checkpoint = FinalStepCheckpoint(
        dirpath=root, every_n_train_steps=every, save_last=save_last, save_top_k=kwargs.pop("save_top_k", -1), **kwargs
    )
    trainer = L.Trainer(
        max_steps=max_steps,
        max_epochs=max_epochs,
        limit_val_batches=0,
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, ckpt_path=resume)
    return model


def saved(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.mark.parametrize("save_last", [True, "link"])
def test_the_last_steps_are_saved_when_max_steps_falls_between_saves(tmp_path: Path, save_last) -> None:
    model = fit(tmp_path, max_steps=6, save_last=save_last)  # saves at 4; Lightning alone stops there
    last = saved(tmp_path / "last.ckpt")
    assert last["global_step"] == 6
    assert all(torch.equal(last["state_dict"][k], v) for k, v in model.state_dict().items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]


def test_the_last_steps_are_saved_when_max_epochs_ends_between_saves(tmp_path: Path) -> None:
    model = fit(tmp_path, max_steps=-1, max_epochs=1)  # 32 steps an epoch; saves at 4, 8, .., 32 anyway
    assert saved(tmp_path / "last.ckpt")["global_step"] == 32
    fit(tmp_path / "odd", max_steps=-1, max_epochs=1, every_n_train_steps=5)  # saves at 5, .., 30; ends at 32
    last = saved(tmp_path / "odd" / "last.ckpt")
    assert last["global_step"] == 32 and last["epoch"] == 0
    assert all(torch.equal(last["state_dict"][k], v) for k, v in model.state_dict().items())


def test_a_resumed_run_keeps_last_current(tmp_path: Path) -> None:
    fit(tmp_path, max_steps=4)
    model = fit(tmp_path, max_steps=10, resume="last")  # saves at 8, stops at 10
    assert (tmp_path / "last.ckpt").resolve().name == "epoch=0-step=10.ckpt"
    assert not list(tmp_path.glob("last-v*"))
    last = saved(tmp_path / "last.ckpt")
    assert last["global_step"] == 10
    assert all(torch.equal(last["state_dict"][k], v) for k, v in model.state_dict().items())


def test_a_fresh_run_never_overwrites_an_earlier_last(tmp_path: Path) -> None:
    fit(tmp_path, max_steps=6)
    earlier = os.readlink(tmp_path / "last.ckpt")
    fit(tmp_path, max_steps=2)
    assert os.readlink(tmp_path / "last.ckpt") == earlier
    assert saved(tmp_path / "last-v1.ckpt")["global_step"] == 2


def test_resuming_the_final_step_continues_like_an_uninterrupted_run(tmp_path: Path) -> None:
    uninterrupted = fit(tmp_path / "uninterrupted", max_steps=10)
    fit(tmp_path / "run", max_steps=6)  # its final save is mid-epoch: a resume must not restart the epoch
    resumed = fit(tmp_path / "run", max_steps=10, resume="last")
    assert all(torch.equal(resumed.state_dict()[k], v) for k, v in uninterrupted.state_dict().items())
