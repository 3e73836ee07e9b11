"""Every command that loads a checkpoint verifies its content digest and refuses non-finite weights or optimizer
state: one line naming the file, exit code 2, nothing written, the file left as it was."""

import hashlib
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from cli_helpers import DEMO, NO_PROBES
from test_cli import run

from mhar_lightning.checkpoint.atomic_write import AtomicCheckpointIO
from mhar_lightning.checkpoint.digest import DIGEST_KEY

COMMANDS = ["validate", "fit", "evaluate", "generate", "inspect", "export-hf"]
CHANGED = (
    "differs from the content digest recorded when it was written (damaged on disk or in transfer, or edited), so it"
    " was not loaded: use an intact copy, e.g. an earlier save"
)


def command(name: str, ckpt: Path, data: Path, out: Path) -> list[str]:
    """`mhar <name>` reading `ckpt` and writing only under `out` (a folder that does not exist yet)."""
    if name in ("fit", "validate"):  # the settings `trained_mhar_run` was trained with
        settings = ["--config", str(DEMO), *NO_PROBES, "--trainer.default_root_dir", str(out)]
        settings += ["--data.path", str(data), "--data.seq_len", "16", "--model.residual", "mhar"]
        return [name, *settings, "--trainer.max_steps", "3", "--ckpt_path", str(ckpt)]
    if name == "evaluate":
        return [name, str(ckpt), "--data", str(data), "--out", str(out / "scores.json"), "--no-progress"]
    if name == "generate":
        return [name, str(ckpt), "--prompt", "x", "--max-new-tokens", "2"]
    if name == "inspect":
        return [name, str(ckpt), "--out", str(out / "maps.png"), "--text", str(DEMO)]
    return [name, str(ckpt), str(out)]


def refused(args: list[str], ckpt: Path, out: Path, capsys) -> str:
    """The one line `mhar args` prints on stderr, checking exit code 2, nothing written and `ckpt` unchanged."""
    before = hashlib.sha256(ckpt.read_bytes()).hexdigest()
    code, _, err = run(args, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert not out.exists(), list(out.rglob("*"))
    assert hashlib.sha256(ckpt.read_bytes()).hexdigest() == before
    return lines[0]


def flip_one_bit(path: Path) -> None:
    """Flip one bit in the middle of the largest tensor of a `torch.save` archive (its records are stored as is)."""
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", f.read(4))
        offset = info.header_offset + 30 + name_length + extra_length + info.file_size // 2
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x08]))


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.fixture
def ckpt(trained_mhar_run, tmp_path: Path) -> Path:
    """A copy of the two-step MHAR run's `last.ckpt`, written by the kit (so with its digest)."""
    return Path(shutil.copy(trained_mhar_run[0], tmp_path / "model.ckpt"))


@pytest.mark.parametrize("name", COMMANDS)
def test_a_flipped_bit_is_refused(name: str, ckpt: Path, trained_mhar_run, tmp_path: Path, capsys) -> None:
    original = load(ckpt)
    assert original[DIGEST_KEY].startswith("sha256:")
    flip_one_bit(ckpt)
    flipped = load(ckpt)["state_dict"]  # torch reads it without complaint: one weight differs (in tied tensors)
    changed = [
        int((v != flipped[k]).sum()) for k, v in original["state_dict"].items() if not torch.equal(v, flipped[k])
    ]
    assert changed and set(changed) == {1}
    out = tmp_path / "out"
    line = refused(command(name, ckpt, trained_mhar_run[1], out), ckpt, out, capsys)
    assert line.startswith("mhar") and line.endswith(f": error: checkpoint {ckpt} {CHANGED}")


@pytest.mark.parametrize(
    "name, digest", [*((name, True) for name in COMMANDS), ("generate", False)], ids=[*COMMANDS, "generate-plain"]
)
def test_nan_weights_are_refused(name: str, digest: bool, ckpt: Path, trained_mhar_run, tmp_path: Path, capsys) -> None:
    """NaN weights saved as the kit saves (a correct digest) or by plain `torch.save` (none) are refused alike."""
    state = load(ckpt)
    weight = "decoder.blocks.0.mlp.up.weight"
    state["state_dict"][weight][3, 5] = float("nan")
    if digest:
        AtomicCheckpointIO().save_checkpoint(state, ckpt)
    else:
        torch.save({k: v for k, v in state.items() if k != DIGEST_KEY}, ckpt)
    out = tmp_path / "out"
    line = refused(command(name, ckpt, trained_mhar_run[1], out), ckpt, out, capsys)
    assert line.endswith(
        f": error: checkpoint {ckpt} has non-finite weights (1 of {len(state['state_dict'])} tensors, first {weight}):"
        " training had diverged when it was saved; use an earlier checkpoint"
    )


def test_inf_in_the_optimizer_state_is_refused_to_resume_and_still_validates(
    ckpt: Path, trained_mhar_run, tmp_path: Path, capsys
) -> None:
    state = load(ckpt)
    moments = state["optimizer_states"][0]["state"][0]
    moments["exp_avg_sq"].view(-1)[0] = float("inf")
    AtomicCheckpointIO().save_checkpoint(state, ckpt)
    out = tmp_path / "out"
    line = refused(command("fit", ckpt, trained_mhar_run[1], out), ckpt, out, capsys)
    assert line == (
        f"mhar: error: checkpoint {ckpt} has non-finite optimizer state (optimizer_states.0.state.0.exp_avg_sq):"
        " resuming would apply it to every later step; use an earlier checkpoint"
    )
    code, _, err = run(command("validate", ckpt, trained_mhar_run[1], out), capsys)
    assert code == 0, err  # the weights are finite: validation does not use the optimizer state


def test_an_intact_copy_is_read(ckpt: Path, trained_mhar_run, tmp_path: Path, capsys) -> None:
    """The reference for the refusals above: the same copy, unchanged, evaluates."""
    code, _, err = run(command("evaluate", ckpt, trained_mhar_run[1], tmp_path / "out"), capsys)
    assert code == 0, err
    assert (tmp_path / "out" / "scores.json").is_file()
