"""Resuming keeps the checkpoint's model: a model argument that contradicts it is one line naming both values."""

from pathlib import Path

import pytest
import torch
from cli_helpers import DEMO, copy_run, fast_demo_args
from test_cli import run

from mhar_lightning.checkpoint.digest import DIGEST_KEY, content_digest

pytestmark = pytest.mark.usefixtures("default_corpus")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, demo_run: Path) -> Path:
    """A run directory whose `checkpoints/last.ckpt` is the demo's MHAR model after two steps."""
    return copy_run(demo_run, tmp_path_factory.mktemp("trained"))


RESUMED = (
    ": a resumed run keeps its model and optimizer, so drop the flag (another model or optimizer is a new run, e.g."
    " from converted weights with --model.init_from)"
)
OTHER_MODEL = (
    ": resume it with the settings it was trained with (the config.yaml under its run folder records them), or drop"
    " --ckpt_path to train the config's model from the start"
)


@pytest.mark.parametrize(
    "flag, value, line",
    [
        ("--model.residual", "sum", "checkpoint {ckpt} is a different model from the config's (residual SumResidual()"
         " vs MHAR(heads=4, blocks=None); the config's first)" + OTHER_MODEL),
        ("--model.model_overrides", "{d_model: 128}", "checkpoint {ckpt} is a different model from the config's"
         " (shape d_model 128 vs 64; the config's first)" + OTHER_MODEL),
        ("--model.optimizer.lr", "0.01", "--model.optimizer.lr=0.01 contradicts checkpoint {ckpt}, trained with"
         " optimizer.lr=0.003" + RESUMED),
    ],
)  # fmt: skip
@pytest.mark.parametrize("ckpt_path", ["file", "last"])
def test_a_model_flag_that_contradicts_the_checkpoint_is_refused(
    trained: Path, tmp_path: Path, capsys, flag: str, value: str, line: str, ckpt_path: str
) -> None:
    ckpt = trained / "checkpoints" / "last.ckpt"
    before = ckpt.stat().st_mtime_ns
    args = [*fast_demo_args(trained, max_steps=3), flag, value]
    code, _, err = run([*args, "--ckpt_path", str(ckpt) if ckpt_path == "file" else "last"], capsys)
    assert code == 2
    assert err.strip().splitlines()[-1] == f"mhar: error: {line.format(ckpt=ckpt)}"
    assert ckpt.stat().st_mtime_ns == before


def test_a_checkpoint_of_another_model_is_named_before_any_optimizer_setting(
    trained: Path, tmp_path: Path, capsys
) -> None:
    """The recipe's model and optimizer both differ from the checkpoint's: the model comes first, in one line."""
    raw = torch.load(trained / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    hparams = raw["hyper_parameters"]
    hparams["residual"] = {"class_path": "mhar_lightning.residual.SumResidual", "init_args": {}}
    hparams["model_config"] = {**hparams["model_config"], "d_model": 96, "n_layers": 3}
    hparams["optimizer"] = {**hparams["optimizer"], "lr": 0.01, "warmup_steps": 5}
    raw["datamodule_hyper_parameters"]["tokenizer"] = "gpt2"
    raw[DIGEST_KEY] = content_digest(raw)  # an intact checkpoint of that other model
    other = tmp_path / "other.ckpt"
    torch.save(raw, other)
    args = ["fit", "--config", str(DEMO), "--trainer.default_root_dir", str(tmp_path / "run"), "--ckpt_path", other]
    code, _, err = run([str(arg) for arg in args], capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        f"mhar: error: checkpoint {other} is a different model from the config's (residual MHAR(heads=4, blocks=None)"
        " vs SumResidual(); shape d_model 64 vs 96, n_layers 4 vs 3; vocabulary byte vs gpt2; the config's first)"
        + OTHER_MODEL
    ]


def test_runtime_flags_change_on_resume_and_the_rest_comes_from_the_checkpoint(trained: Path, capsys) -> None:
    root = trained.parent / "resumed"
    ckpt = trained / "checkpoints" / "last.ckpt"
    code, _, err = run(
        [*fast_demo_args(root, max_steps=3), "--ckpt_path", str(ckpt), "--model.skip_nonfinite", "2"], capsys
    )
    assert code == 0, err
    resumed = torch.load(root / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == 3 and resumed["hyper_parameters"]["skip_nonfinite"] == 2
    code, out, err = run(
        [
            "validate",
            "--trainer.default_root_dir",
            str(root),
            "--ckpt_path",
            str(ckpt),
            "--data.seq_len",
            "32",
            "--trainer.limit_val_batches",
            "1",
        ],
        capsys,
    )
    assert code == 0, err  # no model flags: the checkpoint's MHAR model is validated


def test_validate_with_a_contradicting_model_flag_names_the_training_value(trained: Path, capsys) -> None:
    ckpt = trained / "checkpoints" / "last.ckpt"
    args = ["validate", "--ckpt_path", str(ckpt), "--data.seq_len", "32", "--model.residual", "sum"]
    code, _, err = run([*args, "--trainer.limit_val_batches", "1"], capsys)
    assert code == 2
    expected = (
        "(residual SumResidual() vs MHAR(heads=4, blocks=None); the config's first): validate it with the settings it"
        " was trained with (the config.yaml under its run folder records them)"
    )
    assert err.strip().splitlines()[-1].endswith(expected)
