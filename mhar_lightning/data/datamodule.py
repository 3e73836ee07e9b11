"""``TokenDataModule``: prepared token shards (or the default stdlib corpus) as resumable Lightning dataloaders.

Training batches come from a torchdata ``StatefulDataLoader`` over a ``StatefulDistributedSampler`` that this
module builds itself with the trainer's world size and rank, so Lightning must not inject its own sampler:
build the Trainer with ``use_distributed_sampler=False``. Lightning then stores the loader's ``state_dict()``
in checkpoints and restores it on resume, which makes a mid-epoch resume exact on every rank.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from mhar_lightning.data.corpus import corpus_dir, ensure_corpus
from mhar_lightning.data.dataset import TokenWindowDataset
from mhar_lightning.data.shards import INDEX_FILE, ShardError, ShardIndex, TokenStream
from mhar_lightning.data.tokenizer import Tokenizer, load_tokenizer


class TokenDataModule(L.LightningDataModule):
    """Batches of ``(batch_size, seq_len + 1)`` int64 windows ``w``: inputs ``w[:, :-1]``, targets ``w[:, 1:]``."""

    def __init__(
        self,
        path: str | None = None,
        tokenizer: str = "byte",
        seq_len: int = 256,
        batch_size: int = 16,
        num_workers: int = 0,
        seed: int = 0,
        samples_per_epoch: int | None = None,
        val_samples: int | None = 256,
        verify_checksums: bool = True,
    ) -> None:
        """Args:
        path: a folder made by ``mhar prepare``; None uses the standard-library corpus, prepared on first use.
        tokenizer: ``byte``, ``gpt2``, ``r50k_base``, ``cl100k_base``, a ``.tiktoken`` path, or a model directory
            (Hugging Face or ``mhar convert-hf``: its ``tokenizer.json``); must match ``path``.
        seq_len: tokens the model sees per sample (each window holds ``seq_len + 1``).
        batch_size: samples per batch on each rank.
        num_workers: dataloader worker processes.
        seed: fixes the windows and, with the epoch, the order of training samples.
        samples_per_epoch: training windows per epoch over all ranks (None: one pass over the tokens).
        val_samples: validation windows (None: one pass over the validation tokens).
        verify_checksums: check every shard's sha256 in ``setup`` (sizes are always checked).
        """
        super().__init__()
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if value < 1:
                raise ValueError(f"data.{name}={value} must be >= 1")
        if val_samples is not None and val_samples < 1:
            raise ValueError(
                f"data.val_samples={val_samples} must be >= 1: set --data.val_samples N windows, or null for one pass"
                " over the validation tokens"
            )
        if num_workers < 0:
            raise ValueError(
                f"data.num_workers={num_workers} must be >= 0: set --data.num_workers 0 to load batches in the training"
                " process, or N for N worker processes"
            )
        self.save_hyperparameters()
        self.path, self.tokenizer_name, self.seq_len, self.batch_size = path, tokenizer, seq_len, batch_size
        self.num_workers, self.seed, self.samples_per_epoch = num_workers, seed, samples_per_epoch
        self.val_samples, self.verify_checksums = val_samples, verify_checksums
        self._tokenizer: Tokenizer | None = None
        self.train_dataset: TokenWindowDataset | None = None
        self.val_dataset: TokenWindowDataset | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer object, loaded on first access (usable before ``setup``)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_name)
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Vocabulary size the model's embedding must cover."""
        return self.tokenizer.vocab_size

    @property
    def data_dir(self) -> Path:
        """The prepared folder in use (the cached stdlib corpus when ``path`` is None)."""
        return Path(self.path) if self.path is not None else ensure_corpus(self.tokenizer)

    def prepare_data(self) -> None:
        """Prepare the default corpus once per node and check the folder's tokenizer early."""
        ShardIndex.load(self.data_dir).check_tokenizer(self.tokenizer, self.data_dir)

    def check(self, world_size: int, validate: bool) -> None:
        """Refuse, from ``index.json`` alone, a missing or mismatched folder, splits shorter than a window, an epoch
        shorter than one batch on each of ``world_size`` ranks (it would train nothing), and no validation split when
        ``validate``."""
        directory = Path(self.path) if self.path is not None else corpus_dir(self.tokenizer)
        if self.path is None and not (directory / INDEX_FILE).is_file():
            return  # the default corpus, prepared on first use
        index = ShardIndex.load(directory)
        index.check_tokenizer(self.tokenizer, directory)
        for split, shards in index.splits.items():
            tokens = sum(shard.tokens for shard in shards)
            if shards and tokens < self.seq_len + 1:
                raise ShardError(
                    f"the {split!r} split of {directory} has {tokens} tokens, fewer than seq_len + 1 ="
                    f" {self.seq_len + 1}: lower --data.seq_len or prepare more data"
                )
        windows = self.samples_per_epoch  # as TokenWindowDataset counts them
        windows = index.num_tokens("train") // self.seq_len if windows is None else windows
        if windows < self.batch_size * world_size:
            ranks = f" on each of {world_size} ranks" if world_size > 1 else ""
            raise ShardError(
                f"an epoch of {directory} has {windows} training windows of seq_len + 1 tokens, fewer than one batch"
                f" of data.batch_size={self.batch_size}{ranks}: lower --data.batch_size or --data.seq_len, raise"
                " --data.samples_per_epoch, or prepare more data"
            )
        if validate and not index.splits.get("val"):
            raise ShardError(
                f"{directory} has no validation split: prepare it with --val-fraction > 0, or turn validation off"
                " with --trainer.limit_val_batches 0"
            )

    def setup(self, stage: str | None = None) -> None:
        """Open and verify the shards; build the training and validation datasets."""
        if self.train_dataset is not None:
            return
        directory = self.data_dir
        train = TokenStream(directory, "train", self.tokenizer, verify=self.verify_checksums)
        self.train_dataset = TokenWindowDataset(train, self.seq_len, self.samples_per_epoch, self.seed)
        if train.index.splits.get("val"):
            val = TokenStream(directory, "val", self.tokenizer, verify=self.verify_checksums)
            self.val_dataset = TokenWindowDataset(val, self.seq_len, self.val_samples, seed=0)

    def state_dict(self) -> dict[str, str]:
        """The tokenizer's fingerprint (sha256 of its ranks), so a resume with another rank file is refused."""
        return {"tokenizer_fingerprint": self.tokenizer.fingerprint}

    def load_state_dict(self, state_dict: dict[str, str]) -> None:
        self.check_fingerprint(state_dict.get("tokenizer_fingerprint"), "the checkpoint")

    def check_fingerprint(self, fingerprint: str | None, source: str) -> None:
        """Refuse a tokenizer whose ranks differ from those `source` was trained with (same size or not)."""
        if fingerprint is not None and fingerprint != self.tokenizer.fingerprint:
            raise ShardError(
                f"{source} was trained with a tokenizer of fingerprint {fingerprint[:12]} but data.tokenizer="
                f"{self.tokenizer_name!r} has {self.tokenizer.fingerprint[:12]} (another rank file): pass the rank"
                " file it was trained with"
            )

    def _world(self) -> tuple[int, int]:
        """(world size, global rank) of the attached trainer, else a single process."""
        trainer = self.trainer
        return (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)

    def train_dataloader(self) -> StatefulDataLoader:
        """Shuffled (seed + epoch), rank-sharded, resumable training batches."""
        if self.train_dataset is None:
            raise RuntimeError("call setup() before train_dataloader()")
        world_size, rank = self._world()
        sampler = StatefulDistributedSampler(
            self.train_dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=self.seed, drop_last=True
        )
        return StatefulDataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            drop_last=True,
            pin_memory=torch.cuda.is_available(),
        )

    def val_dataloader(self) -> DataLoader:
        """The same validation windows in the same order on every run, split across ranks."""
        if self.val_dataset is None:
            raise RuntimeError(
                f"{self.data_dir} has no validation split: prepare with --val-fraction > 0 or set limit_val_batches=0"
            )
        world_size, rank = self._world()
        sampler = DistributedSampler(self.val_dataset, num_replicas=world_size, rank=rank, shuffle=False)
        return DataLoader(
            self.val_dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
        )
