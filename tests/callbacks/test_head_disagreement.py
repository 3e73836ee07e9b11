"""HeadDisagreementProbe: per-site JS divergence between heads, logged as scalars and a bar chart."""

import logging

import numpy as np
import pytest
import torch
from mhar_lightning.callbacks import HeadDisagreementProbe
from mhar_lightning.callbacks.plots import disagreement_figure, to_image
from probe_helpers import log_at_train_end, scalar

from mhar_lightning.module import LanguageModel
from mhar_lightning.probe import run_probe


def test_opposed_heads_disagree_by_one_bit_and_identical_heads_by_zero(tmp_path):
    """Head 0's query at `mlp 0` points along the (all-ones) embedding, head 1's against it."""
    model = LanguageModel(residual={"class_path": "mhar_lightning.residual.MHAR", "init_args": {"heads": 2}})
    model.configure_model()
    half = model.model_config.d_model // 2
    with torch.no_grad():
        model.decoder.embed.weight.fill_(1.0)
        model.decoder.blocks[0].residual.query[1, :half] = 20.0
        model.decoder.blocks[0].residual.query[1, half:] = -20.0
    accumulator = log_at_train_end(tmp_path, model, HeadDisagreementProbe())
    assert scalar(accumulator, "head_js/mlp_0") == pytest.approx(1.0, abs=0.02)
    assert scalar(accumulator, "head_js_query/mlp_0") == pytest.approx(1.0, abs=0.02)
    for site in ("attn_0", "attn_1", "mlp_3", "final"):  # zero queries elsewhere: every head uniform
        assert scalar(accumulator, f"head_js/{site}") == pytest.approx(0.0, abs=1e-6)
        assert scalar(accumulator, f"head_js_query/{site}") == pytest.approx(0.0, abs=1e-6)
    image = accumulator.Images("head_js/per_site")[-1]
    assert image.step == 7 and image.width > 300


def test_single_head_reports_zero_and_says_so(tmp_path, caplog):
    model = LanguageModel(residual="attnres")
    model.configure_model()
    for p in model.decoder.parameters():
        torch.nn.init.normal_(p, std=1.0)  # trained-looking queries: still nothing to disagree with
    with caplog.at_level(logging.INFO):
        accumulator = log_at_train_end(tmp_path, model, HeadDisagreementProbe())
    assert "1 head per site" in caplog.text and "0 by definition" in caplog.text
    values = [scalar(accumulator, tag) for tag in accumulator.Tags()["scalars"] if tag.startswith("head_js")]
    assert len(values) == 2 * 9 and not any(values)
    maps = run_probe(model, torch.randint(0, 256, (1, 5)))
    fig = disagreement_figure(maps)
    assert "H = 1" in fig.axes[0].get_title()
    assert to_image(fig).shape[2] == 3
    np.testing.assert_array_equal(maps.head_js(), 0.0)
