"""The `mhar` command end to end: artifacts of a short fit, config errors, refusals and crash-safe saving."""

import base64
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from cli_helpers import DEMO, copy_run, fast_demo_args, scalars
from lightning.pytorch.loggers import TensorBoardLogger

import mhar_lightning.checkpoint.atomic_write
from mhar_lightning.checkpoint.atomic_write import AtomicCheckpointIO
from mhar_lightning.cli import main
from mhar_lightning.run_folder import LOCK_FILE
from mhar_lightning.trainer_cli import MharCLI

pytestmark = pytest.mark.usefixtures("default_corpus")


def test_a_tool_and_the_help_start_without_loading_torch_or_lightning() -> None:
    """`mhar prepare` (and `mhar` before it dispatches) and `mhar --help` import neither: they answer at once."""
    code = (
        "import contextlib, io, sys, mhar_lightning.cli, mhar_lightning.data.prepare\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    mhar_lightning.cli.main(['--help'])\n"
        "print({'torch', 'lightning'} & set(sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "set()"


def run(args: list[str], capsys) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of `mhar <args>` (0 when it returns normally)."""
    try:
        main(args)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def checkpoint_step(root: Path) -> int:
    return torch.load(root / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]


def test_fit_writes_checkpoint_tensorboard_events_and_config(tmp_path: Path) -> None:
    cli = MharCLI(args=[*fast_demo_args(tmp_path, max_steps=3), "--checkpoint.every_n_train_steps", "2"])
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    assert isinstance(cli.trainer.logger, TensorBoardLogger)
    assert checkpoint_step(tmp_path) == 3  # saved at step 2 and at the final step 3, which is not a multiple of 2
    assert sorted(scalars(tmp_path, "train/loss")) == [0, 1, 2]
    assert list((tmp_path / "tensorboard" / "version_0").glob("events.out.tfevents.*"))
    saved = yaml.safe_load((tmp_path / "tensorboard" / "version_0" / "config.yaml").read_text())
    assert saved["model"]["residual"]["init_args"] == {"heads": 4, "blocks": None}
    assert not list((tmp_path / "checkpoints").glob(".*.tmp")), "no temporary checkpoint files are left behind"
    umask = os.umask(0o022)
    os.umask(umask)
    assert (tmp_path / "checkpoints" / "last.ckpt").stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.parametrize(
    "typo, key", [("trainer:\n  max_step: 3\n", "trainer.max_step"), ("model:\n  presett: tiny\n", "presett")]
)
def test_typo_in_config_key_fails_naming_the_key(tmp_path: Path, capsys, typo: str, key: str) -> None:
    (tmp_path / "typo.yaml").write_text(typo)
    code, _, err = run(["fit", "--config", str(DEMO), "--config", str(tmp_path / "typo.yaml")], capsys)
    assert code != 0
    assert key in err
    assert not (tmp_path / "checkpoints").exists()


def test_model_vocab_set_against_the_tokenizer_is_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / "vocab.yaml").write_text(f"model:\n  vocab_size: 100\ntrainer:\n  default_root_dir: {tmp_path}\n")
    code, _, err = run(["fit", "--config", str(DEMO), "--config", str(tmp_path / "vocab.yaml")], capsys)
    assert code == 2
    assert err.strip().splitlines()[-1].startswith("mhar: error: model.vocab_size=100 cannot be set")
    assert "--data.tokenizer" in err
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "tensorboard").exists()


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--model.residual.heads", "3", "heads=3 must divide d_model=64"),
        (
            "--model.residual",
            "mhra",
            "unknown residual strategy 'mhra'; known: attnres, delta-mhar, hyper-connections, mhar, sum",
        ),
        ("--model.preset", "2b", "unknown model preset '2b'"),
        ("--model.compile_options", '{"combo_kernel": true}', "unknown Inductor option(s) ['combo_kernel']"),
        ("--ckpt_path", "missing.ckpt", "checkpoint missing.ckpt does not exist"),
        ("--ckpt_path", str(DEMO.parent), f"{DEMO.parent} is a folder, not a checkpoint"),
        ("--model.optimizer.lrr", "1", "model.optimizer has no field 'lrr'; valid fields: name, lr, weight_decay,"),
    ],
)
def test_an_argument_that_does_not_fit_is_one_line(tmp_path: Path, capsys, flag, value, message) -> None:
    args = ["fit", "--config", str(DEMO), "--trainer.default_root_dir", str(tmp_path), flag, value]
    code, _, err = run(args, capsys)
    assert code == 2
    assert err.strip().splitlines()[-1].startswith("mhar: error: ") and message in err
    assert "Traceback" not in err
    assert not (tmp_path / "checkpoints").exists()


def test_resuming_with_another_tokenizer_is_refused_before_training(tmp_path: Path, capsys, demo_run: Path) -> None:
    copy_run(demo_run, tmp_path)  # `mhar fit`, two steps
    before = (tmp_path / "checkpoints" / "last.ckpt").stat().st_mtime_ns
    ranks = tmp_path / "tiny.tiktoken"  # a 257-token BPE (256 bytes + one merge): model vocab 320, not 256
    ranks.write_bytes(
        b"".join(base64.b64encode(bytes([i])) + b" %d\n" % i for i in range(256)) + base64.b64encode(b"ab") + b" 256\n"
    )
    code, _, err = run(
        [*fast_demo_args(tmp_path, max_steps=4), "--data.tokenizer", str(ranks), "--ckpt_path", "last"], capsys
    )
    assert code == 2
    assert "has a 256-token vocabulary" in err and "set --data.tokenizer byte" in err
    assert (tmp_path / "checkpoints" / "last.ckpt").stat().st_mtime_ns == before
    assert checkpoint_step(tmp_path) == 2


def test_print_config_is_a_complete_reusable_config(tmp_path: Path, capsys) -> None:
    code, printed, _ = run(["fit", "--config", str(DEMO), "--print_config"], capsys)
    assert code == 0
    config = yaml.safe_load(printed)
    assert config["data"]["tokenizer"] == "byte" and config["checkpoint"]["save_last"] is True
    assert config["trainer"]["use_distributed_sampler"] is False
    (tmp_path / "printed.yaml").write_text(printed)
    args = fast_demo_args(tmp_path / "run", max_steps=1)
    args[args.index(str(DEMO))] = str(tmp_path / "printed.yaml")
    main(args)
    assert checkpoint_step(tmp_path / "run") == 1
    hparams = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)["hyper_parameters"]
    assert hparams["vocab_size"] == 256 and hparams["residual"]["init_args"] == {"heads": 4, "blocks": None}


def test_help_lists_trainer_subcommands_and_tools(capsys) -> None:
    code, out, _ = run(["--help"], capsys)
    assert code == 0
    for name in ("fit", "validate", "test", "prepare", "compare", "inspect", "convert-hf", "export-hf", "consolidate"):
        assert f"    {name} " in out, name
    code, out, _ = run(["prepare", "--help"], capsys)
    assert code == 0 and "mhar prepare" in out
    code, out, err = run([], capsys)
    assert code == 2 and "    fit " in err
    assert err.strip().endswith("name a subcommand, e.g. `mhar fit --config recipes/demo.yaml`")


def test_crash_while_saving_keeps_the_last_good_checkpoint(tmp_path: Path, monkeypatch, capsys, demo_run) -> None:
    copy_run(demo_run, tmp_path)  # `mhar fit`, two steps
    real_save = torch.save

    def save_half_then_crash(obj, f) -> None:
        real_save(obj, f)
        f.seek(f.tell() // 2)
        f.truncate()
        raise OSError("disk full")

    monkeypatch.setattr(mhar_lightning.checkpoint.atomic_write.torch, "save", save_half_then_crash)
    code, _, err = run([*fast_demo_args(tmp_path, max_steps=4), "--ckpt_path", "last"], capsys)
    assert code == 2 and "failed (disk full;" in err
    monkeypatch.undo()
    assert checkpoint_step(tmp_path) == 2
    assert not [name for name in os.listdir(tmp_path / "checkpoints") if name.endswith(".tmp")]


def test_compiled_autograd_under_fsdp2_is_one_line(tmp_path: Path, capsys) -> None:
    args = ["fit", "--config", str(DEMO), "--trainer.default_root_dir", str(tmp_path), "--model.compiled_autograd"]
    fsdp2 = ["--trainer.strategy", '{"class_path": "lightning.pytorch.strategies.ModelParallelStrategy"}']
    code, _, err = run([*args, "true", *fsdp2, "--trainer.devices", "2", "--trainer.accelerator", "cpu"], capsys)
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        "mhar: error: compiled_autograd=true is refused: it runs in one process or under DDP, not under ModelParallel"
    )
    assert not (tmp_path / "checkpoints").exists()


def test_a_run_stopped_by_sigterm_exits_143_after_its_last_checkpoint(tmp_path: Path, capsys) -> None:
    """A job scheduler's SIGTERM: the run stops after its step, keeps its checkpoints and exits 128 + 15, not 0. While
    it runs, it holds its checkpoint folder: a second run into it is refused, naming the first."""
    import signal

    args = [*fast_demo_args(tmp_path, max_steps=200), "--trainer.enable_progress_bar", "true"]  # a plain line a step
    cmd = [sys.executable, "-m", "mhar_lightning.cli", *args]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert any(line.startswith("step 3/200") for line in process.stdout), "the run ended before step 3"
    code, _, err = run(fast_demo_args(tmp_path, max_steps=200), capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"checkpoint folder {tmp_path / 'checkpoints'} is in use by another mhar fit (pid {process.pid} on" in err
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, output[-4000:]
    last = output.strip().splitlines()[-1]
    said = re.fullmatch(r"mhar: stopped by SIGTERM at step (\d+); checkpoint (\S+); resume with --ckpt_path last", last)
    assert said, last
    assert 3 <= checkpoint_step(tmp_path) == int(said[1]) < 200  # saved on SIGTERM, at the step it stopped
    assert Path(said[2]) == tmp_path / "checkpoints" / "last.ckpt"
    assert not (tmp_path / "checkpoints" / LOCK_FILE).exists()


def test_help_says_that_test_is_refused(capsys) -> None:
    code, out, _ = run(["--help"], capsys)
    line = next(line for line in out.splitlines() if line.startswith("    test "))
    assert code == 0 and "Refused: prepared data has train and val splits only" in line
