"""`compile_blocks` on a GPU: the compiled no-grad and inference-mode forward, and the compiled training gradients,
of every strategy are as accurate as eager ones at a deep, study-sized shape, with every weight moved off its
initialisation (skipped without CUDA)."""

import pytest
import torch

from mhar_lightning.config import ModelConfig
from mhar_lightning.model import Decoder
from mhar_lightning.parallel import compile_blocks

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("fresh_compile_caches"),
]

CONFIG = ModelConfig(vocab_size=256, d_model=192, n_layers=4, n_heads=3, n_kv_heads=1, ffn_hidden=512, max_seq_len=512)
RESIDUALS = {
    "sum": "sum",
    "attnres-full": {"class_path": "mhar_lightning.residual.AttnRes", "init_args": {"blocks": None}},
    "mhar-block": {"class_path": "mhar_lightning.residual.MHAR", "init_args": {"heads": 8, "blocks": 2}},
    "delta-mhar": {"class_path": "mhar_lightning.residual.DeltaMHAR", "init_args": {"heads": 8, "block_size": 2}},
    "hyper-connections": {"class_path": "mhar_lightning.residual.HyperConnections", "init_args": {"rate": 4}},
}


def moved_decoder(name: str) -> Decoder:
    """The `CONFIG` decoder of strategy `name` on the GPU, every weight moved off its initialisation (where every
    strategy equals `sum`)."""
    torch.manual_seed(0)
    decoder = Decoder(CONFIG, RESIDUALS[name]).cuda()
    with torch.no_grad():
        for param in decoder.parameters():
            param.add_(torch.randn_like(param), alpha=0.3 if param.abs().max() == 0 else 0.3 * param.std().item())
    return decoder


def relative_error(value: torch.Tensor, exact: torch.Tensor) -> float:
    return float((value.float() - exact).norm() / exact.norm())


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("name", list(RESIDUALS))
def test_compiled_evaluation_forward_is_as_accurate_as_eager(name: str, mode: str) -> None:
    """bf16 autocast, 16 x 512 tokens: the compiled logits are no further from the fp32 eager logits than the bf16
    eager ones are (relative to their norm; sharp depth softmaxes make bf16 rounding alone worth about 2 %)."""
    decoder = moved_decoder(name)
    tokens = torch.randint(0, CONFIG.vocab_size, (16, 512), device="cuda")
    with getattr(torch, mode)():
        exact = decoder(tokens)
        with torch.autocast("cuda", torch.bfloat16):
            eager = decoder(tokens).float()
            compile_blocks(decoder)
            compiled = decoder(tokens).float()
    eager_error, error = (relative_error(logits, exact) for logits in (eager, compiled))
    assert error <= 2 * eager_error + 1e-3, f"compiled {mode} logits off by {error:.3g}, eager bf16 {eager_error:.3g}"


@pytest.mark.parametrize("name", list(RESIDUALS))
def test_compiled_training_gradients_are_as_accurate_as_eager(name: str) -> None:
    """bf16 autocast, 4 x 512 tokens: the compiled gradients are no further from the fp32 eager ones than the bf16
    eager ones are, over all parameters together (x2) and parameter by parameter (x4, each relative to that
    gradient's norm with a floor of 1e-3 of the largest norm: one parameter's bf16 error is a single draw, and
    equally valid roundings differ by about 2x; a wrong graph is off by its whole gradient)."""
    decoder = moved_decoder(name)
    tokens = torch.randint(0, CONFIG.vocab_size, (4, 513), device="cuda")

    def gradients(autocast: bool) -> dict[str, torch.Tensor]:
        decoder.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            logits = decoder(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
        return {n: p.grad.detach().clone() for n, p in decoder.named_parameters()}

    exact, eager = gradients(autocast=False), gradients(autocast=True)
    compile_blocks(decoder)
    compiled = gradients(autocast=True)
    flat = [torch.cat([g.flatten() for g in grads.values()]) for grads in (exact, eager, compiled)]
    eager_error, error = (relative_error(grads, flat[0]) for grads in flat[1:])
    assert error <= 2 * eager_error + 1e-3, f"compiled gradients off by {error:.3g}, eager bf16 {eager_error:.3g}"
    floor = 1e-3 * max(g.norm() for g in exact.values())
    off = []
    for param, exact_grad in exact.items():
        scale = torch.maximum(exact_grad.norm(), floor)
        eager_error = float((eager[param] - exact_grad).norm() / scale)
        error = float((compiled[param] - exact_grad).norm() / scale)
        if error > 4 * eager_error + 1e-3:
            off.append(f"{param} {error:.3g} (eager bf16 {eager_error:.3g})")
    assert not off, "compiled gradients off: " + ", ".join(off)
