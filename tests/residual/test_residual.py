"""Residual strategies: registry, AttnRes/MHAR equivalences, block bookkeeping, delta identity, memory."""

import pytest
import torch
from mhar_lightning.kernels import ENV_BACKEND, reference
from residual_helpers import randomize_routing
from torch import nn

from mhar_lightning.config import ModelConfig
from mhar_lightning.model import Decoder
from mhar_lightning.residual import (
    MHAR,
    AttnRes,
    DeltaMHAR,
    DepthRouter,
    Residual,
    SumResidual,
    make_residual,
    register_residual,
    residual_name,
)

TINY = ModelConfig.preset("tiny")


def twin_models(a: Residual, b: Residual, config: ModelConfig = TINY) -> tuple[Decoder, Decoder]:
    """Two decoders with identical weights (same seed) but different residual strategies."""
    torch.manual_seed(0)
    first = Decoder(config, a)
    torch.manual_seed(0)
    second = Decoder(config, b)
    return first, second


def backend_device(backend: str) -> torch.device:
    """Where a backend's tests run: the Triton path on the GPU when there is one, else in the CPU interpreter."""
    return torch.device("cuda" if backend == "triton" and torch.cuda.is_available() else "cpu")


class Unnamed(Residual):
    """A strategy registered under no name."""

    def read(self, stream, l):
        return stream[0]

    def write(self, stream, l, y):
        return (stream[0] + y,)


def test_registry_names_and_errors():
    assert isinstance(make_residual("sum"), SumResidual)
    assert make_residual("mhar", heads=4, blocks=2).blocks == 2
    assert residual_name(DeltaMHAR()) == "delta-mhar" and residual_name(Unnamed()) == f"{__name__}.Unnamed"
    with pytest.raises(
        ValueError, match="unknown residual strategy 'mhra'; known: attnres, delta-mhar, hyper-connections, mhar, sum"
    ):
        make_residual("mhra")
    with pytest.raises(ValueError, match=r"^residual \{'heads': 3\} names no strategy; give arguments with its class"):
        make_residual({"heads": 3})  # what `--model.residual mhar --model.residual.init_args.heads 3` passes
    with pytest.raises(ValueError, match="blocks must be >= 1"):
        MHAR(blocks=0)
    with pytest.raises(ValueError, match="blocks=9 exceeds the 8 sublayers"):
        Decoder(TINY, MHAR(blocks=9))
    with pytest.raises(ValueError, match="heads=3 must divide d_model=64"):
        Decoder(TINY, MHAR(heads=3))
    with pytest.raises(ValueError, match="block_size=5 exceeds"):
        Decoder(TINY, DeltaMHAR(block_size=5))


@pytest.mark.parametrize("blocks", [None, 3])
def test_mhar_with_one_head_is_attnres(blocks):
    attnres, mhar = twin_models(AttnRes(blocks=blocks), MHAR(heads=1, blocks=blocks))
    randomize_routing(attnres)
    mhar.load_state_dict(attnres.state_dict())
    tokens = torch.randint(0, TINY.vocab_size, (2, 12))
    assert torch.equal(attnres(tokens), mhar(tokens))


@pytest.mark.parametrize("heads", [2, 4, 16, 32])
def test_other_head_counts_run_and_differ_once_trained(heads):
    one, many = twin_models(MHAR(heads=1), MHAR(heads=heads))
    randomize_routing(one)
    many.load_state_dict(one.state_dict())
    tokens = torch.randint(0, TINY.vocab_size, (2, 12))
    assert not torch.allclose(one(tokens), many(tokens))


def test_zero_queries_route_the_uniform_mean():
    model = Decoder(TINY, MHAR(heads=4, blocks=2))
    router = model.blocks[1].residual
    sources = tuple(torch.randn(2, 5, TINY.d_model) for _ in range(3))
    torch.testing.assert_close(router.read(router.enter(sources, 2), 2), torch.stack(sources).mean(0))
    full = Decoder(TINY, AttnRes()).final_residual
    torch.testing.assert_close(full.finish(sources), torch.stack(sources).mean(0))


