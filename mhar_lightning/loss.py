"""Next-token cross-entropy in fp32 without materialising the full fp32 logits tensor."""

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy over chunks of rows; the backward recomputes each chunk's logits from the saved inputs
    and per-row log-sum-exps.

    A Function rather than activation checkpointing: checkpoint's saved-tensor hooks split a backward captured by
    compiled autograd into several graphs.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int) -> Tensor:
        total, lse = hidden.new_zeros((), dtype=torch.float32), []
        for start in range(0, hidden.shape[0], chunk_tokens):
            logits = F.linear(hidden[start : start + chunk_tokens], weight)
            ctx.dtype = logits.dtype  # the matmul's dtype: bf16 under autocast
            logits, t = logits.float(), targets[start : start + chunk_tokens]
            lse.append(torch.logsumexp(logits, dim=-1))
            target_logit = logits.gather(1, t.clamp(min=0)[:, None])[:, 0]
            total = total + torch.where(t != IGNORE_INDEX, lse[-1] - target_logit, 0.0).sum()
        ctx.save_for_backward(hidden, weight, targets, torch.cat(lse))
        ctx.chunk_tokens = chunk_tokens
        return total

    @staticmethod
    def backward(ctx, grad_total: Tensor) -> tuple[Tensor, Tensor, None, None]:
        hidden, weight, targets, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        w = weight.to(ctx.dtype)
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            rows = slice(start, start + ctx.chunk_tokens)
            h, t = hidden[rows].to(ctx.dtype), targets[rows]
            grad_logits = F.linear(h, w).float().sub_(lse[rows, None]).exp_()  # in place: one fp32 chunk alive
            grad_logits.scatter_add_(1, t.clamp(min=0)[:, None], grad_logits.new_full((len(t), 1), -1.0))
            grad_logits = grad_logits.mul_((t != IGNORE_INDEX)[:, None] * grad_total).to(ctx.dtype)
            grad_hidden[rows] = grad_logits @ w
            grad_weight += grad_logits.T @ h
        return grad_hidden, grad_weight.to(weight.dtype), None, None


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int = 4096) -> Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets` (-100 ignored), `chunk_tokens` rows at a time.

    The backward recomputes each chunk's logits, so at most one chunk of fp32 logits ([chunk_tokens, vocab]) is
    alive at any time, even for a 128k vocabulary.
    """
    hidden, targets = hidden.flatten(0, -2), targets.flatten()
    total = _ChunkedCrossEntropy.apply(hidden, weight, targets, chunk_tokens)
    return total / (targets != IGNORE_INDEX).sum().clamp(min=1)
