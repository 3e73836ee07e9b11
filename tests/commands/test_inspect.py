"""`mhar inspect`: a checkpoint's maps as a PNG plus a terminal table, on a text file or the run's data."""

from pathlib import Path

import lightning
import matplotlib.image
import pytest
import torch

from mhar_lightning.commands.inspect import main
from mhar_lightning.module import LanguageModel
from mhar_lightning.probe import DepthMaps


@pytest.fixture(scope="module")
def checkpoint(small_demo_run: Path) -> Path:
    return small_demo_run / "checkpoints" / "last.ckpt"  # the demo model after 3 steps on forty stdlib files


def test_inspect_a_text_file(tmp_path, checkpoint, capsys):
    text = tmp_path / "probe.txt"
    text.write_text("def depth(attention):\n    return residual + routing\n" * 20)
    out, npz = tmp_path / "maps" / "maps.png", tmp_path / "maps.npz"
    assert main([str(checkpoint), "--out", str(out), "--text", str(text), "--rows", "2", "--npz", str(npz)]) == 0
    picture = matplotlib.image.imread(out)
    assert picture.ndim == 3 and picture.shape[0] > 400 and picture.shape[1] > 800  # mean + 4 heads in a grid
    printed = capsys.readouterr().out
    assert "probe 2 x 32 tokens" in printed and "probe.txt" in printed
    for label in ("attn 0", "mlp 3", "final", "top source"):
        assert label in printed
    maps = DepthMaps.load(npz)
    assert maps.heads == 4 and maps.site_labels[-1] == "final"


def test_inspect_the_runs_validation_data(tmp_path, checkpoint, capsys):
    assert main([str(checkpoint), "--out", str(tmp_path / "maps.png"), "--rows", "3"]) == 0
    assert "probe 3 x 32 tokens of validation data of" in " ".join(capsys.readouterr().out.split())


def test_inspect_refuses_a_model_without_routing(tmp_path, capsys):
    model = LanguageModel(residual="sum")
    model.configure_model()
    path = tmp_path / "sum.ckpt"
    torch.save(
        {
            "state_dict": model.state_dict(),
            "hyper_parameters": dict(model.hparams),
            "pytorch-lightning_version": lightning.__version__,
        },
        path,
    )
    assert main([str(path), "--out", str(tmp_path / "maps.png")]) == 2
    assert "no depth routing" in capsys.readouterr().err
    assert not (tmp_path / "maps.png").exists()


def test_inspect_reports_unreadable_text(tmp_path, checkpoint, capsys):
    assert main([str(checkpoint), "--out", str(tmp_path / "maps.png"), "--text", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err
