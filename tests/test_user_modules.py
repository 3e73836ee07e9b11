"""A strategy in the user's own file, named from the folder that holds it, trains through `mhar` as with `python -m`;
a module there is imported only for a class the user names, and never in place of an installed one."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import NO_PROBES, fast_demo_args
from test_cli import run

import mhar_lightning.residual.trust as trust
import mhar_lightning.user_modules as user_modules
from mhar_lightning.errors import CheckpointError
from mhar_lightning.residual.trust import check_stored_residual

pytestmark = pytest.mark.usefixtures("default_corpus")

REZERO = '''
from pathlib import Path

import torch
from torch import nn

from mhar_lightning.residual import Residual

Path("imported").write_text("imported")


class ReZero(Residual):
    """h <- h + alpha_l * y_l, alpha zero-initialised."""

    def build(self, config):
        self.alpha = nn.Parameter(torch.zeros(len(self.sites)))

    def reset_parameters(self):
        if hasattr(self, "alpha"):
            nn.init.zeros_(self.alpha)

    def read(self, stream, l):
        return stream[0]

    def write(self, stream, l, y):
        return (stream[0] + self.alpha[self.site(l)] * y,)
'''


@pytest.fixture
def user_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working directory, holding `rezero.py` (which writes `imported` when imported), as under the `mhar`
    script: the folder is not on `sys.path`, and nothing is named or imported yet."""
    (tmp_path / "rezero.py").write_text(REZERO)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", os.getcwd())])
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(user_modules, "USER_MODULES", set())
    monkeypatch.setattr(trust, "NAMED_BY_USER", set())
    monkeypatch.delitem(sys.modules, "rezero", raising=False)
    yield tmp_path
    sys.modules.pop("rezero", None)


def forget_rezero(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new `mhar` process: nothing named by the user, `rezero` not imported."""
    monkeypatch.setattr(user_modules, "USER_MODULES", set())
    monkeypatch.setattr(trust, "NAMED_BY_USER", set())
    sys.modules.pop("rezero", None)


@pytest.mark.parametrize("where", ["flag", "recipe"])
def test_a_strategy_in_the_current_folder_trains_and_generates_when_named(
    user_folder: Path, monkeypatch: pytest.MonkeyPatch, capsys, where: str
) -> None:
    assert importlib.util.find_spec("rezero") is None  # what failed before: the folder is not on the path
    (user_folder / "mine.yaml").write_text("model:\n  residual:\n    class_path: rezero.ReZero\n")
    named = ["--model.residual.class_path", "rezero.ReZero"] if where == "flag" else ["--config", "mine.yaml"]
    code, _, err = run([*fast_demo_args(user_folder / "run", 1), *NO_PROBES, *named], capsys)
    assert code == 0, err
    ckpt = user_folder / "run" / "checkpoints" / "last.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert saved["hyper_parameters"]["residual"]["class_path"] == "rezero.ReZero"
    assert "decoder.final_residual.alpha" in saved["state_dict"]  # ReZero's own parameter was trained

    forget_rezero(monkeypatch)
    args = ["generate", str(ckpt), "--prompt", "def ", "--max-new-tokens", "2", "--device", "cpu"]
    code, _, err = run(args, capsys)
    assert code != 0 and "names residual class 'rezero.ReZero'" in err  # the checkpoint alone imports nothing
    assert "rezero" not in sys.modules
    code, _, err = run([*args, "--residual", "rezero.ReZero"], capsys)
    assert code == 0, err


def test_a_strategy_in_another_folder_names_pythonpath(user_folder: Path, capsys) -> None:
    (user_folder / "elsewhere").mkdir()
    os.chdir(user_folder / "elsewhere")  # the fixture's chdir restores the first folder
    args = [*fast_demo_args(user_folder / "run", 1), "--model.residual.class_path", "rezero.ReZero"]
    code, _, err = run(args, capsys)
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        "mhar: error: --model.residual.class_path rezero.ReZero: no class ReZero in an importable module rezero; check"
        " the spelling, and run from the folder that holds rezero or add that folder to PYTHONPATH"
    )


def test_a_class_path_read_from_a_file_imports_nothing_from_the_current_folder(user_folder: Path) -> None:
    with pytest.raises(CheckpointError, match="names residual class 'rezero.ReZero', which is neither"):
        check_stored_residual({"class_path": "rezero.ReZero"}, "checkpoint c.ckpt")
    user_modules.allow_user_module("other.Class")  # the user named a class elsewhere
    assert importlib.util.find_spec("rezero") is None
    assert not (user_folder / "imported").exists()


def test_an_installed_module_wins_over_the_current_folder(user_folder: Path) -> None:
    (user_folder / "json.py").write_text("raise ImportError('the folder shadowed json')")
    user_modules.allow_user_module("json.JSONDecoder")
    assert importlib.util.find_spec("json").origin != str(user_folder / "json.py")
    assert importlib.util.find_spec("rezero") is None
    user_modules.allow_user_module("rezero.ReZero")
    assert importlib.util.find_spec("rezero").origin == str(user_folder / "rezero.py")
