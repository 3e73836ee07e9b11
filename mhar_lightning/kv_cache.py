"""Attention keys and values kept across decoding steps, so each step runs the decoder on its new tokens only.

Only attention mixes tokens: residual routing reads the streams of one token at a time, so a step needs no state
besides these keys and values.
"""

import torch
from torch import Tensor

from mhar_lightning.config import ModelConfig


class KVCache:
    """Every layer's keys and values [B, kv_heads, T, head_dim] for the first `length` positions, preallocated."""

    def __init__(
        self, config: ModelConfig, batch: int, max_len: int, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        if max_len > config.max_seq_len:
            raise ValueError(f"a cache of {max_len} positions exceeds max_seq_len={config.max_seq_len}")
        shape = (config.n_layers, batch, config.n_kv_heads, max_len, config.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.keys.shape[3]

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store `layer`'s keys and values of the new positions; return those of all positions so far."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"{end} positions overflow the cache of {self.max_len}")
        self.keys[layer, :, :, self.length : end] = k
        self.values[layer, :, :, self.length : end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def advance(self, steps: int) -> None:
        """Mark `steps` more positions as stored (after every layer has seen them)."""
        self.length += steps