class Constant(nn.Module):
    """A sublayer that ignores its input and outputs a fixed tensor."""

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.value = value

    def forward(self, x, *args):
        return self.value.expand_as(x)


def test_block_bookkeeping_follows_design(monkeypatch):
    config = ModelConfig.preset("tiny", n_layers=6)
    model = Decoder(config, MHAR(heads=2, blocks=3))  # 12 sublayers, blocks of 4
    y = [torch.full((config.d_model,), 2.0**l) for l in range(12)]
    for i, block in enumerate(model.blocks):
        block.attn, block.mlp = Constant(y[2 * i]), Constant(y[2 * i + 1])
    seen = {}
    tokens = torch.randint(0, config.vocab_size, (1, 3))
    # every read hands its full list of sources to the capture
    monkeypatch.setattr(DepthRouter, "record_route", lambda self, sources, l, **_: seen.setdefault(l, list(sources)))
    model(tokens)
    emb = model.embed(tokens)

    def block_sum(first, last):
        return sum(y[first : last + 1])

    expected = {0: [emb], 1: [emb, y[0]], 2: [emb, block_sum(0, 1)], 3: [emb, block_sum(0, 2)]}
    expected |= {4: [emb, block_sum(0, 3)], 5: [emb, block_sum(0, 3), y[4]], 7: [emb, block_sum(0, 3), block_sum(4, 6)]}
    expected |= {
        8: [emb, block_sum(0, 3), block_sum(4, 7)],
        11: [emb, block_sum(0, 3), block_sum(4, 7), block_sum(8, 10)],
    }
    expected |= {12: [emb, block_sum(0, 3), block_sum(4, 7), block_sum(8, 11)]}
    for l, sources in expected.items():
        assert len(seen[l]) == len(sources), f"sublayer {l}"
        for got, want in zip(seen[l], sources):
            torch.testing.assert_close(got, want.expand_as(got), msg=f"sublayer {l}")


class DirectMHAR(MHAR):
    """Block MHAR with each sublayer routing over all its sources on its own (no shared pass, no merge)."""

    def enter(self, stream, l):
        return stream

    def read(self, stream, l):
        return self.route(stream, l)

    read_normed = Residual.read_normed  # norm(read(...)): MHAR's own runs its merged reads through merge_norm

    def write(self, stream, l, y):
        return (*stream, y) if l % self.block_len == 0 else (*stream[:-1], stream[-1] + y)


class DirectDeltaMHAR(DeltaMHAR):
    """Delta-MHAR with each sublayer routing on its own (no shared pass)."""

    def enter(self, stream, l):
        return stream

    def read(self, stream, l):
        return stream[0] + self.gate[self.site(l)] * self.route(stream[2:], l)

    def write(self, stream, l, y):
        p, block_start, *sources = stream
        p = p + y
        if (l + 1) % self.block_len == 0:
            return (p, p, *sources, (p - block_start).to(y.dtype))
        return (p, block_start, *sources)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize(
    "n_layers,shared,direct",
    [
        (4, MHAR(heads=4, blocks=2), DirectMHAR(heads=4, blocks=2)),  # blocks of 4: attention reads mid-block
        (3, AttnRes(blocks=2), DirectMHAR(heads=1, blocks=2)),  # blocks of 3: a block starts at an MLP sublayer
        (3, MHAR(heads=2, blocks=None), DirectMHAR(heads=2, blocks=None)),
        (3, DeltaMHAR(heads=4, block_size=2), DirectDeltaMHAR(heads=4, block_size=2)),
    ],
    ids=["mhar-block-4", "attnres-block-3", "mhar-full", "delta"],
)
def test_shared_routing_per_block_equals_routing_each_sublayer(monkeypatch, backend, n_layers, shared, direct):
    """Routing a transformer block's two sublayers in one pass (merging each one's last source) gives the
    same outputs and gradients as routing every sublayer over all its sources by itself."""
    monkeypatch.setenv(ENV_BACKEND, backend)
    config = ModelConfig.preset("tiny", n_layers=n_layers, tie_embeddings=False)
    device = backend_device(backend)
    one, other = (model.to(device) for model in twin_models(shared, direct, config))
    randomize_routing(one)
    other.load_state_dict(one.state_dict())
    tokens = torch.randint(0, config.vocab_size, (2, 3), device=device)  # 6 rows: interpreted programs per route
    outputs = []
    for model in (one, other):
        logits = model(tokens)
        logits.square().mean().backward()
        outputs.append((logits, {n: p.grad for n, p in model.named_parameters()}))
    (a, grads_a), (b, grads_b) = outputs
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grad, grads_b[name], rtol=1e-4, atol=1e-5, msg=name)


