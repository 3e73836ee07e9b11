"""Task accuracy against a reference that scores each (context, choice) alone, without batching or padding."""

import math

import torch
import torch.nn.functional as F
from eval_helpers import random_decoder

from mhar_lightning.data.tokenizer import load_tokenizer
from mhar_lightning.downstream import Example, Task, load_task, task_accuracy


def reference_accuracy(model, tokenizer, task: Task) -> float:
    correct = 0
    for example in task.examples:
        scores = []
        for choice in example.choices:
            context, continuation = [tokenizer.eot_id, *tokenizer.encode(example.context)], tokenizer.encode(choice)
            tokens = torch.tensor([context + continuation])
            with torch.no_grad():
                logprobs = F.log_softmax(model(tokens[:, :-1])[0], dim=-1)
            picked = logprobs[len(context) - 1 :].gather(-1, torch.tensor(continuation)[:, None]).sum()
            scores.append(float(picked) / len(choice.encode()))
        correct += max(range(len(scores)), key=scores.__getitem__) == example.answer
    return correct / len(task.examples)


def test_batched_padded_scoring_equals_one_choice_at_a_time():
    model, tokenizer = random_decoder("mhar-block"), load_tokenizer("byte")
    task = load_task("python-keywords", max_examples=24)
    want = reference_accuracy(model, tokenizer, task)
    assert task_accuracy(model, tokenizer, task, batch_size=7, max_length=64) == want
    assert want not in (0.0, 1.0)  # a random model gets some right and some wrong


def test_the_choice_with_the_higher_likelihood_per_byte_wins():
    """A model that gives every byte the same probability scores every choice alike per byte, however long: ties go
    to the first choice; a model that prefers one byte picks the choice made of it."""
    tokenizer = load_tokenizer("byte")
    uniform = lambda tokens: torch.zeros(*tokens.shape, 256)  # noqa: E731
    task = Task("t", (Example("x", ("ab", "abcdef"), 0), Example("x", ("abcdef", "ab"), 1)))
    assert task_accuracy(uniform, tokenizer, task, batch_size=4, max_length=64) == 0.5

    def likes_z(tokens):
        logits = torch.zeros(*tokens.shape, 256)
        logits[..., ord("z")] = math.log(10)
        return logits

    task = Task("t", (Example("q", ("zz", "zzzzq", "abc"), 0), Example("q", ("abc", "zzzz"), 1)))
    assert task_accuracy(likes_z, tokenizer, task, batch_size=2, max_length=64) == 1.0
