"""Paths read from files stay inside their folder: a converted directory's shard index and a prepared folder's
`index.json` that lead elsewhere, and shards holding ids outside the vocabulary, are refused in one line by every
command that reads them."""

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import DEMO, mhar

from mhar_lightning.config import ModelConfig
from mhar_lightning.contained import inside
from mhar_lightning.convert.checkpoint import CONFIG_FILE, FORMAT_VERSION
from mhar_lightning.convert.safetensors_io import INDEX_FILE, TensorEntry, write_sharded
from mhar_lightning.data.prepare import prepare_files
from mhar_lightning.data.shards import INDEX_FILE as DATA_INDEX
from mhar_lightning.data.tokenizer import load_tokenizer
from mhar_lightning.model import Decoder
from mhar_lightning.residual import make_residual

pytestmark = pytest.mark.usefixtures("default_corpus")


def converted_dir(out: Path) -> Path:
    """A converted directory of a tiny byte-vocabulary `sum` model, in several shards listed by an index."""
    config = ModelConfig.preset("tiny", vocab_size=256, n_layers=2)
    model = Decoder(config, make_residual("sum"))
    entries = [TensorEntry(name, tuple(p.shape), p.dtype, p.detach) for name, p in model.named_parameters()]
    out.mkdir(parents=True)
    assert len(write_sharded(out, entries, max_shard_bytes=2**16)) > 1
    meta = {"format_version": FORMAT_VERSION, "model": config.to_dict(), "residual": make_residual("sum").spec()}
    (out / CONFIG_FILE).write_text(json.dumps(meta))
    return out


