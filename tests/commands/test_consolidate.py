"""`mhar consolidate`: a sharded FSDP2 checkpoint becomes one file whose weights equal the gathered shards."""

import hashlib
import json
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from fsdp_helpers import MHAR, converted_init, run_ranks, tiny_corpus
from test_cli import run
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

from mhar_lightning.checkpoint.digest import DIGEST_FILE, record_sharded_digest
from mhar_lightning.commands import consolidate as consolidate_module
from mhar_lightning.commands.consolidate import main
from mhar_lightning.module import LanguageModel


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step FSDP2 run on 2 CPU ranks: its sharded `ckpt/last.ckpt` and the all-gathered weights (`gathered.pt`)."""
    root = tmp_path_factory.mktemp("sharded")
    _, init = converted_init(root, MHAR, tie=True)
    out = root / "run"
    args = ["--out", str(out), "--data", str(tiny_corpus(root)), "--init", str(init), "--residual", json.dumps(MHAR)]
    result = run_ranks(*args, "--fsdp", "--devices", "2", "--steps", "4", "--ckpt-every", "4")
    assert result.returncode == 0, result.stdout[-3000:]
    assert len(list((out / "ckpt" / "last.ckpt").glob("*.distcp"))) == 2  # one shard file per rank
    return out


def test_consolidated_weights_equal_gathered_shards(tmp_path: Path, sharded_run: Path) -> None:
    assert main([str(sharded_run / "ckpt" / "last.ckpt"), str(tmp_path / "model.ckpt")]) == 0
    consolidated = torch.load(tmp_path / "model.ckpt", map_location="cpu", weights_only=True)
    gathered = torch.load(sharded_run / "gathered.pt", map_location="cpu", weights_only=True)  # all-gathered by the run
    assert consolidated["global_step"] == 4
    assert sorted(consolidated["state_dict"]) == sorted(gathered)
    for name, weight in gathered.items():
        assert torch.equal(consolidated["state_dict"][name], weight), name

    model = LanguageModel.load_from_checkpoint(tmp_path / "model.ckpt", map_location="cpu")
    assert model.decoder.head.weight is model.decoder.embed.weight
    for name, weight in model.state_dict().items():
        assert torch.equal(weight, gathered[name]), name


def test_a_consolidated_checkpoint_validates_on_one_device_and_refuses_to_resume_there(
    tmp_path: Path, sharded_run: Path
) -> None:
    """Validation reads no data position, so the 2-rank run's checkpoint validates on one device; resuming its
    training there would misplace the data and stays refused."""
    assert main([str(sharded_run / "ckpt" / "last.ckpt"), str(tmp_path / "model.ckpt")]) == 0
    model = LanguageModel.load_from_checkpoint(tmp_path / "model.ckpt", map_location="cpu")
    config = model.model_config
    tokens = torch.randint(0, config.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(tokens, batch_size=2)
    options = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    (metrics,) = L.Trainer(**options).validate(model, loader, ckpt_path=tmp_path / "model.ckpt", verbose=False)
    eager = torch.stack([model.loss(batch) for batch in loader]).mean()
    assert metrics["val/loss"] == pytest.approx(eager.item(), rel=1e-5)
    with pytest.raises(RuntimeError, match="written by 2 ranks and this run has 1"):
        L.Trainer(**options, max_steps=6).fit(model, loader, ckpt_path=tmp_path / "model.ckpt")


def refused(args: list[str], capsys: pytest.CaptureFixture) -> str:
    """The one line `mhar consolidate ARGS` prints on stderr (exit code 2)."""
    code, _, err = run(["consolidate", *args], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    return lines[0]


def test_consolidate_names_the_fix_for_a_wrong_path(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert "not a sharded checkpoint directory" in refused([str(tmp_path), str(tmp_path / "out.ckpt")], capsys)


@pytest.mark.parametrize(
    "existing, message",
    [
        ("folder", "{out} is a directory: name the file to write, e.g. {out}/model.ckpt"),
        ("file", "{out} already exists: choose a new OUT or delete it first (it is never overwritten)"),
    ],
)
def test_consolidate_refuses_an_existing_out_before_reading_the_shards(
    tmp_path: Path, sharded_run: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, existing, message
) -> None:
    out = tmp_path / "out"
    out.mkdir() if existing == "folder" else out.write_bytes(b"a finished checkpoint")
    monkeypatch.setattr(consolidate_module, "load", lambda *args, **kwargs: pytest.fail("read the shards"))
    line = refused([str(sharded_run / "ckpt" / "last.ckpt"), str(out)], capsys)
    assert line == "mhar consolidate: error: " + message.format(out=out)
    assert out.is_dir() if existing == "folder" else out.read_bytes() == b"a finished checkpoint"


def test_a_failed_write_leaves_no_out_file(
    tmp_path: Path, sharded_run: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def short_write(obj, f) -> None:  # what a full disk does: part of the archive, then an error
        with open(f, "wb") if isinstance(f, (str, Path)) else f as file:
            file.write(b"PK\x03\x04 part of an archive")
        raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr(torch, "save", short_write)
    assert refused([str(sharded_run / "ckpt" / "last.ckpt"), str(tmp_path / "model.ckpt")], capsys) == (
        f"mhar consolidate: error: writing {tmp_path / 'model.ckpt'} failed (PytorchStreamWriter failed writing file "
        "data/0: file write failed): free space or choose another OUT; no file was left"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_sharded_checkpoint_records_each_files_digest_and_a_changed_shard_is_refused(
    tmp_path: Path, sharded_run: Path, capsys: pytest.CaptureFixture
) -> None:
    folder = Path(shutil.copytree((sharded_run / "ckpt" / "last.ckpt").resolve(), tmp_path / "sharded"))
    recorded = json.loads((folder / DIGEST_FILE).read_text())["files"]
    assert sorted(recorded) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    for name, digest in recorded.items():
        assert digest == "sha256:" + hashlib.sha256((folder / name).read_bytes()).hexdigest()
    shard = folder / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x08
    shard.write_bytes(data)
    assert refused([str(folder), str(tmp_path / "model.ckpt")], capsys) == (
        f"mhar: error: checkpoint {shard} differs from the content digest recorded when it was written (damaged on"
        " disk or in transfer, or edited), so it was not loaded: use an intact copy, e.g. an earlier save"
    )
    assert not (tmp_path / "model.ckpt").exists() and shard.read_bytes() == data


def test_resuming_a_sharded_checkpoint_with_inf_optimizer_state_is_refused_on_every_rank(
    tmp_path: Path, sharded_run: Path
) -> None:
    """Written again with one infinite moment and a digest that matches (as a run would have saved it)."""
    source = (sharded_run / "ckpt" / "last.ckpt").resolve()
    dcp_to_torch_save(source, tmp_path / "full.pt")
    state = torch.load(tmp_path / "full.pt", weights_only=True)
    moments = next(iter(state["optimizer_0"]["state"].values()))
    moments["exp_avg_sq"].view(-1)[0] = float("inf")
    torch.save(state, tmp_path / "full.pt")
    poisoned = tmp_path / "inf"
    torch_save_to_dcp(tmp_path / "full.pt", poisoned)
    shutil.copy(source / "meta.pt", poisoned / "meta.pt")
    record_sharded_digest(poisoned, rank=0)
    root = sharded_run.parent
    args = ["--out", str(tmp_path / "run"), "--data", str(root / "corpus"), "--init", str(root / "init-MHAR-tied")]
    result = run_ranks(*args, "--residual", json.dumps(MHAR), "--fsdp", "--devices", "2", "--steps", "6",
                       "--resume", str(poisoned))  # fmt: skip
    assert result.returncode != 0
    line = f"checkpoint {poisoned} has non-finite weights or optimizer state: training had diverged when it was saved"
    assert result.stdout.count(line) == 2, result.stdout[-3000:]  # every rank stops on the reduced decision
