"""Log-likelihood scoring of continuations, and the accuracy of a multiple-choice task by the per-byte likelihood."""

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from mhar_lightning.data.tokenizer import Tokenizer
from mhar_lightning.downstream.tasks import Task

Pair = tuple[list[int], list[int]]


@torch.no_grad()
def continuation_logprobs(
    model: Callable[[Tensor], Tensor], pairs: Sequence[Pair], batch_size: int, max_length: int, pad_id: int
) -> list[tuple[float, bool]]:
    """(sum of the log-probabilities of the continuation, whether greedy decoding produces it) per (context,
    continuation) pair of token lists. `model` maps tokens [B, T] to logits [B, T, vocab]. Rows run longest first in
    batches, right-padded with `pad_id` (padding after a row cannot change its causal logits); contexts longer than
    `max_length` are cut from the left."""
    results: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
    order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
    for first in range(0, len(order), batch_size):
        batch = order[first : first + batch_size]
        sequences = [(pairs[i][0] + pairs[i][1])[-(max_length + 1) :] for i in batch]
        width = max(map(len, sequences)) - 1
        inputs = torch.full((len(batch), width), pad_id, dtype=torch.long)
        targets = torch.full((len(batch), width), pad_id, dtype=torch.long)
        scored = torch.zeros((len(batch), width), dtype=torch.bool)
        for r, (i, sequence) in enumerate(zip(batch, sequences, strict=True)):
            n = len(sequence) - 1
            inputs[r, :n], targets[r, :n] = torch.tensor(sequence[:-1]), torch.tensor(sequence[1:])
            scored[r, n - min(len(pairs[i][1]), n) : n] = True
        logits = model(inputs).float()
        targets, scored = targets.to(logits.device), scored.to(logits.device)
        token_logprobs = logits.gather(-1, targets[..., None])[..., 0] - logits.logsumexp(-1)
        logprobs = torch.where(scored, token_logprobs, 0.0).sum(-1).tolist()
        greedy = ((logits.argmax(-1) == targets) | ~scored).all(-1).tolist()
        for r, i in enumerate(batch):
            results[i] = (logprobs[r], greedy[r])
    return results


def task_accuracy(
    model: Callable[[Tensor], Tensor], tokenizer: Tokenizer, task: Task, batch_size: int, max_length: int
) -> float:
    """The fraction of `task`'s examples whose answer has the highest log-likelihood per UTF-8 byte among its
    choices (lm-evaluation-harness's `acc_norm`, so choices of different lengths compare). Each context follows an
    end-of-text token, as a document does in training."""
    pairs, spans = [], []
    for example in task.examples:
        context = [tokenizer.eot_id, *tokenizer.encode(example.context)]
        spans.append(range(len(pairs), len(pairs) + len(example.choices)))
        pairs += [(context, tokenizer.encode(choice)) for choice in example.choices]
    scores = continuation_logprobs(model, pairs, batch_size, max_length, tokenizer.eot_id)
    correct = 0
    for example, span in zip(task.examples, spans, strict=True):
        per_byte = [scores[i][0] / max(len(choice.encode()), 1) for i, choice in zip(span, example.choices)]
        correct += max(range(len(per_byte)), key=per_byte.__getitem__) == example.answer
    return correct / len(task.examples)
