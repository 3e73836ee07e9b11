"""Bits per byte of a validation epoch: a loss that does not depend on the tokenizer, so byte-level and GPT-2-token
runs compare on one axis."""

import math

import torch
from torch import Tensor

from mhar_lightning.loss import chunked_cross_entropy


class BitsPerByte:
    """Sums over an epoch of the nats of tokens that stand for text and of the UTF-8 bytes they stand for.

    `lengths` [vocab] holds each id's bytes (`data.token_bytes`; 0 for end-of-text and other special tokens, whose
    loss is left out as in `mhar evaluate`), so the result equals `mhar evaluate`'s bits per byte on the same windows.
    """

    def __init__(self, lengths: Tensor) -> None:
        self.lengths = lengths
        self.sums: Tensor | None = None

    def reset(self) -> None:
        self.sums = None

    def update(self, hidden: Tensor, weight: Tensor, targets: Tensor, mean_loss: Tensor, chunk_tokens: int) -> None:
        """Add a batch: `mean_loss` over all of `targets` [B, T], from `hidden` [B, T, d] and the head `weight`.

        The special tokens' loss is computed again on their rows alone and taken out of the total (a few rows a
        document, not a second pass of the head over the batch)."""
        self.lengths = self.lengths.to(targets.device)
        counts = self.lengths[targets]
        special = counts == 0
        nats = mean_loss.detach().double() * targets.numel()
        rows = special.flatten().nonzero()[:, 0]
        if len(rows):
            mean = chunked_cross_entropy(hidden.flatten(0, -2)[rows], weight, targets.flatten()[rows], chunk_tokens)
            nats = nats - mean.double() * len(rows)
        batch = torch.stack([nats, counts.sum().double()])
        self.sums = batch if self.sums is None else self.sums + batch

    def value(self, reduce=lambda sums: sums) -> float | None:
        """Bits per byte of the epoch so far; `reduce` sums over ranks (None when no byte was seen)."""
        if self.sums is None:
            return None
        nats, total_bytes = reduce(self.sums).tolist()
        return nats / (math.log(2) * total_bytes) if total_bytes else None
