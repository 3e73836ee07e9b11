"""Hyper-connections: the `sum` model at init, the math against an fp64 reference, gradients against finite differences,
compile, and through `mhar fit`: the weights train, checkpoints rebuild the model and a resumed run is exact."""

from pathlib import Path

import pytest
import torch
from cli_helpers import corpus_cache, fast_demo_args, final_weights, scalars
from mhar_lightning.callbacks.plots import caption
from torch import nn

from mhar_lightning.cli import main
from mhar_lightning.commands.inspect import main as inspect
from mhar_lightning.config import ModelConfig
from mhar_lightning.model import Decoder
from mhar_lightning.module import LanguageModel
from mhar_lightning.probe import run_probe
from mhar_lightning.residual import HyperConnections, make_residual

TINY = ModelConfig.preset("tiny")
N, K = 6, 3
HC = ["--model.residual", "hyper-connections"]
STOP = ["--trainer.callbacks+=cli_helpers.StopAtStep", f"--trainer.callbacks.step={K}"]


def hc_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if "residual" in n}


@pytest.mark.parametrize("dynamic", [True, False])
@pytest.mark.parametrize("rate", [1, 4])
def test_logits_equal_the_sum_model_at_init(rate: int, dynamic: bool) -> None:
    torch.manual_seed(0)
    reference = Decoder(TINY, "sum").double()
    torch.manual_seed(0)
    model = Decoder(TINY, HyperConnections(rate=rate, dynamic=dynamic)).double()
    missing = model.load_state_dict(reference.state_dict(), strict=False).missing_keys
    assert missing and all("residual" in name for name in missing)  # the same weights; only the HC ones added
    tokens = torch.randint(0, TINY.vocab_size, (2, 11))
    torch.testing.assert_close(model(tokens), reference(tokens), rtol=1e-13, atol=1e-13)


def test_added_parameters_are_the_per_site_weights() -> None:
    """Per sublayer A_m (n), A_r (n x n) and B (n); dynamic adds W (d x (n + 2)) and two scales; the final read none."""
    n, d, sites = 4, TINY.d_model, TINY.n_sublayers
    static, dynamic = (Decoder(TINY, HyperConnections(dynamic=flag)) for flag in (False, True))
    assert sum(p.numel() for p in hc_parameters(static).values()) == sites * (n + n * n + n)
    assert sum(p.numel() for p in hc_parameters(dynamic).values()) == sites * (n + n * n + n + d * (n + 2) + 2)


def reference_sublayer(
    streams: torch.Tensor, f, read_offset, mix_offset, write_offset, proj, scale, l: int, eps: float
) -> torch.Tensor:
    """One sublayer of Zhu et al.'s dynamic hyper-connections on stacked streams [..., n, d], in fp64 einsums."""
    n = streams.shape[-2]
    normed = streams * torch.rsqrt(streams.square().mean(-1, keepdim=True) + eps)
    terms = torch.tanh(torch.einsum("...jd,de->...je", normed, proj))
    eye = torch.eye(n, dtype=streams.dtype)
    a_m = eye[l % n] + read_offset + scale[0] * terms[..., 0]
    a_r = eye + mix_offset + scale[0] * terms[..., 1 : n + 1]
    b = 1 + write_offset + scale[1] * terms[..., n + 1]
    y = f(torch.einsum("...j,...jd->...d", a_m, streams))
    return b[..., :, None] * y[..., None, :] + torch.einsum("...jk,...jd->...kd", a_r, streams)


class OneBlock(nn.Module):
    """The two sublayers of transformer block 0 through a hyper-connection router, with a fixed nonlinear sublayer."""

    def __init__(self, config: ModelConfig, rate: int) -> None:
        super().__init__()
        self.router = HyperConnections(rate=rate).spawn(config, range(0, 2))
        self.sublayer = nn.Linear(config.d_model, config.d_model, dtype=torch.float64)

    def f(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.sublayer(x))

    def forward(self, *streams: torch.Tensor) -> torch.Tensor:
        stream = self.router.enter(streams, 0)
        for l in (0, 1):
            stream = self.router.write(stream, l, self.f(self.router.read(stream, l)))
        return torch.stack(stream, -2)


def random_block(config: ModelConfig, rate: int = 3) -> OneBlock:
    torch.manual_seed(0)
    block = OneBlock(config, rate).double()
    with torch.no_grad():
        for p in block.router.parameters():
            p.normal_(std=0.5)
    return block


def test_router_matches_the_reference_math_with_trained_weights() -> None:
    config = ModelConfig.preset("tiny", d_model=16, n_heads=2)
    block = random_block(config)
    streams = torch.randn(2, 5, 3, 16, dtype=torch.float64)
    r = block.router
    expected = streams
    for l in (0, 1):
        weights = (r.read_offset[l], r.mix_offset[l], r.write_offset[l], r.dynamic_proj[l], r.dynamic_scale[l])
        expected = reference_sublayer(expected, block.f, *weights, l, config.norm_eps)
    torch.testing.assert_close(block(*streams.unbind(-2)), expected, rtol=1e-12, atol=1e-12)


