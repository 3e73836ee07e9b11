"""A residual `class_path` read from a checkpoint or a converted directory is imported only when it names a built-in
or installed strategy, or a class the user names too: every command refuses anything else without importing it."""

import json
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import DEMO, fast_demo_args, mhar
from residual_helpers import install_plugin

import mhar_lightning.residual.trust as trust
from mhar_lightning.checkpoint.digest import DIGEST_KEY, with_digest
from mhar_lightning.config import ModelConfig
from mhar_lightning.convert.checkpoint import CONFIG_FILE, FORMAT_VERSION
from mhar_lightning.convert.safetensors_io import TensorEntry, write_sharded
from mhar_lightning.errors import CheckpointError
from mhar_lightning.model import Decoder
from mhar_lightning.residual import RESIDUALS, make_residual
from mhar_lightning.residual.trust import check_stored_residual

pytestmark = pytest.mark.usefixtures("default_corpus")

RECORDER = """
from pathlib import Path

Path({marker!r}).write_text("imported")

from mhar_lightning.residual import SumResidual


class Recorded(SumResidual):
    pass
"""


@pytest.fixture
def recorder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """(class path, marker): an importable module that writes the marker when imported; trust starts empty."""
    name = f"recorded_{tmp_path.name.replace('-', '_')}"
    (tmp_path / "site").mkdir()
    marker = tmp_path / "imported"
    (tmp_path / "site" / f"{name}.py").write_text(RECORDER.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(trust, "NAMED_BY_USER", set())
    monkeypatch.setattr(RESIDUALS, "classes", dict(RESIDUALS.classes))
    yield f"{name}.Recorded", marker
    sys.modules.pop(name, None)


def naming(checkpoint: Path, class_path: str, out: Path) -> Path:
    """A copy of `checkpoint` whose recorded residual is `class_path` (the weights are a `sum` model's or not), with a
    digest that matches: a crafted file, not a damaged one."""
    raw = torch.load(checkpoint, map_location="cpu", weights_only=True)
    raw.pop(DIGEST_KEY)
    raw["hyper_parameters"]["residual"] = {"class_path": class_path, "init_args": {}}
    torch.save(with_digest(raw), out)
    return out


def converted(out: Path, class_path: str) -> Path:
    """A converted directory of a tiny byte-vocabulary `sum` model that records residual `class_path`."""
    config = ModelConfig.preset("tiny")
    model = Decoder(config, make_residual("sum"))
    out.mkdir(parents=True)
    write_sharded(out, [TensorEntry(n, tuple(p.shape), p.dtype, p.detach) for n, p in model.named_parameters()], 2**30)
    meta = {"format_version": FORMAT_VERSION, "model": config.to_dict(), "residual": {"class_path": class_path}}
    (out / CONFIG_FILE).write_text(json.dumps(meta))
    return out


def test_a_checkpoint_naming_an_unknown_class_is_refused_by_every_command_without_importing_it(
    tmp_path: Path, capsys, demo_run: Path, recorder: tuple[str, Path]
) -> None:
    class_path, marker = recorder
    for named in (class_path, "this.Zen"):  # `this` prints the Zen of Python when imported
        ckpt = naming(demo_run / "checkpoints" / "last.ckpt", named, tmp_path / "named.ckpt")
        commands = {
            "generate": ["generate", ckpt, "--prompt", "a", "--max-new-tokens", 1],
            "inspect": ["inspect", ckpt, "--out", tmp_path / "maps.png"],
            "export-hf": ["export-hf", ckpt, tmp_path / "hf"],
            "validate": ["validate", "--config", DEMO, "--ckpt_path", ckpt, "--trainer.default_root_dir", tmp_path],
            "fit": [*fast_demo_args(tmp_path / "run", 3), "--ckpt_path", ckpt],
        }
        for command, args in commands.items():
            code, err = mhar(args, capsys)
            assert code == 2, (command, err)
            assert len(err.strip().splitlines()) == 1, (command, err)
            assert f"checkpoint {ckpt} names residual class {named!r}" in err and "was not imported" in err, err
            assert not marker.exists() and named.partition(".")[0] not in sys.modules, command
    assert not (tmp_path / "hf").exists() and not (tmp_path / "maps.png").exists()
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_converted_directory_naming_an_unknown_class_is_refused_without_importing_it(
    tmp_path: Path, capsys, recorder: tuple[str, Path]
) -> None:
    class_path, marker = recorder
    model = converted(tmp_path / "model", class_path)
    commands = {
        "generate": ["generate", model, "--tokenizer", "byte", "--prompt", "a", "--max-new-tokens", 1],
        "export-hf": ["export-hf", model, tmp_path / "hf"],
        "fit": [*fast_demo_args(tmp_path / "run", 1), "--model.init_from", model],
    }
    for command, args in commands.items():
        code, err = mhar(args, capsys)
        assert code == 2, (command, err)
        assert len(err.strip().splitlines()) == 1, (command, err)
        assert f"{model / CONFIG_FILE} names residual class {class_path!r}" in err, err
        assert not marker.exists(), command
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_class_the_user_names_too_is_imported(tmp_path: Path, capsys, recorder: tuple[str, Path]) -> None:
    class_path, marker = recorder
    model = converted(tmp_path / "model", class_path)
    code, err = mhar(["generate", model, "--tokenizer", "byte", "--prompt", "a", "--max-new-tokens", 1], capsys)
    assert code == 2 and not marker.exists()
    code, err = mhar(
        ["generate", model, "--tokenizer", "byte", "--prompt", "a", "--max-new-tokens", 1, "--residual", class_path],
        capsys,
    )
    assert code == 0, err
    assert marker.exists()


def test_a_class_the_user_names_on_the_command_line_validates(
    tmp_path: Path, capsys, recorder: tuple[str, Path]
) -> None:
    class_path, marker = recorder
    model = converted(tmp_path / "model", class_path)
    args = ["validate", "--config", DEMO, "--model.init_from", model, "--trainer.default_root_dir", tmp_path]
    args += ["--trainer.limit_val_batches", 1, "--data.seq_len", 16, "--data.batch_size", 2, "--data.val_samples", 2]
    code, err = mhar([*args, "--model.residual", class_path], capsys)
    assert code == 0, err
    assert marker.exists()


def test_built_in_and_installed_strategies_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("sum", "mhar", "delta-mhar", "hyper-connections", "attnres"):
        check_stored_residual(make_residual(name).spec(), "a file")
    check_stored_residual({"class_path": "mhar_lightning.residual.MHAR"}, "a file")  # the README's spelling
    check_stored_residual({"name": "mhar", "args": {}}, "a file")  # converted directories of the first format
    monkeypatch.syspath_prepend(str(install_plugin(tmp_path / "site")))
    monkeypatch.setattr(RESIDUALS, "classes", dict(RESIDUALS.classes))
    monkeypatch.delitem(sys.modules, "rezero_plugin", raising=False)
    check_stored_residual({"class_path": "rezero_plugin.ReZero"}, "a file")  # installed with an entry point
    refused = ("rezero_plugin.nn", "rezero_plugin_missing.ReZero", "mhar_lightning.residual.base.Residual", "os.system")
    for class_path in (*refused, 3, None):  # the second is a broken entry point's
        with pytest.raises(CheckpointError, match="names residual class"):
            check_stored_residual({"class_path": class_path}, "a file")
