"""User errors (config, data, checkpoint, disk) are one line naming the fix, exit code 2, found before any step."""

import base64
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import DEMO, copy_run, fast_demo_args
from test_cli import run

import mhar_lightning.checkpoint.atomic_write
import mhar_lightning.preflight
from mhar_lightning.cli import main
from mhar_lightning.data.prepare import prepare_files
from mhar_lightning.data.tokenizer import load_tokenizer

pytestmark = pytest.mark.usefixtures("default_corpus")


def last_line(err: str) -> str:
    return err.strip().splitlines()[-1]


def fit_args(root: Path, *extra: str) -> list[str]:
    return [*fast_demo_args(root, max_steps=1), *extra]


@pytest.mark.parametrize(
    "extra, line",
    [
        (["--model.residual.class_path", "nonexistent_mod.Foo"],
         "--model.residual.class_path nonexistent_mod.Foo: no class Foo in an importable module nonexistent_mod;"
         " check the spelling, and run from the folder that holds nonexistent_mod or add that folder to PYTHONPATH"),
        (["--model.residual.blocks", "0"], "blocks must be >= 1 (or None for full routing), got 0"),
        (["--data.batch_size", "0"], "data.batch_size=0 must be >= 1"),
        (["--data.path", "/nonexistent/data"],
         "data folder /nonexistent/data does not exist: pass a folder made by `mhar prepare`"),
        (["--trainer.max_steps", "-1"],
         "trainer.max_steps=-1: set --trainer.max_steps N (N >= 1); the learning-rate schedule is defined over"
         " optimizer steps"),
        (["--model.optimizer.lr", "abc"], "optimizer.lr='abc' is not a number: set --model.optimizer.lr to a number"),
        (["--data.val_samples", "-3"],
         "data.val_samples=-3 must be >= 1: set --data.val_samples N windows, or null for one pass over the validation"
         " tokens"),
        (["--model.optimizer.lr", "-0.1"],
         "optimizer.lr=-0.1 is out of range: lr, muon_lr and eps > 0, betas and muon_momentum in [0, 1), weight_decay,"
         " muon_weight_decay, routing_lr_mult and warmup_steps >= 0, min_lr_ratio in [0, 1], decay_fraction in (0, 1]"),
    ],
)  # fmt: skip
def test_a_bad_setting_is_one_line_before_anything_is_written(tmp_path: Path, capsys, extra, line) -> None:
    code, _, err = run(fit_args(tmp_path, *extra), capsys)
    assert (code, last_line(err)) == (2, f"mhar: error: {line}")
    assert "Traceback" not in err
    assert not (tmp_path / "checkpoints").exists()


def test_an_abbreviated_flag_is_refused(tmp_path: Path, capsys) -> None:
    code, _, err = run(fit_args(tmp_path, "--trainer.max_step", "3"), capsys)
    assert code == 2 and "unrecognized arguments: --trainer.max_step 3" in err


