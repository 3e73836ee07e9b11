"""`mhar consolidate`: a sharded FSDP2 checkpoint becomes one file whose weights equal the gathered shards."""

import json
from pathlib import Path

import pytest
import torch
from fsdp_helpers import MHAR, converted_init, run_ranks, tiny_corpus

from mhar_lightning.commands.consolidate import main
from mhar_lightning.module import LanguageModel


def test_consolidated_weights_equal_gathered_shards(tmp_path: Path) -> None:
    _, init = converted_init(tmp_path, MHAR, tie=True)
    out = tmp_path / "run"
    args = [
        "--out",
        str(out),
        "--data",
        str(tiny_corpus(tmp_path)),
        "--init",
        str(init),
        "--residual",
        json.dumps(MHAR),
    ]
    result = run_ranks(*args, "--fsdp", "--devices", "2", "--steps", "4", "--ckpt-every", "4")
    assert result.returncode == 0, result.stdout[-3000:]
    sharded = out / "ckpt" / "last.ckpt"
    assert len(list(sharded.glob("*.distcp"))) == 2  # one shard file per rank

    assert main([str(sharded), str(tmp_path / "model.ckpt")]) == 0
    consolidated = torch.load(tmp_path / "model.ckpt", map_location="cpu", weights_only=True)
    gathered = torch.load(out / "gathered.pt", map_location="cpu", weights_only=True)  # all-gathered by the run
    assert consolidated["global_step"] == 4
    assert sorted(consolidated["state_dict"]) == sorted(gathered)
    for name, weight in gathered.items():
        assert torch.equal(consolidated["state_dict"][name], weight), name

    model = LanguageModel.load_from_checkpoint(tmp_path / "model.ckpt", map_location="cpu")
    assert model.decoder.head.weight is model.decoder.embed.weight
    for name, weight in model.state_dict().items():
        assert torch.equal(weight, gathered[name]), name


def test_consolidate_names_the_fix_for_a_wrong_path(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path), str(tmp_path / "out.ckpt")])
    assert exit_info.value.code == 2
    assert "not a sharded checkpoint directory" in capsys.readouterr().err
