"""DepthAttentionLogger: TensorBoard tags after `mhar fit` on the demo, delta gates, heatmap layout, rank-0 writing."""

from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import DDP_STEPS
from mhar_lightning.callbacks import DepthAttentionLogger
from mhar_lightning.callbacks.plots import CMAP, NORM, depth_map_figure, to_image
from probe_helpers import RecordingLogger, events, fake_trainer, log_at_train_end, scalar

from mhar_lightning.module import LanguageModel
from mhar_lightning.probe import DepthMaps

DELTA_SPEC = {"class_path": "mhar_lightning.residual.DeltaMHAR", "init_args": {"heads": 2, "block_size": 1}}


def test_demo_fit_logs_maps_and_scalars(small_demo_run: Path):
    log_dir = small_demo_run / "tensorboard" / "version_0"  # 3 steps: the recipe's loggers probe at the end
    accumulator = events(log_dir)
    tags = accumulator.Tags()
    assert {f"depth_attention/head_{h}" for h in range(4)} | {"depth_attention/mean"} <= set(tags["images"])
    for name in ("depth_entropy", "depth_emb_weight", "depth_recent_weight", "head_js", "head_js_query"):
        assert {f"{name}/attn_0", f"{name}/mlp_3", f"{name}/final"} <= set(tags["scalars"])
    image = accumulator.Images("depth_attention/mean")[-1]
    assert image.step == 3 and image.width > 300 and image.height > 300
    saved = DepthMaps.load(log_dir / "depth_attention" / "step_0000003.npz")
    assert saved.site_labels[-1] == "final" and saved.heads == 4
    assert scalar(accumulator, "depth_emb_weight/attn_0") == pytest.approx(1.0)  # the first sublayer sees only emb


def test_two_ddp_ranks_probe_together_into_one_run(ddp_demo_run: Path):
    """`mhar fit` on 2 DDP processes (gloo, CPU; conftest's `ddp_demo_run`): both ranks run the probes (a collective)
    without deadlock, and the run has one TensorBoard folder and one `.npz`. Its weights are the mean over ranks of
    softmax maps, so each site's still sum to 1 (a sum over ranks would give 2)."""
    runs = sorted((ddp_demo_run / "tensorboard").iterdir())
    npz = f"step_{DDP_STEPS:07d}.npz"
    assert [run.name for run in runs] == ["version_0"]
    assert sorted(p.name for p in (runs[0] / "depth_attention").iterdir()) == [npz]
    saved = DepthMaps.load(runs[0] / "depth_attention" / npz)
    np.testing.assert_allclose(np.nansum(saved.weights, axis=-1), 1.0, rtol=1e-5)
    tags = events(runs[0]).Tags()
    assert "depth_attention/mean" in tags["images"] and "head_js/final" in tags["scalars"]


def test_delta_gates_are_logged_as_scalars_and_histogram(tmp_path):
    model = LanguageModel(residual=DELTA_SPEC)
    model.configure_model()
    gates = torch.linspace(-0.4, 0.3, model.model_config.n_sublayers)
    with torch.no_grad():
        for i, block in enumerate(model.decoder.blocks):
            block.residual.gate.copy_(gates[2 * i : 2 * i + 2])
    accumulator = log_at_train_end(tmp_path, model, DepthAttentionLogger())
    assert {"depth_attention/head_0", "depth_attention/head_1", "depth_attention/mean"} <= set(
        accumulator.Tags()["images"]
    )
    assert scalar(accumulator, "delta_gate/attn_0") == pytest.approx(-0.4)
    assert scalar(accumulator, "delta_gate/mlp_3") == pytest.approx(0.3)
    histogram = accumulator.Histograms("delta_gate/all")[-1].histogram_value
    assert histogram.num == 8 and histogram.min == pytest.approx(-0.4) and histogram.max == pytest.approx(0.3)


def test_heatmap_has_sites_top_down_sources_left_to_right(tmp_path):
    weights = np.array([[1.0, np.nan, np.nan], [0.0, 1.0, np.nan], [0.25, 0.0, 0.75]])[:, None, :]
    maps = DepthMaps((0, 1, 8), ("attn 0", "mlp 0", "final"), ("emb", "attn 0", "mlp 0"), weights, weights)
    fig = depth_map_figure(maps, head=0)
    image = to_image(fig)
    width, height = fig.get_size_inches() * fig.dpi
    assert image.shape == (round(height), round(width), 3) and image.dtype == np.uint8
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["attn 0", "mlp 0", "final"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["emb", "attn 0", "mlp 0"]

    def pixel(row: int, col: int) -> tuple[int, int]:
        """Image (row, column) of a point inside cell (site row, source col), away from its number."""
        x, y = ax.transData.transform((col + 0.3, row + 0.3))
        return image.shape[0] - round(y), round(x)

    top_row, _ = pixel(0, 0)
    bottom_row, _ = pixel(2, 0)
    _, left_col = pixel(0, 0)
    _, right_col = pixel(0, 2)
    assert top_row < image.shape[0] / 2 < bottom_row  # site 0 at the top, the final read at the bottom
    assert left_col < image.shape[1] / 2 < right_col  # the embedding on the left
    for (row, col), value in np.ndenumerate(weights[:, 0]):
        colour = image[pixel(row, col)].astype(int)
        if np.isnan(value):
            assert max(colour) - min(colour) < 10 and min(colour) > 150  # blank: light grey, not a weight colour
        else:
            expected = np.array(matplotlib_colour(value))
            assert np.abs(colour - expected).max() <= 3, (row, col, colour, expected)


def matplotlib_colour(value: float) -> tuple[int, int, int]:
    import matplotlib

    r, g, b, _ = matplotlib.colormaps[CMAP](NORM(value))
    return round(r * 255), round(g * 255), round(b * 255)


@pytest.mark.parametrize("rank", [0, 1])
def test_every_rank_reduces_and_only_rank_zero_writes(tmp_path, rank):
    model = LanguageModel(residual="mhar")
    model.configure_model()
    batch = torch.randint(0, 256, (3, 9))
    logger = RecordingLogger()
    trainer = fake_trainer(tmp_path, batch, rank=rank, world_size=2, loggers=[logger])
    callback = DepthAttentionLogger()
    callback.setup(trainer, model, "fit")
    callback.on_train_end(trainer, model)
    assert len(trainer.strategy.reduced) == 1  # weights and keys of every site, packed into one collective
    npz = tmp_path / "depth_attention" / "step_0000007.npz"
    assert npz.exists() == (rank == 0)
    assert bool(logger.metrics) == (rank == 0)
    if rank == 0:
        step, metrics = logger.metrics[0]
        assert step == 7 and metrics["depth_emb_weight/mlp_0"] == pytest.approx(0.25)  # 0.5 here, 0 on the other rank
