"""Shared pieces of the CLI, recipe, resume and callback tests: fast overrides, a stop callback, event readers,
copies of a finished run and a two-process DDP launch."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "recipes" / "demo.yaml"
DDP = ["--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu"]
DDP_STEPS = 8  # steps of conftest's `ddp_demo_run`


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


PROBES = ("mhar_lightning.callbacks.DepthAttentionLogger", "mhar_lightning.callbacks.HeadDisagreementProbe")
NO_PROBES = [
    "--trainer.callbacks",
    json.dumps([c for c in yaml.safe_load((DEMO.parent / "base.yaml").read_text())["trainer"]["callbacks"]
                if c["class_path"] not in PROBES]),
]  # fmt: skip
"""The recipe's callbacks without the depth probes, whose heatmaps take seconds to draw at the end of training: for
runs whose probes no test reads (the probes' own tests, and runs that other tests read, keep them)."""


@contextlib.contextmanager
def corpus_cache(cache: Path) -> Iterator[None]:
    """`MHAR_CACHE_DIR` set to `cache` (conftest's `stdlib_cache`) inside, for fixtures wider than one test."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MHAR_CACHE_DIR", str(cache))
        yield


def copy_run(run: Path, root: Path) -> Path:
    """A copy of the finished run `run` (conftest's `demo_run`) in `root`, as if it had been trained there."""
    shutil.copytree(run, root, dirs_exist_ok=True)
    return root


class StopAtStep(L.Callback):
    """Stop training cleanly once `step` optimizer steps are done (a user interrupting a run)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class SigtermAtStep(L.Callback):
    """Send this process SIGTERM once `step` optimizer steps are done (a scheduler preempting a run)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class CrashInValidation(L.Callback):
    """Raise inside the validation that follows step `step` (a run killed mid-validation)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_validation_batch_start(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == self.step and not trainer.sanity_checking:
            raise RuntimeError(f"killed in the validation after step {self.step}")


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


LLAMA3_8B = {  # the shape keys of Meta-Llama-3-8B's config.json
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}
SMALL_LLAMA = {  # a small Llama, 300 tokens, as a CPU run might mid-train
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
}
STAND_INS = {  # recipe -> (source config.json, residual) of the conversion its header prescribes
    "fsdp/midtrain-8b.yaml": (LLAMA3_8B, {"name": "delta-mhar", "args": {"heads": 8, "block_size": 4}}),
    "midtrain/demo.yaml": (SMALL_LLAMA, {"name": "delta-mhar", "args": {"heads": 4, "block_size": 2}}),
}


def stand_in_converted(recipe: Path, out: Path) -> Path:
    """The `mhar_config.json` that converting `recipe`'s model writes, with an empty shard index instead of weights
    (enough to build on meta)."""
    from mhar_lightning.convert.checkpoint import CONFIG_FILE, FORMAT_VERSION
    from mhar_lightning.convert.hf_llama import hf_config_to_model_config
    from mhar_lightning.convert.safetensors_io import INDEX_FILE

    hf_config, residual = STAND_INS[recipe.relative_to(REPO / "recipes").as_posix()]
    model = hf_config_to_model_config(hf_config).to_dict()
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps({"format_version": FORMAT_VERSION, "model": model, "residual": residual}))
    (out / INDEX_FILE).write_text(json.dumps({"weight_map": {}}))
    return out


def mhar(args: list[object], capsys) -> tuple[int, str]:
    """Exit code and stderr of `mhar <args>` run in this process (0 when it returns normally)."""
    from mhar_lightning.cli import main

    capsys.readouterr()
    try:
        main([str(arg) for arg in args])
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    return code, capsys.readouterr().err