def test_dynamic_weight_gradients_match_finite_differences() -> None:
    """fp64 gradcheck of both sublayers' outputs with respect to every router parameter and the streams."""
    config = ModelConfig.preset("tiny", d_model=8, n_heads=2)
    block = random_block(config)
    names = [name for name, _ in block.named_parameters() if name.startswith("router.")]
    assert {"router.dynamic_proj", "router.dynamic_scale"} <= set(names)
    params = tuple(block.get_parameter(name).detach().clone().requires_grad_() for name in names)
    streams = tuple(torch.randn(1, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def run(*inputs: torch.Tensor) -> torch.Tensor:
        weights = dict(zip(names, inputs[: len(names)]))
        return torch.func.functional_call(block, weights, inputs[len(names) :])

    assert torch.autograd.gradcheck(run, params + streams)


def test_compiled_block_traces_whole_and_matches_eager() -> None:
    torch.manual_seed(0)
    model = Decoder(ModelConfig.preset("tiny", n_layers=1), HyperConnections())  # one block: one compile
    with torch.no_grad():
        for p in hc_parameters(model).values():
            p.normal_(std=0.1)
    tokens = torch.randint(0, TINY.vocab_size, (2, 9))
    eager = model(tokens)
    eager.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in hc_parameters(model).items()}
    model.zero_grad()
    for block in model.blocks:
        block.compile(fullgraph=True, backend="aot_eager")  # a graph break would raise
    compiled = model(tokens)
    compiled.square().mean().backward()
    torch.testing.assert_close(compiled, eager)
    for name, p in hc_parameters(model).items():
        torch.testing.assert_close(p.grad, grads[name], msg=name)


def test_probe_shows_read_weights_over_streams_and_write_weights() -> None:
    maps = run_probe(Decoder(TINY, HyperConnections(rate=4)), torch.randint(0, TINY.vocab_size, (2, 6)))
    assert maps.source_labels == ("stream 0", "stream 1", "stream 2", "stream 3") and maps.heads == 1
    expected = torch.eye(4)[[l % 4 for l in range(TINY.n_sublayers)]].tolist() + [[0.25] * 4]  # one-hot, then mean
    assert maps.mean_weights.tolist() == expected
    assert maps.query_weights is None and maps.embedding_weight() is None
    assert sorted(maps.scalars) == ["hc_mix_cross", "hc_mix_self", *(f"hc_write_{k}" for k in range(4))]
    assert maps.scalars["hc_write_2"][:-1].tolist() == [1.0] * TINY.n_sublayers  # B = 1; the final read writes none
    assert maps.scalars["hc_mix_self"][0] == 1.0 and maps.scalars["hc_mix_cross"][0] == 0.0  # A_r = I
    assert "sums to 1" not in caption(maps, 6.0) and "any sign" in caption(maps, 6.0)  # read weights are not a softmax
    assert maps.entropy() is None and maps.recent_weight() is None  # nor have their entropy or a latest stream


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, stdlib_cache: Path) -> tuple[Path, Path]:
    """`mhar fit` with hyper-connections: N steps in one go, and stopped after K then resumed to N."""
    root = tmp_path_factory.mktemp("hc")
    full, resumed = root / "full", root / "resumed"
    with corpus_cache(stdlib_cache):
        main(fast_demo_args(full, N) + HC)
        main(fast_demo_args(resumed, N) + HC + STOP)
        main(fast_demo_args(resumed, N) + HC + ["--ckpt_path", "last"])
    return full, resumed


def test_fit_trains_the_hyper_connection_weights(runs: tuple[Path, Path]) -> None:
    weights = final_weights(runs[0])
    assert weights.keys() >= {"decoder.blocks.0.residual.read_offset", "decoder.blocks.3.residual.dynamic_proj"}
    for name, value in weights.items():
        if ".residual." in name:  # every one starts at zeros or 0.01 (the scales)
            assert not torch.equal(value, torch.full_like(value, 0.01 if "scale" in name else 0.0)), name


def test_checkpoint_rebuilds_the_model_and_resume_is_exact(runs: tuple[Path, Path]) -> None:
    full, resumed = runs
    loaded = LanguageModel.load_from_checkpoint(full / "checkpoints" / "last.ckpt", map_location="cpu")
    assert loaded.hparams["residual"] == make_residual("hyper-connections").spec()
    for name, value in final_weights(full).items():
        assert torch.equal(loaded.state_dict()[name], value), name
    reference, after_resume = scalars(full, "train/loss"), scalars(resumed, "train/loss", version=-1)
    assert after_resume == {step: reference[step] for step in range(K, N)}
    want, got = final_weights(full), final_weights(resumed)
    assert want.keys() == got.keys() and all(torch.equal(got[name], want[name]) for name in want)


def test_inspect_shows_streams_and_write_weights(runs: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    text = tmp_path / "probe.txt"
    text.write_text("def hyper(connections):\n    return streams\n" * 20)
    checkpoint = runs[0] / "checkpoints" / "last.ckpt"
    assert inspect([str(checkpoint), "--out", str(tmp_path / "maps.png"), "--text", str(text), "--rows", "2"]) == 0
    printed = capsys.readouterr().out
    for label in ("attn 0", "final", "stream", "hc_write", "hc_mix_cross"):
        assert label in printed
    assert "entropy" not in printed and "recent" not in printed and "top source" in printed
    assert (tmp_path / "maps.png").stat().st_size > 0
