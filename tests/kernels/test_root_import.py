"""Python started in the repository root imports the installed packages, not the kit's top-level `kernels/` folder."""

import importlib.util
import subprocess
import sys

import pytest
from cli_helpers import REPO

CHILD = """
import kernels, transformers
from transformers import LlamaForCausalLM
from mhar_lightning.kernels import depth_route
from mhar_lightning.model import Decoder
print(kernels.__file__)
"""


def test_python_in_the_repository_root_imports_transformers_and_the_kit() -> None:
    installed = importlib.util.find_spec("kernels")  # from the tests' folders, not the root
    if installed is None or installed.origin is None:
        pytest.skip("no installed `kernels` package (transformers >= 5 brings Hugging Face's)")
    child = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip() == installed.origin != str(REPO / "kernels" / "__init__.py")