def test_delta_mhar_is_bit_identical_to_sum_at_init_then_moves():
    config = ModelConfig.preset("tiny", tie_embeddings=False)
    standard, delta = twin_models(SumResidual(), DeltaMHAR(heads=4, block_size=2), config)
    delta.load_state_dict(standard.state_dict(), strict=False)
    tokens = torch.randint(0, config.vocab_size, (2, 16))
    assert torch.equal(standard(tokens), delta(tokens))
    optimizer = torch.optim.AdamW(delta.parameters(), lr=1e-2)
    nn.functional.cross_entropy(delta(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    assert not torch.equal(standard(tokens), delta(tokens))
    assert all(b.residual.gate.abs().sum() > 0 for b in delta.blocks)


def test_delta_block_deltas_are_stream_differences():
    router = Decoder(ModelConfig.preset("tiny", n_layers=2), DeltaMHAR(heads=2, block_size=1)).blocks[0].residual
    emb = torch.randn(1, 2, 64)
    stream = router.enter((emb, emb, torch.zeros(1, 2, 64), emb), 0)
    y0, y1 = torch.randn(1, 2, 64), torch.randn(1, 2, 64)
    stream = router.write(router.write(stream, 0, y0), 1, y1)
    p, block_start, null, embedding, delta = stream
    torch.testing.assert_close(p, emb + y0 + y1)
    torch.testing.assert_close(delta, (emb + y0 + y1) - emb)
    assert block_start is p and embedding is emb


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_delta_reads_both_sublayers_of_a_block_in_one_route(monkeypatch, backend):
    """`enter` routes the attention and MLP reads of a transformer block together; each read equals
    p + gate * (its own single-query fp64 route over the block's sources)."""
    monkeypatch.setenv(ENV_BACKEND, backend)
    device = backend_device(backend)
    model = Decoder(ModelConfig.preset("tiny", n_layers=2), DeltaMHAR(heads=2, block_size=1)).to(device)
    randomize_routing(model)
    router = model.blocks[1].residual
    assert router.gate.abs().min() > 0 and not torch.equal(router.query[0], router.query[1])
    emb, extra, y0 = (torch.randn(1, 3, 64, device=device) for _ in range(3))
    sources = [torch.randn(64, device=device).expand(1, 3, 64), emb, extra]
    stream = router.enter((emb, emb, *sources), 2)

    def expected(p, l):
        j = router.site(l)
        query, gain = router.query[j].double(), router.key_norm[j].double()
        mix = reference.depth_route([v.double() for v in sources], query, gain, 2)
        return p.double() + router.gate[j].double() * mix

    torch.testing.assert_close(router.read(stream, 2).double(), expected(emb, 2), rtol=1e-5, atol=1e-5)
    stream = router.write(stream, 2, y0)
    torch.testing.assert_close(router.read(stream, 3).double(), expected(emb + y0, 3), rtol=1e-5, atol=1e-5)


def test_delta_block_deltas_take_the_sublayer_output_dtype():
    """Under autocast the stream p stays fp32 while block deltas are stored like the bf16 sublayer outputs."""
    router = Decoder(ModelConfig.preset("tiny", n_layers=2), DeltaMHAR(heads=2, block_size=1)).blocks[0].residual
    emb = torch.randn(1, 2, 64)
    y0, y1 = torch.randn(1, 2, 64).bfloat16(), torch.randn(1, 2, 64).bfloat16()
    stream = router.enter((emb, emb, torch.zeros(1, 2, 64), emb), 0)
    p, _, _, _, delta = router.write(router.write(stream, 0, y0), 1, y1)
    assert p.dtype == torch.float32 and delta.dtype == torch.bfloat16
    torch.testing.assert_close(delta, ((emb + y0 + y1) - emb).bfloat16())


@pytest.mark.parametrize("residual", [MHAR(heads=2, blocks=2), DeltaMHAR(heads=2, block_size=1)], ids=repr)
def test_routing_sources_take_the_autocast_dtype(residual):
    """Under autocast the embedding is routed in bf16 like the sublayer outputs; delta-MHAR's p stays fp32."""
    router = Decoder(ModelConfig.preset("tiny", n_layers=2), residual).final_residual
    emb = torch.randn(1, 2, 64)
    assert all(v.dtype == torch.float32 for v in router.start(emb))
    with torch.autocast("cpu", torch.bfloat16):
        stream = router.start(emb)
    sources = stream if isinstance(residual, MHAR) else stream[2:]
    assert all(v.dtype == torch.bfloat16 for v in sources)
    assert torch.equal(sources[-1], emb.bfloat16())
    if isinstance(residual, DeltaMHAR):
        assert stream[0] is emb and stream[1] is emb


def test_delta_mhar_is_bit_identical_to_sum_at_init_under_autocast():
    config = ModelConfig.preset("tiny", tie_embeddings=False)
    standard, delta = twin_models(SumResidual(), DeltaMHAR(heads=4, block_size=2), config)
    delta.load_state_dict(standard.state_dict(), strict=False)
    tokens = torch.randint(0, config.vocab_size, (2, 16))
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(standard(tokens), delta(tokens))


def saved_bytes(model: Decoder, tokens: torch.Tensor) -> int:
    """Bytes of distinct storages that autograd saves for backward during one forward."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    return sum(storages.values())


@pytest.mark.parametrize("residual", [MHAR(heads=2), DeltaMHAR(heads=2, block_size=1)])
def test_saved_activation_memory_grows_linearly_with_depth(residual):
    tokens = torch.randint(0, 256, (2, 64))
    sizes = []
    for n_layers in (8, 16):
        config = ModelConfig.preset("tiny", d_model=128, n_heads=4, n_layers=n_layers, vocab_size=256)
        sizes.append(saved_bytes(Decoder(config, residual), tokens))
    assert sizes[1] / sizes[0] < 2.3, sizes


@register_residual("test-rezero")
class ReZero(Residual):
    """A user strategy written outside the package: h <- h + alpha_l * y_l with zero-initialised alpha."""

    def build(self, config):
        self.alpha = nn.Parameter(torch.zeros(len(self.sites)))

    def reset_parameters(self):
        if hasattr(self, "alpha"):
            nn.init.zeros_(self.alpha)

    def read(self, stream, l):
        return stream[0]

    def write(self, stream, l, y):
        return (stream[0] + self.alpha[self.site(l)] * y,)


@pytest.mark.parametrize("spec", ["test-rezero", ReZero()])
def test_user_defined_strategy_trains(spec):
    torch.manual_seed(0)
    model = Decoder(TINY, spec)
    tokens = torch.randint(0, TINY.vocab_size, (4, 33))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    assert model.blocks[0].residual.alpha.abs().sum() > 0
