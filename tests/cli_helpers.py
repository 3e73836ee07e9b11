"""Shared pieces of the CLI, recipe, resume and callback tests: fast overrides, a stop callback, event readers and
a two-process DDP launch."""

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "recipes" / "demo.yaml"
DDP = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"]


def fast_demo_args(root: Path, max_steps: int) -> list[str]:
    """`mhar fit` arguments: the demo recipe shrunk to a few seconds, logging every step under `root`."""
    return [
        "fit",
        "--config", str(DEMO),
        "--trainer.default_root_dir", str(root),
        "--trainer.max_steps", str(max_steps),
        "--trainer.log_every_n_steps", "1",
        "--trainer.val_check_interval", "3",
        "--trainer.limit_val_batches", "2",
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--checkpoint.every_n_train_steps", "1",
        "--model.optimizer.warmup_steps", "2",
        "--data.seq_len", "32",
        "--data.batch_size", "4",
        "--data.val_samples", "8",
    ]  # fmt: skip


class StopAtStep(L.Callback):
    """Stop training cleanly once `step` optimizer steps are done (a user interrupting a run)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def scalars(root: Path, tag: str, version: int | None = None) -> dict[int, float]:
    """step -> value of a TensorBoard scalar, from one run `version` under `root` (index) or from all of them."""
    versions = sorted((root / "tensorboard").iterdir(), key=lambda p: int(p.name.removeprefix("version_")))
    values: dict[int, float] = {}
    for run in versions if version is None else [versions[version]]:
        events = EventAccumulator(str(run))
        events.Reload()
        if tag in events.Tags()["scalars"]:
            values.update({event.step: event.value for event in events.Scalars(tag)})
    return values


def final_weights(root: Path) -> dict[str, torch.Tensor]:
    """Model weights of `root`'s last checkpoint."""
    return torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


def env_with_tests_on_path() -> dict[str, str]:
    """Environment for a subprocess that must import `cli_helpers` (for `StopAtStep`)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))
    return env


def run_ddp(args: list[str]) -> None:
    """`python -m mhar_lightning.cli` with 2 CPU processes; Lightning launches the second rank itself."""
    done = subprocess.run(
        [sys.executable, "-m", "mhar_lightning.cli", *args, *DDP],
        check=False, env=env_with_tests_on_path(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
