"""The content digest reads back equal after `torch.save`/`torch.load` (mmap or not) and changes with any value."""

from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from mhar_lightning.checkpoint.digest import DIGEST_KEY, content_digest, verify_digest, with_digest
from mhar_lightning.errors import CheckpointError


def checkpoint() -> dict:
    """The kinds of values a Lightning checkpoint holds."""
    weight = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    return {
        "epoch": 0,
        "global_step": 7,
        "state_dict": OrderedDict(w=weight, wt=weight.t(), half=weight.bfloat16(), scalar=torch.tensor(2.5)),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(7.0)}},
                              "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95)}]}],
        "hyper_parameters": {"residual": {"class_path": "mhar_lightning.residual.MHAR"}, "dtype": torch.float32,
                             "shape": torch.Size([4, 6]), "name": None, "flag": True},
    }  # fmt: skip


@pytest.mark.parametrize("mmap", [False, True])
def test_the_digest_reads_back_equal(tmp_path: Path, mmap: bool) -> None:
    saved = with_digest(checkpoint())
    torch.save(saved, tmp_path / "x.ckpt")
    loaded = torch.load(tmp_path / "x.ckpt", weights_only=True, mmap=mmap)
    assert loaded[DIGEST_KEY] == saved[DIGEST_KEY] == content_digest(loaded)
    verify_digest(loaded, tmp_path / "x.ckpt")


@pytest.mark.parametrize(
    "change",
    [
        lambda c: c.update(global_step=8),
        lambda c: c["state_dict"]["w"].view(-1)[5].add_(1e-7),
        lambda c: c["state_dict"].update(half=c["state_dict"]["half"].float()),  # same values, another dtype
        lambda c: c["state_dict"].update(w=c["state_dict"]["w"].reshape(6, 4)),  # same bytes, another shape
        lambda c: c["optimizer_states"][0]["param_groups"][0].update(lr=2e-3),
        lambda c: c["hyper_parameters"].update(name="x"),
    ],
)
def test_any_change_is_refused(tmp_path: Path, change) -> None:
    saved = with_digest(checkpoint())
    change(saved)
    with pytest.raises(CheckpointError, match="differs from the content digest recorded when it was written"):
        verify_digest(saved, tmp_path / "x.ckpt")
