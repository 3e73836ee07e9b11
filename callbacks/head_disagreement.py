"""`HeadDisagreementProbe`: do MHAR's heads route differently? (mean pairwise JS divergence per site)."""

import lightning as L
from lightning.pytorch.utilities import rank_zero_info
from mhar_lightning.callbacks.base import ProbeCallback, add_image, log_scalars, tensorboard
from mhar_lightning.callbacks.plots import disagreement_figure, to_image

from mhar_lightning.probe import DepthMaps, tag_name


class HeadDisagreementProbe(ProbeCallback):
    """The MHAR mechanism check: per routing site, the mean pairwise Jensen-Shannon divergence (bits, 0..1)
    between the H heads' depth distributions, from two views:

    - `head_js/<site>`: between the captured weights (each head's softmax, averaged over the probe's tokens);
    - `head_js_query/<site>`: between the distributions the trained queries imply on their own: each head's
      query chunk (key gain folded in) against the probe's token-mean RMS-normalised source keys.

    Both are logged (the second for query-based strategies only) as scalars, and at the end of training as a
    per-site bar chart image `head_js/per_site`. With one head (AttnRes, hyper-connections) heads cannot disagree:
    it logs 0 and says so once. Same schedule and probe batch (and forward) as `DepthAttentionLogger`.

    Args:
        every_n_steps: optimizer steps between probes.
        max_rows: rows of the first validation batch used as the probe (None: the whole batch).
    """

    def __init__(self, every_n_steps: int = 500, max_rows: int | None = 8) -> None:
        super().__init__(every_n_steps, max_rows)
        self._told_single_head = False

    def write(self, trainer: L.Trainer, maps: DepthMaps, step: int) -> None:
        captured, from_queries = maps.head_js(), maps.query_head_js()
        if maps.heads == 1 and not self._told_single_head:
            rank_zero_info("HeadDisagreementProbe: 1 head per site, so head disagreement is 0 by definition.")
            self._told_single_head = True
        sites = [tag_name(label) for label in maps.site_labels]
        metrics = {f"head_js/{site}": float(v) for site, v in zip(sites, captured)}
        if from_queries is not None:
            metrics.update({f"head_js_query/{site}": float(v) for site, v in zip(sites, from_queries)})
        log_scalars(trainer, metrics, step)

    def write_final(self, trainer: L.Trainer, maps: DepthMaps, step: int) -> None:
        writer = tensorboard(trainer)
        if writer is not None:
            add_image(writer, "head_js/per_site", to_image(disagreement_figure(maps, f" · step {step}")), step)
