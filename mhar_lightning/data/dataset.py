"""A sized, map-style dataset of random token windows, so that samplers can shuffle, shard and resume it exactly."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from mhar_lightning.data.shards import ShardError, TokenStream


class TokenWindowDataset(Dataset[torch.Tensor]):
    """Item ``i``: ``seq_len + 1`` consecutive tokens (inputs and shifted targets) from a start fixed by ``(seed, i)``.

    The window of an index never changes, so a sampler's order (seeded by seed and epoch) fully determines an
    epoch's batches on every rank, and resuming at any sample index is exact. ``num_samples`` defaults to one
    pass over the tokens (``len(stream) // seq_len`` windows). Windows span document boundaries (EOT-separated).
    """

    def __init__(self, stream: TokenStream, seq_len: int, num_samples: int | None = None, seed: int = 0) -> None:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if len(stream) < seq_len + 1:
            raise ShardError(
                f"the {stream.split!r} split of {stream.directory} has {len(stream)} tokens, fewer than"
                f" seq_len + 1 = {seq_len + 1}: lower --data.seq_len or prepare more data"
            )
        self.stream, self.seq_len, self.seed = stream, seq_len, seed
        self.num_samples = num_samples if num_samples is not None else len(stream) // seq_len
        if self.num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {self.num_samples}")

    def __len__(self) -> int:
        return self.num_samples

    def start(self, index: int) -> int:
        """The first token of window ``index``: uniform over all valid starts, fixed by ``(seed, index)``."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"window {index} out of range for {self.num_samples} windows")
        return int(np.random.default_rng((self.seed, index)).integers(0, len(self.stream) - self.seq_len))

    def __getitem__(self, index: int) -> torch.Tensor:
        begin = self.start(index)
        return torch.from_numpy(self.stream[begin : begin + self.seq_len + 1].astype(np.int64))
