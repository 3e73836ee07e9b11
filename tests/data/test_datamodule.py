"""TokenDataModule: window sampling, determinism, and exact mid-epoch resume of the StatefulDataLoader."""

import json
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from mhar_lightning.data import ShardError, TokenDataModule
from mhar_lightning.data.prepare import prepare_files
from mhar_lightning.data.tokenizer import load_tokenizer

SEQ_LEN = 16


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-tokenized folder with both splits."""
    root = tmp_path_factory.mktemp("data")
    docs = [json.dumps({"text": f"doc {i} " + "abcdefghij"[: i % 10] * 20}) for i in range(300)]
    (root / "docs.jsonl").write_text("\n".join(docs))
    prepare_files([root / "docs.jsonl"], root / "out", load_tokenizer("byte"), val_fraction=0.1, progress=False)
    return root / "out"


def _module(path: Path, rank: int = 0, world: int = 1, **kwargs: object) -> TokenDataModule:
    """A set-up datamodule that believes it runs as ``rank`` of ``world`` (a stand-in for the trainer)."""
    options = {"seq_len": SEQ_LEN, "batch_size": 4, "samples_per_epoch": 96, **kwargs}
    dm = TokenDataModule(path=str(path), tokenizer="byte", **options)
    dm.trainer = SimpleNamespace(world_size=world, global_rank=rank)
    dm.setup("fit")
    return dm


def test_windows_are_consecutive_tokens_and_deterministic(prepared: Path) -> None:
    dm = _module(prepared)
    ds = dm.train_dataset
    assert len(ds) == 96 and dm.vocab_size == 256 and dm.tokenizer.name == "byte"
    for i in (0, 1, 95):
        start = ds.start(i)
        assert ds[i].dtype == torch.int64
        assert ds[i].tolist() == ds.stream[start : start + SEQ_LEN + 1].tolist()
    assert len({ds.start(i) for i in range(96)}) > 80  # random starts
    assert [ds.start(i) for i in range(96)] == [_module(prepared).train_dataset.start(i) for i in range(96)]
    assert [ds.start(i) for i in range(96)] != [_module(prepared, seed=1).train_dataset.start(i) for i in range(96)]
    batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (4, SEQ_LEN + 1)


def test_epoch_order_depends_on_seed_and_epoch_only(prepared: Path) -> None:
    def epoch(dm: TokenDataModule, number: int) -> list[torch.Tensor]:
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(number)
        return list(loader)

    a, b = _module(prepared), _module(prepared)
    assert all(torch.equal(x, y) for x, y in zip(epoch(a, 1), epoch(b, 1), strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(epoch(a, 0), epoch(a, 1), strict=True))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_mid_epoch_resume_is_exact(prepared: Path, num_workers: int) -> None:
    full = list(_module(prepared, num_workers=num_workers).train_dataloader())
    assert len(full) == 24
    interrupted = _module(prepared, num_workers=num_workers).train_dataloader()
    iterator = iter(interrupted)
    head = [next(iterator) for _ in range(7)]
    state = interrupted.state_dict()
    resumed = _module(prepared, num_workers=num_workers).train_dataloader()
    resumed.load_state_dict(state)
    tail = list(resumed)
    assert len(head) + len(tail) == len(full)
    assert all(torch.equal(x, y) for x, y in zip(head + tail, full, strict=True))


def test_two_rank_resume_is_exact_and_ranks_are_disjoint(prepared: Path) -> None:
    full = {rank: list(_module(prepared, rank, 2).train_dataloader()) for rank in (0, 1)}
    indices = {rank: list(_module(prepared, rank, 2).train_dataloader().sampler) for rank in (0, 1)}
    assert not set(indices[0]) & set(indices[1]) and len(indices[0]) == len(indices[1]) == 48
    for rank in (0, 1):
        loader = _module(prepared, rank, 2).train_dataloader()
        iterator = iter(loader)
        head = [next(iterator) for _ in range(5)]
        resumed = _module(prepared, rank, 2).train_dataloader()
        resumed.load_state_dict(loader.state_dict())
        assert all(torch.equal(x, y) for x, y in zip(head + list(resumed), full[rank], strict=True))


def test_validation_is_fixed_and_sharded(prepared: Path) -> None:
    one = list(_module(prepared, val_samples=24).val_dataloader())
    again = list(_module(prepared, seed=5, val_samples=24).val_dataloader())  # the training seed does not matter
    assert len(one) == 6 and all(torch.equal(x, y) for x, y in zip(one, again, strict=True))
    halves = [list(_module(prepared, rank, 2, val_samples=24).val_dataloader()) for rank in (0, 1)]
    assert sorted(map(tuple, torch.cat(halves[0] + halves[1]).tolist())) == sorted(map(tuple, torch.cat(one).tolist()))


def test_datamodule_refuses_another_tokenizer(prepared: Path) -> None:
    dm = TokenDataModule(path=str(prepared), tokenizer="gpt2")
    with pytest.raises(ShardError, match="prepared with tokenizer 'byte'"):
        dm.prepare_data()


def test_default_corpus_datamodule() -> None:
    dm = TokenDataModule(tokenizer="byte", seq_len=32, batch_size=2)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.data_dir.name.startswith("stdlib-py") and len(dm.train_dataset) > 10_000
    assert next(iter(dm.train_dataloader())).shape == (2, 33)


class _Recorder(L.LightningModule):
    """A minimal model that records the windows it is trained on."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(256, 8)
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch.clone())
        return self.embedding(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(path: Path, root: Path, ckpt_path: str | None = None, max_steps: int = -1) -> list[torch.Tensor]:
    model = _Recorder()
    trainer = L.Trainer(
        default_root_dir=root,
        max_epochs=1,
        max_steps=max_steps,
        use_distributed_sampler=False,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=3, save_top_k=-1)],
        accelerator="cpu",
    )
    dm = TokenDataModule(path=str(path), seq_len=SEQ_LEN, batch_size=4, samples_per_epoch=40)
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model.seen


def test_lightning_checkpoint_resumes_mid_epoch(prepared: Path, tmp_path: Path) -> None:
    """Lightning stores the loader state in the checkpoint and restores it: batches continue where they stopped."""
    full = _fit(prepared, tmp_path / "full")
    head = _fit(prepared, tmp_path / "run", max_steps=3)
    checkpoint = torch.load(tmp_path / "run" / "epoch=0-step=3.ckpt", weights_only=False)
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    tail = _fit(prepared, tmp_path / "run", ckpt_path=str(tmp_path / "run" / "epoch=0-step=3.ckpt"))
    assert len(full) == 10 and len(head) == 3
    assert all(torch.equal(x, y) for x, y in zip(head + tail, full, strict=True))
