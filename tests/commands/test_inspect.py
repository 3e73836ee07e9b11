"""`mhar inspect`: a checkpoint's maps as a PNG plus a terminal table, on a text file or the run's data."""

from pathlib import Path

import lightning
import matplotlib.image
import numpy as np
import pytest
import torch

from mhar_lightning.commands.inspect import main
from mhar_lightning.config import ModelConfig
from mhar_lightning.data.prepare import prepare_files
from mhar_lightning.data.tokenizer import load_tokenizer
from mhar_lightning.model import Decoder
from mhar_lightning.module import LanguageModel
from mhar_lightning.probe import DepthMaps, run_probe
from mhar_lightning.residual import make_residual

SHAPE = {"d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 64}  # not a preset's shape


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


def routed_checkpoint(path: Path, data: Path | None = None, init_from: Path | None = None) -> Path:
    """A random MHAR checkpoint of a small shape, written as a run that read `data` (and, with `init_from`, started
    from that converted directory) writes it."""
    torch.manual_seed(0)
    model = LanguageModel(residual="mhar", model_overrides=SHAPE, vocab_size=256, seq_len=16)
    model.configure_model()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))  # routing queries too, so the maps are not uniform
    hparams = dict(model.hparams)
    if init_from is not None:  # the shape came from the directory: only `model_config` records it
        hparams |= {"preset": None, "model_overrides": None, "init_from": str(init_from)}
    torch.save(
        {
            "state_dict": model.state_dict(),
            "hyper_parameters": hparams,
            "datamodule_hyper_parameters": {"tokenizer": "byte", "seq_len": 16, "path": data and str(data)},
            "pytorch-lightning_version": lightning.__version__,
        },
        path,
    )
    return path


def test_inspect_a_run_whose_init_from_is_gone(tmp_path):
    """The converted directory a run started from may have moved (or been relative to another working directory):
    the checkpoint holds the weights, so it is not read."""
    checkpoint = routed_checkpoint(tmp_path / "midtrain.ckpt", init_from=tmp_path / "moved")
    text = tmp_path / "probe.txt"
    text.write_text("routing over depth, one softmax per head. " * 4)
    npz = tmp_path / "maps.npz"
    assert main([str(checkpoint), "--out", str(tmp_path / "maps.png"), "--text", str(text), "--npz", str(npz)]) == 0
    raw = torch.load(checkpoint, weights_only=True)
    reference = Decoder(ModelConfig(**raw["hyper_parameters"]["model_config"]), make_residual("mhar"))
    reference.load_state_dict({k.removeprefix("decoder."): v for k, v in raw["state_dict"].items()})
    ids = load_tokenizer("byte").encode(text.read_text())
    expected = run_probe(reference, torch.tensor(ids[: 8 * 16]).view(8, 16))  # what --rows 8 takes of the text
    maps = DepthMaps.load(npz)
    assert maps.site_labels == expected.site_labels and maps.site_labels[-1] == "final"
    np.testing.assert_allclose(maps.weights, expected.weights, rtol=1e-6, atol=1e-7)
    assert np.nanstd(maps.weights) > 0.01  # the routing is not uniform: the weights were really read


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--seq-len", "0"], "argument --seq-len: must be at least 1, not 0"),
        (["--rows", "-1"], "argument --rows: must be at least 1, not -1"),
        (["--out", "runs"], "--out runs is not a .png file: name one, e.g. --out runs.png"),
        (["--npz", "raw"], "--npz raw is not a .npz file: name one, e.g. --npz raw.npz"),
    ],
)
def test_inspect_refuses_bad_flags(tmp_path, checkpoint, capsys, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main([str(checkpoint), *flags])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"mhar inspect: error: {message}"
    assert not list(tmp_path.glob("*.png")) and not list(tmp_path.glob("*.npz"))


def test_inspect_names_the_fix_for_a_long_seq_len_or_data_without_validation(tmp_path, capsys):
    text = tmp_path / "train.txt"
    text.write_text("only training text here. " * 40)
    data = tmp_path / "prepared"
    prepare_files([text], data, load_tokenizer("byte"), val_fraction=0.0, progress=False)
    checkpoint = routed_checkpoint(tmp_path / "run.ckpt", data)
    out = tmp_path / "maps.png"
    assert main([str(checkpoint), "--out", str(out), "--seq-len", "4096", "--text", str(text)]) == 2
    assert "--seq-len 4096 exceeds the model's max_seq_len: pass --seq-len 16 or less" in capsys.readouterr().err
    assert main([str(checkpoint), "--out", str(out)]) == 2
    error = " ".join(capsys.readouterr().err.split())
    assert error == f"mhar inspect: {data} has no validation split to probe: pass --text FILE (any UTF-8 text)"
    assert not out.exists()
