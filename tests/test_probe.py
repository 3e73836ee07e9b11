"""Depth-attention capture and the probe helpers: zero cost when off, hand-set queries, layouts, JS divergence."""

import math

import numpy as np
import pytest
import torch
from residual_helpers import randomize_routing
from torch import nn

from mhar_lightning.config import ModelConfig
from mhar_lightning.model import Decoder
from mhar_lightning.probe import DepthMaps, js_divergence, mean_pairwise_js, routers_of, run_probe
from mhar_lightning.residual import MHAR, DeltaMHAR, HyperConnections, Residual, capture_sites

TINY = ModelConfig.preset("tiny")


def kl_bits(p: np.ndarray, q: np.ndarray) -> float:
    mask = p > 0
    return float(np.sum(p[mask] * np.log2(p[mask] / q[mask])))


def js_bits(p: list[float], q: list[float]) -> float:
    """Textbook JS divergence: 0.5 KL(p || m) + 0.5 KL(q || m), m the mixture."""
    p, q = np.array(p), np.array(q)
    m = 0.5 * (p + q)
    return 0.5 * kl_bits(p, m) + 0.5 * kl_bits(q, m)


def test_capture_is_off_by_default_and_switched_off_after():
    model = Decoder(TINY, MHAR(heads=4))
    routers = routers_of(model)
    assert len(routers) == TINY.n_layers + 1
    assert all(r.capture is None for r in routers)
    with capture_sites(model) as captured:
        model(torch.randint(0, TINY.vocab_size, (1, 5)))
    assert sorted(captured.weights) == sorted(captured.keys) == list(range(TINY.n_sublayers + 1))
    assert captured.weights[3].shape == (4, 4)  # sublayer 3 (mlp 1) sees the embedding and three sublayer outputs
    assert captured.keys[3].shape == (4, TINY.d_model)
    assert all(r.capture is None for r in routers)
    run_probe(model, torch.randint(0, TINY.vocab_size, (1, 5)))
    assert all(r.capture is None for r in routers)


@pytest.mark.parametrize("residual", [MHAR(heads=4), MHAR(heads=2, blocks=3), DeltaMHAR(heads=4, block_size=1)])
def test_capture_changes_neither_loss_nor_gradients(residual):
    torch.manual_seed(0)
    model = Decoder(TINY, residual)
    randomize_routing(model)
    if isinstance(residual, DeltaMHAR):
        with torch.no_grad():
            for block in model.blocks:
                block.residual.gate.fill_(0.5)
    tokens = torch.randint(0, TINY.vocab_size, (2, 9))

    def loss_and_grads():
        model.zero_grad()
        loss = model(tokens).float().logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain_loss, plain_grads = loss_and_grads()
    with capture_sites(model) as captured:
        captured_loss, captured_grads = loss_and_grads()
    assert captured.weights
    assert torch.equal(plain_loss, captured_loss)
    assert plain_grads.keys() == captured_grads.keys()
    assert all(torch.equal(plain_grads[n], captured_grads[n]) for n in plain_grads)


def test_hand_set_queries_put_the_mass_on_the_chosen_source():
    """Every token embeds to all-ones; at `mlp 0` (sources: emb, attn 0) head 0's query points along the
    embedding and head 1's against it, so head 0 reads the embedding and head 1 the attention output."""
    torch.manual_seed(0)
    model = Decoder(TINY, MHAR(heads=2))
    half = TINY.d_model // 2
    with torch.no_grad():
        model.embed.weight.fill_(1.0)
        query = model.blocks[0].residual.query[1]  # sites 0 and 1 live in block 0; row 1 is sublayer 1
        query[:half] = 20.0
        query[half:] = -20.0
    maps = run_probe(model, torch.randint(0, TINY.vocab_size, (2, 7)))
    site = maps.site_labels.index("mlp 0")
    emb, attn0 = maps.source_labels.index("emb"), maps.source_labels.index("attn 0")
    assert maps.weights[site, 0, emb] > 0.99
    assert maps.weights[site, 1, attn0] > 0.99
    assert np.isnan(maps.weights[site, :, attn0 + 1 :]).all()  # nothing later exists at mlp 0
    assert maps.head_js()[site] > 0.95  # nearly disjoint heads: close to 1 bit
    assert maps.query_head_js()[site] > 0.95


def test_zero_init_maps_are_uniform_triangles():
    maps = run_probe(Decoder(TINY, MHAR(heads=4)), torch.randint(0, TINY.vocab_size, (2, 6)))
    n_sources = np.arange(1, TINY.n_sublayers + 2)  # site l sees l + 1 sources; the final read sees all
    assert maps.site_labels == ("attn 0", "mlp 0", "attn 1", "mlp 1", "attn 2", "mlp 2", "attn 3", "mlp 3", "final")
    assert maps.source_labels == ("emb", "attn 0", "mlp 0", "attn 1", "mlp 1", "attn 2", "mlp 2", "attn 3", "mlp 3")
    assert (np.isnan(maps.mean_weights) == np.triu(np.ones((9, 9), bool), k=1)).all()
    np.testing.assert_allclose(maps.entropy(), np.log(n_sources), atol=1e-6)
    np.testing.assert_allclose(maps.embedding_weight(), 1 / n_sources, atol=1e-6)
    np.testing.assert_allclose(maps.recent_weight(), 1 / n_sources, atol=1e-6)
    np.testing.assert_allclose(maps.head_js(), 0.0, atol=1e-9)
    np.testing.assert_allclose(maps.query_head_js(), 0.0, atol=1e-9)


