"""Third-party strategies: names registered through the `mhar_lightning.residuals` entry-point group work from a
recipe once the package is installed; a strategy that cannot be imported is one line naming the fix."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from cli_helpers import DEMO
from residual_helpers import install_plugin

from mhar_lightning.cli import main
from mhar_lightning.residual import RESIDUALS, make_residual


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The plugin installed for this process; the registry and imports are restored afterwards."""
    site = install_plugin(tmp_path / "site")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(RESIDUALS, "classes", dict(RESIDUALS.classes))
    monkeypatch.delitem(sys.modules, "rezero_plugin", raising=False)
    return site


def fit_args(root: Path, *config: str) -> list[str]:
    return ["fit", "--config", str(DEMO), *config, "--trainer.default_root_dir", str(root)]


def test_entry_point_names_are_listed_and_imported_on_use(plugin: Path) -> None:
    assert {"rezero", "broken", "sum", "hyper-connections"} <= set(RESIDUALS)
    assert "rezero_plugin" not in sys.modules  # listing names imports nothing
    strategy = make_residual("rezero", init=0.5)
    assert type(strategy).__module__ == "rezero_plugin" and strategy.init == 0.5
    with pytest.raises(
        ValueError,
        match=r"^residual strategy 'broken' \(rezero_plugin_missing:ReZero, from rezero-plugin\) cannot be imported: "
        r"No module named 'rezero_plugin_missing'; reinstall rezero-plugin$",
    ):
        make_residual("broken")


@pytest.mark.usefixtures("default_corpus")
def test_a_registered_name_trains_from_a_recipe(tmp_path: Path) -> None:
    """`residual: rezero` in YAML, in a fresh `mhar fit` process that has the plugin installed and nothing else."""
    site = install_plugin(tmp_path / "site")
    recipe = tmp_path / "rezero.yaml"
    recipe.write_text("model:\n  residual: rezero\n  model_overrides: {n_layers: 1}\n")
    args = fit_args(tmp_path / "run", "--config", str(recipe))
    args += ["--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false"]
    args += ["--data.seq_len", "16", "--data.batch_size", "2", "--data.val_samples", "2"]
    done = subprocess.run(
        [sys.executable, "-m", "mhar_lightning.cli", *args],
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["hyper_parameters"]["residual"] == {
        "class_path": "rezero_plugin.ReZero",
        "init_args": {"init": 0.0},
    }
    alpha = checkpoint["state_dict"]["decoder.blocks.0.residual.alpha"]
    assert alpha.shape == (2,) and alpha.abs().min() > 0  # it trained from zero


@pytest.mark.parametrize(
    ("class_path", "after_demo", "cause"),
    [
        ("my_pkg.rezero.ReZero", True, "No module named 'my_pkg'"),  # replaces the demo's MHAR while parsing
        ("my_pkg.rezero.ReZero", False, "No module named 'my_pkg'"),  # the only residual: built by the model
        ("mhar_lightning.residual.ReZero", True, "module 'mhar_lightning.residual' has no attribute 'ReZero'"),
    ],
)
def test_a_class_path_that_cannot_be_imported_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, class_path: str, after_demo: bool, cause: str
) -> None:
    recipe = tmp_path / "plugin.yaml"
    recipe.write_text(
        textwrap.dedent(f"""\
        model:
          residual:
            class_path: {class_path}
        """)
    )
    args = fit_args(tmp_path, "--config", str(recipe))
    if not after_demo:
        args = ["fit", "--config", str(recipe), "--trainer.default_root_dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1].startswith("mhar: error: ") and cause in err
    assert "install the package that provides it or add its directory to PYTHONPATH" in err