def test_a_checkpoint_folder_under_a_file_is_refused_at_start(tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("")
    code, _, err = run(fit_args(tmp_path, "--checkpoint.dirpath", str(tmp_path / "file" / "ckpts")), capsys)
    assert (code, last_line(err)) == (
        2,
        f"mhar: error: checkpoint.dirpath {tmp_path / 'file' / 'ckpts'} cannot be created: {tmp_path / 'file'} is a"
        " file; choose another checkpoint.dirpath",
    )
    assert not (tmp_path / "tensorboard").exists()


def test_too_little_disk_space_for_a_checkpoint_is_refused_at_start(tmp_path: Path, capsys, monkeypatch) -> None:
    usage = mhar_lightning.preflight.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(mhar_lightning.preflight.shutil, "disk_usage", lambda path: usage._replace(free=2**20))
    code, _, err = run(fit_args(tmp_path), capsys)
    assert code == 2
    assert last_line(err).startswith(
        f"mhar: error: checkpoint.dirpath {tmp_path / 'checkpoints'} has 1 MiB free but a checkpoint of this model"
        " takes about "
    )


def test_a_run_that_saves_no_checkpoint_needs_no_room_for_one(tmp_path: Path, capsys, monkeypatch) -> None:
    usage = mhar_lightning.preflight.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(mhar_lightning.preflight.shutil, "disk_usage", lambda path: usage._replace(free=2**20))
    args = [*fit_args(tmp_path), "--checkpoint.save_top_k", "0", "--checkpoint.save_last", "false"]
    code, _, err = run(args, capsys)
    assert code == 0, err
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_a_full_disk_while_saving_is_one_line_and_keeps_the_last_checkpoint(
    tmp_path: Path, capsys, monkeypatch, demo_run: Path
) -> None:
    copy_run(demo_run, tmp_path)  # `mhar fit`, two steps

    def save_half_then_fail(obj, f) -> None:
        f.write(b"\0" * 1000)
        raise RuntimeError("[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing file")

    monkeypatch.setattr(mhar_lightning.checkpoint.atomic_write.torch, "save", save_half_then_fail)
    code, _, err = run([*fast_demo_args(tmp_path, max_steps=4), "--ckpt_path", "last"], capsys)
    assert code == 2
    assert last_line(err).startswith(
        f"mhar: error: writing checkpoint {tmp_path / 'checkpoints' / 'last.ckpt'} failed ([enforce fail at"
    )
    assert last_line(err).endswith(
        "free there): free space or choose another --checkpoint.dirpath, then resume with --ckpt_path last"
        " (the previous checkpoint is intact)"
    )
    monkeypatch.undo()
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 2


def test_seq_len_longer_than_a_split_names_the_split(tmp_path: Path, capsys) -> None:
    text = tmp_path / "text.txt"
    text.write_text("hello world, " * 400)
    prepare_files([text], tmp_path / "data", load_tokenizer("byte"), val_fraction=0.0, progress=False)
    code, _, err = run(fit_args(tmp_path, "--data.path", str(tmp_path / "data"), "--data.seq_len", "6000"), capsys)
    assert (code, last_line(err)) == (
        2,
        f"mhar: error: the 'train' split of {tmp_path / 'data'} has 5201 tokens, fewer than seq_len + 1 = 6001:"
        " lower --data.seq_len or prepare more data",
    )


@pytest.mark.parametrize("content", ["text", "random", "truncated"])
@pytest.mark.parametrize("command", ["fit", "inspect"])
def test_a_damaged_checkpoint_is_one_line(tmp_path: Path, capsys, content: str, command: str, demo_run: Path) -> None:
    bad = tmp_path / "bad.ckpt"
    if content == "truncated":  # a real checkpoint, cut short
        bad.write_bytes((demo_run / "checkpoints" / "last.ckpt").read_bytes()[:100_000])
    else:
        bad.write_bytes(b"hello\n" if content == "text" else os.urandom(5000))
    args = fit_args(tmp_path, "--ckpt_path", str(bad)) if command == "fit" else ["inspect", str(bad)]
    code, _, err = run(args, capsys)
    assert (code, last_line(err)) == (
        2,
        f"mhar: error: checkpoint {bad} is damaged or not a checkpoint (not a complete torch.save archive): use an"
        " intact one, e.g. an earlier save",
    )


def test_validate_without_weights_and_test_without_a_test_split_are_refused(tmp_path: Path, capsys) -> None:
    args = ["--config", str(DEMO), "--trainer.default_root_dir", str(tmp_path)]
    code, _, err = run(["validate", *args], capsys)
    assert (code, last_line(err)) == (
        2,
        "mhar: error: mhar validate needs trained weights: pass --ckpt_path (a .ckpt, or last) or --model.init_from",
    )
    code, _, err = run(["test", *args], capsys)
    assert (code, last_line(err)) == (
        2,
        "mhar: error: prepared data has train and val splits only, so there is no test set: use `mhar validate`"
        " with the same arguments",
    )


def test_stale_temporaries_of_cut_short_saves_are_removed_at_start(tmp_path: Path) -> None:
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    stale, fresh = ckpts / ".last.ckpt.k1ll3d.tmp", ckpts / ".last.ckpt.wr1t1ng.tmp"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))
    main(fit_args(tmp_path))
    assert not stale.exists() and fresh.exists()  # a save still being written (another run) is left alone


