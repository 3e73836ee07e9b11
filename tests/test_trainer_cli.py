"""`MharCLI`'s start-up checks and step-based schedule: refusals before step 1 in one line, and validation counted in
steps across epochs on a corpus of a few batches, with an exact resume across the epoch boundary."""

import json
from pathlib import Path

import pytest
import torch
from cli_helpers import NO_PROBES, fast_demo_args, final_weights, scalars
from test_cli import run

from mhar_lightning.cli import main
from mhar_lightning.data.prepare import prepare_files
from mhar_lightning.data.shards import ShardIndex
from mhar_lightning.data.tokenizer import load_tokenizer
from mhar_lightning.trainer_cli import MharCLI

pytestmark = pytest.mark.usefixtures("default_corpus")


def prepared(root: Path, val_fraction: float) -> Path:
    """A byte-tokenized folder of 60 short documents (about 4k tokens), with a validation split when asked."""
    docs = [f"document {i}: " + "the quick brown fox " * (i % 5 + 1) for i in range(60)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    out = root / f"data-{val_fraction}"
    prepare_files([root / "docs.jsonl"], out, load_tokenizer("byte"), val_fraction=val_fraction, progress=False)
    return out


N, K = 8, 3
SMALL_EPOCH = ["--data.samples_per_epoch", "8"]  # two batches of 4 an epoch, fewer than val_check_interval (3)
STOP = ["--trainer.callbacks+=cli_helpers.StopAtStep", f"--trainer.callbacks.step={K}"]


def test_validation_every_n_steps_spans_epochs_and_resume_across_them_is_exact(tmp_path: Path) -> None:
    args = [*SMALL_EPOCH, "--data.path", str(prepared(tmp_path, 0.2))]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    main([*fast_demo_args(full, N), *args, *NO_PROBES])
    main([*fast_demo_args(resumed, N), *args, *NO_PROBES, *STOP])  # stops in the second epoch
    main([*fast_demo_args(resumed, N), *args, *NO_PROBES, "--ckpt_path", "last"])

    assert sorted(scalars(full, "val/loss")) == [2, 5]  # after steps 3 and 6, in epochs 1 and 2
    # the checkpoint of step 3 was written before the validation after it, which the resumed run repeats
    assert scalars(resumed, "val/loss", version=-1) == scalars(full, "val/loss")
    reference = scalars(full, "train/loss")
    assert scalars(resumed, "train/loss", version=-1) == {step: reference[step] for step in range(K, N)}
    want, got = final_weights(full), final_weights(resumed)
    assert all(torch.equal(got[name], want[name]) for name in want)


@pytest.mark.parametrize(
    "extra, line",
    [
        (["--model.residual", '{"class_path": "my.mod.Nope"}'],
         "--model.residual class_path my.mod.Nope: no class Nope in an importable module my.mod; check the spelling,"
         " and run from the folder that holds my or add that folder to PYTHONPATH"),
        (["--model.residual", '{"class_path": "mhar"}'],
         "--model.residual class_path mhar: a class_path names a class with its module: class_path:"
         " mhar_lightning.residual.routed.MHAR (or residual: mhar, without arguments)"),
        (["--model.residual", '{"class_path": "mhra"}'],
         "--model.residual class_path mhra: a class_path names a class with its module, e.g."
         " mhar_lightning.residual.MHAR (a strategy name goes alone: residual: mhar)"),
        (["--trainer.callbacks", '[{"class_path": "my.mod.Nope"}]'],
         "--trainer.callbacks class_path my.mod.Nope: no class Nope in an importable module my.mod; check the"
         " spelling, and run from the folder that holds my or add that folder to PYTHONPATH"),
        (["--model.model_overrides", '{"nosuch": 60}'],
         "model.model_overrides has no field 'nosuch'; valid fields: vocab_size, d_model, n_layers, n_heads,"
         " n_kv_heads, ffn_hidden, rope_theta, max_seq_len, norm_eps, tie_embeddings, init_std, head_size,"
         " rope_scaling, attention_bias, mlp_bias"),
        (["--trainer.max_step", "3"],
         "unrecognized arguments: --trainer.max_step 3; did you mean --trainer.max_steps?"),
        (["--trainer.val_check_interval", "0.5"],
         "`val_check_interval` should be an integer or a time-based duration (str 'DD:HH:MM:SS', datetime.timedelta,"
         " or dict kwargs for timedelta) when `check_val_every_n_epoch=None`."),
    ],
)  # fmt: skip
def test_a_bad_flag_is_one_line(tmp_path: Path, capsys, extra: list[str], line: str) -> None:
    code, _, err = run([*fast_demo_args(tmp_path, 1), *extra], capsys)
    assert (code, err.strip().splitlines()[-1]) == (2, f"mhar: error: {line}")
    assert "Traceback" not in err and "usage:" not in err
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize(
    "extra, line",
    [
        (["--data.batch_size", "abc"],
         "--data.batch_size 'abc': expected an integer; fix the flag, or data.batch_size in the config"),
        (["--trainer.max_steps", "1.5"],
         "--trainer.max_steps '1.5': expected an integer; fix the flag, or trainer.max_steps in the config"),
        (["--seed_everything", "abc"],
         "--seed_everything 'abc': expected true/false or an integer; fix the flag, or seed_everything in the config"),
        (["--trainer.callbacks", "[1]"],
         "--trainer.callbacks '[1]': Not a valid subclass of Callback; fix the flag, or trainer.callbacks in the"
         " config"),
        (["--data.num_workers", "-1"],
         "data.num_workers=-1 must be >= 0: set --data.num_workers 0 to load batches in the training process, or N"
         " for N worker processes"),
        (["--model.loss_chunk_tokens", "0"],
         "model.loss_chunk_tokens=0 must be >= 1: set --model.loss_chunk_tokens to a positive count (default 4096)"),
        (["--trainer.accumulate_grad_batches", "0"],
         "trainer.accumulate_grad_batches=0: set --trainer.accumulate_grad_batches N (N >= 1 batches per optimizer"
         " step)"),
        (["--model.grad_clip", "-1"],
         "model.grad_clip=-1.0 is no gradient norm: set --model.grad_clip to a positive norm (e.g. 1.0), or to 0 to"
         " turn clipping off"),
    ],
)  # fmt: skip
def test_a_value_of_the_wrong_type_or_range_is_exactly_one_line(tmp_path: Path, capsys, extra, line) -> None:
    """Not jsonargparse's usage dump, nor a traceback from the first step: one line naming the flag and the fix."""
    code, _, err = run([*fast_demo_args(tmp_path, 1), *extra], capsys)
    assert (code, err.strip()) == (2, f"mhar: error: {line}")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "text, line",
    [
        (b"trainer:\n  max_steps: 3\n   devices: [\n",
         "{recipe}:3:11: YAML syntax error, mapping values are not allowed here: fix that line"),
        (b"trainer:\n  max_steps: 3 # caf\xe9\n", "{recipe}:2: not UTF-8 text (invalid continuation byte): save the"
         " file as UTF-8"),
    ],
)  # fmt: skip
def test_a_config_that_is_not_yaml_or_not_utf8_is_one_line_naming_file_and_line(
    tmp_path: Path, capsys, text: bytes, line: str
) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(text)
    code, _, err = run([*fast_demo_args(tmp_path / "run", 1), "--config", str(recipe)], capsys)
    assert (code, err.strip()) == (2, "mhar: error: " + line.format(recipe=recipe))
    assert not (tmp_path / "run").exists()


