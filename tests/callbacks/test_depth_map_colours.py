"""Depth maps' colours: softmax weights on the fixed 0..1 scale, learned weights of any sign on a diverging scale
centred at 0 and symmetric, so a negative weight never looks like a zero one."""

import numpy as np
import pytest

from mhar_lightning.callbacks.plots import depth_grid_figure, depth_map_figure
from mhar_lightning.probe import DepthMaps


def maps_of(weights: list[list[list[float]]], distributions: bool) -> DepthMaps:
    """Maps of two sites over two sources, `weights[site][head][source]`."""
    array = np.array(weights, dtype=float)
    return DepthMaps(
        sites=(0, 1),
        site_labels=("attn_0", "final"),
        source_labels=("stream 0", "stream 1"),
        weights=array,
        distributions=distributions,
    )


def norms(fig) -> list[tuple[str, float, float]]:
    """(colour map, lower end, upper end) of every heatmap panel of `fig`."""
    return [(image.get_cmap().name, image.norm.vmin, image.norm.vmax) for ax in fig.axes for image in ax.images]


SIGNED = [[[1.0, -1.5]], [[0.25, 0.5]]]  # hyper-connections' read weights after training: one is negative


@pytest.mark.parametrize("figure", [depth_map_figure, depth_grid_figure])
def test_a_map_with_negative_weights_is_centred_at_zero_with_a_symmetric_range(figure) -> None:
    fig = figure(maps_of(SIGNED, distributions=False))
    assert norms(fig) == [("RdBu_r", -1.5, 1.5)]  # the largest |weight| is 1.5
    image = fig.axes[0].images[0]
    assert image.norm(0.0) == 0.5  # zero sits mid-scale
    assert not np.allclose(image.to_rgba(-1.5), image.to_rgba(0.0))  # a negative weight is not zero's colour
    assert not np.allclose(image.to_rgba(-1.0), image.to_rgba(1.0))  # nor a positive one's


def test_learned_weights_keep_a_symmetric_range_of_at_least_one_without_negatives() -> None:
    identity = [[[1.0, 0.0]], [[0.5, 0.5]]]  # hyper-connections at initialisation
    assert norms(depth_map_figure(maps_of(identity, distributions=False))) == [("RdBu_r", -1.0, 1.0)]


def test_softmax_maps_keep_the_fixed_zero_to_one_scale() -> None:
    softmax = [[[0.9, np.nan]], [[0.25, 0.75]]]
    assert norms(depth_map_figure(maps_of(softmax, distributions=True))) == [("viridis", 0.0, 1.0)]
