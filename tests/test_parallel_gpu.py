"""`compile_blocks` on a GPU: the compiled no-grad and inference-mode forward of every strategy equals eager at a
deep, study-sized shape, with every weight moved off its initialisation (skipped without CUDA)."""

import pytest
import torch

from mhar_lightning.config import ModelConfig
from mhar_lightning.model import Decoder
from mhar_lightning.parallel import compile_blocks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def fresh_compile_caches() -> None:
    """Each test compiles its own graphs: blocks whose graphs no longer fit the recompile limits run eagerly, and a
    comparison with eager would then pass without testing anything."""
    torch._dynamo.reset()


CONFIG = ModelConfig(vocab_size=256, d_model=192, n_layers=4, n_heads=3, n_kv_heads=1, ffn_hidden=512, max_seq_len=512)
RESIDUALS = {
    "sum": "sum",
    "attnres-full": {"class_path": "mhar_lightning.residual.AttnRes", "init_args": {"blocks": None}},
    "mhar-block": {"class_path": "mhar_lightning.residual.MHAR", "init_args": {"heads": 8, "blocks": 2}},
    "delta-mhar": {"class_path": "mhar_lightning.residual.DeltaMHAR", "init_args": {"heads": 8, "block_size": 2}},
    "hyper-connections": {"class_path": "mhar_lightning.residual.HyperConnections", "init_args": {"rate": 4}},
}


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("name", list(RESIDUALS))
def test_compiled_evaluation_forward_is_as_accurate_as_eager(name: str, mode: str) -> None:
    """bf16 autocast, 16 x 512 tokens: the compiled logits are no further from the fp32 eager logits than the bf16
    eager ones are (relative to their norm; sharp depth softmaxes make bf16 rounding alone worth about 2 %)."""
    torch.manual_seed(0)
    decoder = Decoder(CONFIG, RESIDUALS[name]).cuda()
    with torch.no_grad():
        for param in decoder.parameters():
            param.add_(torch.randn_like(param), alpha=0.3 if param.abs().max() == 0 else 0.3 * param.std().item())
    tokens = torch.randint(0, CONFIG.vocab_size, (16, 512), device="cuda")
    with getattr(torch, mode)():
        exact = decoder(tokens)
        with torch.autocast("cuda", torch.bfloat16):
            eager = decoder(tokens).float()
            compile_blocks(decoder)
            compiled = decoder(tokens).float()
    eager_error, error = ((logits - exact).norm() / exact.norm() for logits in (eager, compiled))
    assert error <= 2 * eager_error + 1e-3, f"compiled {mode} logits off by {error:.3g}, eager bf16 {eager_error:.3g}"
