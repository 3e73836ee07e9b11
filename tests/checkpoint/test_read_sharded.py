"""A sharded checkpoint directory with a planted pickle: torch's own reader runs it, the kit's commands do not."""

import pickle
import warnings
from pathlib import Path

import pytest
import torch
from cli_helpers import DEMO
from test_cli import run
from torch.distributed.checkpoint import FileSystemReader, load, save

from mhar_lightning.checkpoint.digest import record_sharded_digest
from mhar_lightning.checkpoint.read_sharded import check_sharded_checkpoint


class Payload:
    """Unpickling this writes `marker`: code a checkpoint must never get to run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def sharded(root: Path, extra: dict | None = None, weights: dict | None = None) -> Path:
    """A one-process sharded checkpoint (torch.distributed.checkpoint) in the layout `mhar consolidate` reads."""
    out = root / "sharded"
    state = {"state_dict": weights or torch.nn.Linear(4, 3).state_dict(), **(extra or {})}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        save(state, checkpoint_id=out, no_dist=True)
    torch.save({"global_step": 1}, out / "meta.pt")
    return out


def test_a_plain_sharded_checkpoint_passes(tmp_path: Path) -> None:
    metadata = check_sharded_checkpoint(sharded(tmp_path, {"extra": {"lr": 0.1, "betas": (0.9, 0.95)}}))
    assert {"state_dict.weight", "state_dict.bias"} <= set(metadata.state_dict_metadata)


def test_a_planted_metadata_pickle_does_not_run(tmp_path: Path, capsys) -> None:
    directory, marker = sharded(tmp_path), tmp_path / "ran"
    (directory / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(Exception):
        FileSystemReader(directory).read_metadata()
    assert marker.exists(), "torch's reader runs the planted pickle (the attack this guards against)"
    marker.unlink()

    code, _, err = run(["consolidate", str(directory), str(tmp_path / "out.ckpt")], capsys)
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        f"mhar: error: {directory / '.metadata'} names builtins.exec, which checkpoint metadata never does, so it"
        " was not loaded: the directory was not written by torch.distributed.checkpoint; use a checkpoint you trust"
    )
    assert not marker.exists() and not (tmp_path / "out.ckpt").exists()


@pytest.mark.parametrize("command", ["consolidate", "fit"])
def test_a_planted_item_pickle_does_not_run(tmp_path: Path, capsys, command: str) -> None:
    marker = tmp_path / "ran"
    directory = sharded(tmp_path, {"extra": Payload(marker)})
    assert not marker.exists()
    if command == "consolidate":
        args = ["consolidate", str(directory), str(tmp_path / "out.ckpt")]
    else:
        args = [
            "fit",
            "--config",
            str(DEMO),
            "--trainer.default_root_dir",
            str(tmp_path),
            "--ckpt_path",
            str(directory),
        ]
    code, _, err = run(args, capsys)
    assert code == 2
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(
            "mhar: error: item 'extra' of the sharded checkpoint is not plain data, so it was not loaded (Weights only"
        )
    )
    assert not marker.exists()


def test_metadata_naming_a_file_outside_the_folder_is_refused(tmp_path: Path, capsys) -> None:
    """torch's reader follows `.metadata` to a file outside the folder; `mhar consolidate` reads nothing."""
    directory = sharded(tmp_path)
    (directory / "__0_0.distcp").rename(tmp_path / "outside.distcp")
    metadata = pickle.loads((directory / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../outside.distcp"
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    state = {"state_dict": {"weight": torch.empty(3, 4), "bias": torch.empty(3)}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load(state, storage_reader=FileSystemReader(directory), no_dist=True)  # the attack: read from outside

    code, _, err = run(["consolidate", str(directory), str(tmp_path / "out.ckpt")], capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        f"mhar: error: {directory / '.metadata'} names the file '../outside.distcp', outside its folder {directory},"
        " so nothing was read: use a checkpoint you trust (a sharded checkpoint keeps all its files in its folder)"
    ]
    assert not (tmp_path / "out.ckpt").exists()


@pytest.mark.parametrize("command", ["fit", "validate"])
def test_a_sharded_checkpoint_on_one_device_names_the_fix(tmp_path: Path, capsys, command: str) -> None:
    directory, root = sharded(tmp_path), tmp_path / "run"
    args = [command, "--config", str(DEMO), "--trainer.default_root_dir", str(root), "--ckpt_path", str(directory)]
    code, _, err = run(args, capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        f"mhar: error: --ckpt_path {directory} is a sharded checkpoint, which only ModelParallelStrategy reads: run"
        " with --trainer.strategy lightning.pytorch.strategies.ModelParallelStrategy on the devices that wrote it, or"
        f" merge it with `mhar consolidate {directory} OUT.ckpt` and pass OUT.ckpt"
    ]
    assert not root.exists()


def test_consolidate_refuses_nan_weights(tmp_path: Path, capsys) -> None:
    weights = torch.nn.Linear(4, 3).state_dict()
    weights["bias"][1] = float("nan")
    directory = sharded(tmp_path, weights=weights)
    code, _, err = run(["consolidate", str(directory), str(tmp_path / "out.ckpt")], capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        f"mhar: error: checkpoint {directory} has non-finite weights (1 of 2 tensors, first bias): training had"
        " diverged when it was saved; use an earlier checkpoint"
    ]
    assert not (tmp_path / "out.ckpt").exists()


@pytest.mark.parametrize("command", ["fit", "validate", "consolidate"])
def test_a_changed_shard_is_refused_before_anything_is_read(tmp_path: Path, capsys, command: str) -> None:
    directory = sharded(tmp_path)
    record_sharded_digest(directory, rank=0)  # as the run that wrote it records it
    shard = directory / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(data)
    if command == "consolidate":
        written = tmp_path / "out.ckpt"
        args = [command, str(directory), str(written)]
    else:
        written = tmp_path / "run"
        args = [
            command,
            "--config",
            str(DEMO),
            "--trainer.default_root_dir",
            str(written),
            "--ckpt_path",
            str(directory),
        ]
    code, _, err = run(args, capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        f"mhar: error: checkpoint {shard} differs from the content digest recorded when it was written (damaged on"
        " disk or in transfer, or edited), so it was not loaded: use an intact copy, e.g. an earlier save"
    ]
    assert not written.exists() and shard.read_bytes() == data
