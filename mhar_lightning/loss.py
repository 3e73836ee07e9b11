"""Next-token cross-entropy in fp32 without materialising the full fp32 logits tensor."""

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def _chunk_loss(hidden: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, targets, reduction="sum", ignore_index=-100)


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int = 4096) -> Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets` (-100 ignored), `chunk_tokens` rows at a time.

    Each chunk's logits are recomputed in backward (activation checkpointing), so at most one chunk of
    fp32 logits ([chunk_tokens, vocab]) is alive at any time, even for a 128k vocabulary.
    """
    hidden, targets = hidden.flatten(0, -2), targets.flatten()
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = start + chunk_tokens
        if torch.is_grad_enabled() and hidden.requires_grad:
            total = total + checkpoint(_chunk_loss, hidden[start:end], weight, targets[start:end], use_reentrant=False)
        else:
            total = total + _chunk_loss(hidden[start:end], weight, targets[start:end])
    return total / (targets != -100).sum().clamp(min=1)