def test_a_strategy_name_as_a_recipes_class_path_is_one_line_naming_its_class(tmp_path: Path, capsys) -> None:
    recipe = tmp_path / "named.yaml"
    recipe.write_text("model:\n  residual:\n    class_path: hyper-connections\n")
    code, _, err = run([*fast_demo_args(tmp_path, 1), "--config", str(recipe)], capsys)
    assert (code, err.strip().splitlines()[-1]) == (
        2,
        "mhar: error: class_path hyper-connections: a class_path names a class with its module: class_path:"
        " mhar_lightning.residual.hyper.HyperConnections (or residual: hyper-connections, without arguments)",
    )
    assert "Traceback" not in err


def test_a_typo_in_a_config_key_is_one_line_naming_the_closest_key(tmp_path: Path, capsys) -> None:
    (tmp_path / "typo.yaml").write_text("trainer:\n  max_step: 3\n")
    code, _, err = run([*fast_demo_args(tmp_path, 1), "--config", str(tmp_path / "typo.yaml")], capsys)
    assert (code, err.strip()) == (
        2,
        "mhar: error: Subcommand 'fit' does not accept option 'trainer.max_step'; did you mean --trainer.max_steps?",
    )


@pytest.mark.parametrize(
    "val_fraction, extra, line",
    [
        (0.2, ["--data.batch_size", "256"],
         "an epoch of {data} has {windows} training windows of seq_len + 1 tokens, fewer than one batch of"
         " data.batch_size=256: lower --data.batch_size or --data.seq_len, raise --data.samples_per_epoch, or prepare"
         " more data"),
        (0.0, [],
         "{data} has no validation split: prepare it with --val-fraction > 0, or turn validation off with"
         " --trainer.limit_val_batches 0"),
    ],
)  # fmt: skip
def test_data_that_would_train_or_validate_nothing_is_refused(
    tmp_path: Path, capsys, val_fraction: float, extra: list[str], line: str
) -> None:
    data = prepared(tmp_path, val_fraction)
    windows = ShardIndex.load(data).num_tokens("train") // 32  # data.seq_len of fast_demo_args
    code, _, err = run([*fast_demo_args(tmp_path, 1), "--data.path", str(data), *extra], capsys)
    assert (code, err.strip().splitlines()[-1]) == (2, "mhar: error: " + line.format(data=data, windows=windows))
    assert not (tmp_path / "checkpoints").exists()


def test_no_validation_split_trains_with_validation_off(tmp_path: Path) -> None:
    data = prepared(tmp_path, 0.0)
    main([*fast_demo_args(tmp_path, 1), "--data.path", str(data), "--trainer.limit_val_batches", "0", *NO_PROBES])
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


def test_on_a_gpu_fp32_matmuls_may_use_tf32(tmp_path: Path, monkeypatch) -> None:
    """The float32 matmul precision Lightning asks GPU users to choose (its tip) is chosen: `high`."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = torch.get_float32_matmul_precision()
    assert before == "highest"
    try:
        MharCLI(args=[*fast_demo_args(tmp_path, 2)[1:], "--trainer.accelerator", "cpu"], run=False)
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)