def test_mhar_traceback_shows_the_traceback(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MHAR_TRACEBACK", "1")
    with pytest.raises(ValueError, match="data.batch_size=0 must be >= 1"):
        main(fit_args(tmp_path, "--data.batch_size", "0"))


def rank_file(path: Path, swap: bool = False) -> Path:
    """A 257-token BPE rank file (256 bytes + one merge); `swap` exchanges two ranks: same size, other tokenizer."""
    order = list(range(256))
    if swap:
        order[97], order[98] = order[98], order[97]
    lines = [base64.b64encode(bytes([byte])) + b" %d\n" % rank for rank, byte in enumerate(order)]
    path.write_bytes(b"".join(lines) + base64.b64encode(b"ab") + b" 256\n")
    return path


def test_another_rank_file_of_the_same_size_is_refused_for_data_and_checkpoint(tmp_path: Path, capsys) -> None:
    texts = [tmp_path / f"{i}.txt" for i in range(12)]
    for i, text in enumerate(texts):
        text.write_text(f"abba cabbage {i} " * 200)
    ranks, other = rank_file(tmp_path / "ranks.tiktoken"), rank_file(tmp_path / "other.tiktoken", swap=True)
    for name, tokenizer in (("data", ranks), ("other-data", other)):
        prepare_files(texts, tmp_path / name, load_tokenizer(str(tokenizer)), val_fraction=0.3, progress=False)
    args = [*fit_args(tmp_path, "--data.tokenizer", str(other), "--data.path", str(tmp_path / "data"))]
    code, _, err = run(args, capsys)
    prepared, requested = (load_tokenizer(str(path)).fingerprint[:12] for path in (ranks, other))
    assert code == 2 and last_line(err).startswith(f"mhar: error: {tmp_path / 'data'} was prepared with tokenizer ")
    assert f"sha256 {prepared}" in last_line(err) and f"sha256 {requested}" in last_line(err)
    assert last_line(err).endswith("request the tokenizer the folder was prepared with, or re-run `mhar prepare`"
                                   " with this one")  # fmt: skip

    main(fit_args(tmp_path, "--data.tokenizer", str(ranks), "--data.path", str(tmp_path / "data")))
    resume = ["--data.tokenizer", str(other), "--data.path", str(tmp_path / "other-data"), "--ckpt_path", "last"]
    code, _, err = run([*fast_demo_args(tmp_path, max_steps=2), *resume], capsys)
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    assert code == 2 and last_line(err).startswith(
        f"mhar: error: checkpoint {ckpt} was trained with a tokenizer of fingerprint "
    )
    assert last_line(err).endswith("(another rank file): pass the rank file it was trained with")


@pytest.mark.parametrize(
    "args, line",
    [
        (["prepare", "{tmp}/missing", "{tmp}/out"],
         "mhar prepare: error: source {tmp}/missing does not exist: pass a file or a folder of .jsonl, .md, .parquet,"
         " .py, .txt"),
        (["compare", "mhra", "--out", "{tmp}"],
         "mhar compare: error: unknown variant 'mhra': use a recipe (.yaml), one of sum, "),
    ],
)  # fmt: skip
def test_a_tool_error_is_one_line_with_exit_code_2(tmp_path: Path, capsys, args: list[str], line: str) -> None:
    code, out, err = run([arg.format(tmp=tmp_path) for arg in args], capsys)
    assert code == 2
    assert last_line(err or out).startswith(line.format(tmp=tmp_path))


@pytest.mark.parametrize(
    "extra", [["--data.num_workers", "-1"], ["--trainer.accumulate_grad_batches", "0"]], ids=["data", "trainer"]
)
def test_a_run_refused_while_it_is_set_up_prints_its_error_alone(tmp_path: Path, extra: list[str]) -> None:
    """Lightning's start-up lines (seed, devices) wait for the run to start: a refused run's stderr is one line."""
    command = [sys.executable, "-m", "mhar_lightning.cli", *fast_demo_args(tmp_path, max_steps=2), *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"mhar: error: {extra[0].removeprefix('--')}=")
    assert not (tmp_path / "checkpoints").exists()
