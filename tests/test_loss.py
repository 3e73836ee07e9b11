"""Chunked fp32 cross-entropy against `F.cross_entropy` on the full logits."""

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch._dynamo.utils import maybe_enable_compiled_autograd

from mhar_lightning.loss import chunked_cross_entropy


def inputs(ignore: bool, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor]:
    """Hidden states [3, 7, 16], an LM head [50, 16] and targets, some set to the ignore index -100."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 7, 16, generator=gen).to(dtype)
    weight = torch.randn(50, 16, generator=gen).to(dtype)
    targets = torch.randint(0, 50, (3, 7), generator=gen)
    if ignore:
        targets[0, :4] = -100
        targets[2, 6] = -100
    return hidden, weight, targets


def loss_and_grads(loss_fn, hidden: Tensor, weight: Tensor) -> list[Tensor]:
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = loss_fn(hidden, weight)
    loss.backward()
    return [loss.detach(), hidden.grad, weight.grad]


@pytest.mark.parametrize("chunk_tokens", [1, 4, 21, 4096])
@pytest.mark.parametrize("ignore", [False, True])
def test_chunked_loss_and_grads_equal_full_cross_entropy(chunk_tokens: int, ignore: bool) -> None:
    hidden, weight, targets = inputs(ignore)
    full = loss_and_grads(lambda h, w: F.cross_entropy((h @ w.T).flatten(0, 1), targets.flatten()), hidden, weight)
    chunked = loss_and_grads(lambda h, w: chunked_cross_entropy(h, w, targets, chunk_tokens), hidden, weight)
    for want, got in zip(full, chunked):
        torch.testing.assert_close(got, want)


def test_without_grad_equals_full_cross_entropy() -> None:
    hidden, weight, targets = inputs(ignore=True)
    with torch.no_grad():
        loss = chunked_cross_entropy(hidden, weight, targets, chunk_tokens=5)
    torch.testing.assert_close(loss, F.cross_entropy((hidden @ weight.T).flatten(0, 1), targets.flatten()))


def test_loss_is_fp32_for_bf16_inputs() -> None:
    hidden, weight, targets = inputs(ignore=False, dtype=torch.bfloat16)
    loss = chunked_cross_entropy(hidden, weight, targets, chunk_tokens=3)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy((hidden @ weight.T).float().flatten(0, 1), targets.flatten()))


def test_autocast_grads_match_full_cross_entropy() -> None:
    """Under bf16 autocast (fp32 inputs, as Lightning's bf16-mixed runs it) the backward's matmuls run in bf16 like
    the forward's, and the gradients come back in the inputs' dtype."""
    hidden, weight, targets = inputs(ignore=True)

    def full(h: Tensor, w: Tensor) -> Tensor:
        return F.cross_entropy((h @ w.T).float().flatten(0, 1), targets.flatten())

    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = loss_and_grads(full, hidden, weight)
        got = loss_and_grads(lambda h, w: chunked_cross_entropy(h, w, targets, chunk_tokens=4), hidden, weight)
    for a, b in zip(want, got):
        assert b.dtype == torch.float32
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-3)


def test_compiled_autograd_captures_the_backward_whole(monkeypatch) -> None:
    """Several chunks, one captured backward graph: nothing in the loss's backward breaks compiled autograd's
    capture (activation checkpoint's saved-tensor hooks split it into several). The captured graph runs as traced,
    not through Inductor, whose C++ build of it takes most of a minute on a CPU."""
    monkeypatch.setattr(torch._inductor, "compile", lambda graph, inputs: graph)
    hidden, weight, targets = inputs(ignore=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with maybe_enable_compiled_autograd(True, fullgraph=False, dynamic=False):
        got = loss_and_grads(lambda h, w: chunked_cross_entropy(h, w, targets, chunk_tokens=8), hidden, weight)
    assert dict(torch._dynamo.utils.counters["compiled_autograd"]) == {"captures": 1, "compiles": 1}
    want = loss_and_grads(lambda h, w: F.cross_entropy((h @ w.T).flatten(0, 1), targets.flatten()), hidden, weight)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a)