def test_query_view_equals_captured_weights_when_every_token_is_the_same():
    """With identical tokens every source is the same at every position, so the token-mean key is the key."""
    torch.manual_seed(0)
    model = Decoder(TINY, MHAR(heads=4, blocks=3))
    randomize_routing(model)
    maps = run_probe(model, torch.full((2, 6), 7))
    np.testing.assert_allclose(maps.query_weights, maps.weights, atol=1e-5)
    assert maps.head_js().max() > 0.01  # trained-looking queries do disagree


def test_block_and_delta_layouts():
    """Sources per site as DESIGN.md defines them (L = 8 sublayers)."""
    block = run_probe(Decoder(TINY, MHAR(heads=2, blocks=3)), torch.randint(0, 256, (1, 4)))  # blocks of 3 sublayers
    assert block.source_labels == ("emb", "block 1", "block 2", "partial")
    present = {
        label: [block.source_labels[c] for c in np.flatnonzero(~np.isnan(row))]
        for label, row in zip(block.site_labels, block.mean_weights)
    }
    assert present["attn 0"] == ["emb"]
    assert present["mlp 0"] == ["emb", "partial"]
    assert present["mlp 1"] == ["emb", "block 1"]  # sublayer 3 starts block 2: no partial yet
    assert present["attn 2"] == ["emb", "block 1", "partial"]
    assert present["final"] == ["emb", "block 1", "block 2", "partial"]  # block 3 (sublayers 6, 7) is unfinished

    delta = run_probe(Decoder(TINY, DeltaMHAR(heads=2, block_size=1)), torch.randint(0, 256, (1, 4)))
    assert delta.site_labels[-1] == "mlp 3"  # no final routing
    assert delta.source_labels == ("null", "emb", "Δ block 1", "Δ block 2", "Δ block 3")
    assert (~np.isnan(delta.mean_weights)).sum(1).tolist() == [2, 2, 3, 3, 4, 4, 5, 5]
    np.testing.assert_array_equal(delta.scalars["delta_gate"], np.zeros(TINY.n_sublayers))


def test_js_divergence_against_hand_computed_values():
    assert js_divergence(np.array([1.0, 0.0]), np.array([0.0, 1.0])) == pytest.approx(1.0)
    p, q = [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]
    expected = 1.5 - 0.75 * math.log2(3)  # 0.311278...
    assert js_bits(p, q) == pytest.approx(expected)
    assert js_divergence(np.array(p), np.array(q)) == pytest.approx(expected)
    heads = np.array([[0.2, 0.3, 0.5], [0.2, 0.3, 0.5]])
    assert mean_pairwise_js(heads) == pytest.approx(0.0, abs=1e-12)
    three = [[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [1 / 3, 1 / 3, 1 / 3]]
    pairs = [js_bits(three[i], three[j]) for i, j in ((0, 1), (0, 2), (1, 2))]
    assert mean_pairwise_js(np.array(three)) == pytest.approx(np.mean(pairs))
    assert mean_pairwise_js(np.array([[0.3, 0.7]])) == 0.0  # one head: nothing to disagree with
    with_absent = np.array([[0.5, 0.5, np.nan], [1.0, 0.0, np.nan]])
    assert mean_pairwise_js(with_absent) == pytest.approx(js_bits([0.5, 0.5], [1.0, 0.0]))


def test_npz_round_trip_keeps_labels(tmp_path):
    maps = run_probe(Decoder(TINY, DeltaMHAR(heads=2, block_size=2)), torch.randint(0, 256, (1, 4)))
    loaded = DepthMaps.load(maps.save(tmp_path / "maps.npz"))
    assert loaded.site_labels == maps.site_labels and loaded.source_labels == maps.source_labels
    np.testing.assert_array_equal(loaded.weights, maps.weights)
    np.testing.assert_array_equal(loaded.scalars["delta_gate"], maps.scalars["delta_gate"])
    streams = run_probe(Decoder(TINY, HyperConnections(rate=2)), torch.randint(0, 256, (1, 4)))
    assert loaded.distributions and not DepthMaps.load(streams.save(tmp_path / "streams.npz")).distributions


class EmbeddingMix(Residual):
    """A user strategy outside the kit: each sublayer reads softmax(w_l) over [embedding, running sum]."""

    def build(self, config):
        self.logits = nn.Parameter(torch.zeros(len(self.sites), 2))

    def start(self, embedding):
        return (embedding, embedding)

    def read(self, stream, l):
        weights = torch.softmax(self.logits[self.site(l)], -1) if l < self.n_sublayers else torch.tensor([0.0, 1.0])
        if self.capture is not None:
            self.record(l, weights[None], temperature=weights.max())
        return weights[0] * stream[0] + weights[1] * stream[1]

    def write(self, stream, l, y):
        return (stream[0], stream[1] + y)

    def source_labels(self):
        return ("emb", "sum")


def test_a_user_strategy_describes_its_own_sources_and_scalars():
    model = Decoder(TINY, EmbeddingMix())
    with torch.no_grad():
        model.blocks[1].residual.logits[0] = torch.tensor([2.0, 0.0])  # attn 1 leans on the embedding
    maps = run_probe(model, torch.randint(0, TINY.vocab_size, (1, 5)))
    assert maps.source_labels == ("emb", "sum") and maps.site_labels[-1] == "final" and maps.query_weights is None
    attn1 = maps.site_labels.index("attn 1")
    np.testing.assert_allclose(maps.mean_weights[attn1], [1 / (1 + math.exp(-2)), 1 / (1 + math.exp(2))], rtol=1e-6)
    np.testing.assert_allclose(maps.embedding_weight()[[0, -1]], [0.5, 0.0])
    np.testing.assert_allclose(maps.scalars["temperature"][attn1], 1 / (1 + math.exp(-2)), rtol=1e-6)