def lead_outside(model: Path, how: str) -> Path:
    """Make `model`'s first shard live outside it, reached by a `../` name, an absolute name or a symbolic link."""
    index = json.loads((model / INDEX_FILE).read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    outside = model.parent / "other.safetensors"
    shutil.move(model / shard, outside)
    if how == "link":
        (model / shard).symlink_to(outside)
        return outside
    name = f"../{outside.name}" if how == "parent" else str(outside)
    index["weight_map"] = {key: name if file == shard else file for key, file in index["weight_map"].items()}
    (model / INDEX_FILE).write_text(json.dumps(index))
    return outside


def test_inside_refuses_every_way_out(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_text("")
    (tmp_path / "b").write_text("")
    (tmp_path / "a" / "out").symlink_to(tmp_path)
    assert inside(tmp_path / "a", "x") == (tmp_path / "a" / "x").resolve()
    assert inside(tmp_path / "a", "sub/../x") is not None
    assert inside(tmp_path / "a", "out/a/x") is not None  # out through a link and back in
    for name in ("../b", "/etc/passwd", "", ".", "out/b", 3, None):
        assert inside(tmp_path / "a", name) is None, name
    assert inside(tmp_path / "a", "out/b", follow_links=False) is not None  # a link is judged by its name only
    assert inside(tmp_path / "a", "../b", follow_links=False) is None


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-token prepared folder with a validation split."""
    root = tmp_path_factory.mktemp("data")
    files = []
    for i in range(24):
        files.append(root / "src" / f"doc{i}.txt")
        files[-1].parent.mkdir(exist_ok=True)
        files[-1].write_text(f"document {i}: " + "some text to train on. " * 20)
    prepare_files(files, root / "prepared", load_tokenizer("byte"), progress=False, val_fraction=0.2)
    return root / "prepared"


@pytest.mark.parametrize("how", ["parent", "absolute", "link"])
def test_a_converted_directory_whose_shards_lie_outside_is_refused_by_every_command(
    tmp_path: Path, capsys, data: Path, how: str
) -> None:
    model = converted_dir(tmp_path / "model")
    outside = lead_outside(model, how)
    before = outside.read_bytes()
    fit = [
        "fit", "--config", DEMO, "--model.init_from", model, "--trainer.default_root_dir", tmp_path / "run",
        "--trainer.max_steps", 1, "--data.seq_len", 16, "--data.batch_size", 2,
    ]  # fmt: skip
    commands = {
        "generate": ["generate", model, "--tokenizer", "byte", "--prompt", "a", "--max-new-tokens", 2],
        "evaluate": ["evaluate", model, "--tokenizer", "byte", "--data", data, "--out", tmp_path / "e.json"],
        "export-hf": ["export-hf", model, tmp_path / "hf"],
        "fit": fit,
    }
    for name, args in commands.items():
        code, err = mhar(args, capsys)
        assert code == 2, (name, err)
        assert len(err.strip().splitlines()) == 1, (name, err)
        assert "leads outside" in err and str(model) in err, (name, err)
    assert outside.read_bytes() == before
    assert not (tmp_path / "hf").exists() and not (tmp_path / "e.json").exists()
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_hugging_face_cache_may_link_its_files_to_blobs(tmp_path: Path) -> None:
    """A source model's links lead out of its snapshot folder by design; its names still may not."""
    from mhar_lightning.convert.safetensors_io import ConversionError, SafetensorsDir

    model = converted_dir(tmp_path / "snapshot")
    lead_outside(model, "link")
    assert len(SafetensorsDir(model, follow_links=False).names()) > 1
    lead_outside(converted_dir(tmp_path / "b" / "snapshot"), "parent")
    with pytest.raises(ConversionError, match=r"names '\.\./other.safetensors' that leads outside"):
        SafetensorsDir(tmp_path / "b" / "snapshot", follow_links=False)


def fit_on(data: Path, root: Path) -> list[object]:
    return [
        "fit", "--config", DEMO, "--data.path", data, "--trainer.default_root_dir", root, "--trainer.max_steps", 1,
        "--data.seq_len", 16, "--data.batch_size", 2, "--data.val_samples", 2,
    ]  # fmt: skip


@pytest.mark.parametrize("how", ["parent", "absolute", "link"])
def test_a_prepared_folder_naming_a_shard_outside_is_refused(tmp_path: Path, capsys, data: Path, how: str) -> None:
    folder = tmp_path / "prepared"
    shutil.copytree(data, folder)
    index = json.loads((folder / DATA_INDEX).read_text())
    shard = index["splits"]["train"][0]
    outside = tmp_path / "outside.bin"
    shutil.move(folder / shard["file"], outside)
    if how == "link":
        (folder / shard["file"]).symlink_to(outside)
    else:
        shard["file"] = "../outside.bin" if how == "parent" else str(outside)
        (folder / DATA_INDEX).write_text(json.dumps(index))
    model = converted_dir(tmp_path / "model")
    evaluate = ["evaluate", model, "--tokenizer", "byte", "--data", folder, "--split", "train", "--out", tmp_path / "e"]
    for args in (fit_on(folder, tmp_path / "run"), evaluate):
        code, err = mhar(args, capsys)
        assert code == 2, err
        assert len(err.strip().splitlines()) == 1, err
        assert f"names shard {shard['file']!r}, which leads outside {folder}" in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_token_ids_outside_the_vocabulary_are_refused_when_the_folder_opens(tmp_path: Path, capsys, data: Path) -> None:
    folder = tmp_path / "prepared"
    shutil.copytree(data, folder)
    index = json.loads((folder / DATA_INDEX).read_text())
    shard = index["splits"]["train"][-1]
    tokens = np.fromfile(folder / shard["file"], dtype="<u2")
    tokens[len(tokens) // 2] = 300  # the byte tokenizer has 256 tokens
    tokens.tofile(folder / shard["file"])
    shard["sha256"] = hashlib.sha256(tokens.tobytes()).hexdigest()  # a consistent index: only the range is wrong
    (folder / DATA_INDEX).write_text(json.dumps(index))
    for verify in ("true", "false"):
        code, err = mhar([*fit_on(folder, tmp_path / verify), "--data.verify_checksums", verify], capsys)
        assert code == 2, err
        assert len(err.strip().splitlines()) == 1, err
        assert "holds token id 300, outside the tokenizer's 256-token vocabulary" in err and shard["file"] in err
        assert not list((tmp_path / verify).glob("checkpoints/*.ckpt"))


def test_a_tokenizer_file_linking_out_of_a_converted_directory_is_never_exported(tmp_path: Path, capsys) -> None:
    model = converted_dir(tmp_path / "model")
    secret = tmp_path / "secret.json"
    secret.write_text('{"not": "a tokenizer"}')
    (model / "tokenizer.json").symlink_to(secret)
    code, err = mhar(["export-hf", model, tmp_path / "hf"], capsys)
    assert code == 2
    assert err.strip() == (
        f"mhar export-hf: error: {model / 'tokenizer.json'} is a link that leads outside {model}: a model's files must"
        " lie in its own directory; convert the model again"
    )
    assert not (tmp_path / "hf").exists()
