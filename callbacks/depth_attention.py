"""`DepthAttentionLogger`: where each routing site reads from, as TensorBoard heatmaps, scalars and raw `.npz`."""

import lightning as L
import numpy as np
from mhar_lightning.callbacks.base import ProbeCallback, add_image, log_scalars, tensorboard
from mhar_lightning.callbacks.plots import depth_map_figure, to_image

from mhar_lightning.probe import DepthMaps, tag_name


class DepthAttentionLogger(ProbeCallback):
    """Log where the routing sites of a strategy read from (AttnRes, MHAR, delta-MHAR, hyper-connections, any
    strategy that describes its sources) on a fixed probe batch.

    Every `every_n_steps` optimizer steps and at the end of training it logs, to TensorBoard:

    - the image `depth_attention/mean`: the site x source heatmap of the head average (and at the end of training
      `depth_attention/head_<h>`, one per head: drawing them at every probe would cost more than the probe);
    - scalars per site `depth_entropy/<site>` (nats, mean over heads), `depth_emb_weight/<site>` (where the
      embedding is a source) and `depth_recent_weight/<site>` (head-averaged weight on the embedding / on the
      site's latest source; for weights that are distributions over depth);
    - every scalar the strategy records per site, as `<name>/<site>` scalars and a `<name>/all` histogram
      (delta-MHAR's `delta_gate`, hyper-connections' write weights);

    and saves the raw maps as `<log_dir>/depth_attention/step_<step>.npz` (`DepthMaps.load` reads it back).
    Scalars go to every logger; images and histograms need a TensorBoard logger.

    Args:
        every_n_steps: optimizer steps between probes.
        max_rows: rows of the first validation batch used as the probe (None: the whole batch).
        save_npz: also write the raw weights with their site and source labels.
    """

    def __init__(self, every_n_steps: int = 500, max_rows: int | None = 8, save_npz: bool = True) -> None:
        super().__init__(every_n_steps, max_rows)
        self.save_npz = save_npz

    def write(self, trainer: L.Trainer, maps: DepthMaps, step: int) -> None:
        sites = [tag_name(label) for label in maps.site_labels]
        series = {
            "depth_entropy": maps.entropy(),
            "depth_emb_weight": maps.embedding_weight(),
            "depth_recent_weight": maps.recent_weight(),
            **maps.scalars,
        }
        metrics = {
            f"{name}/{site}": float(v)
            for name, values in series.items()
            if values is not None
            for site, v in zip(sites, values)
            if name not in maps.scalars or not np.isnan(v)  # a scalar that a site does not record
        }
        log_scalars(trainer, metrics, step)
        writer = tensorboard(trainer)
        if writer is not None:
            add_image(writer, "depth_attention/mean", to_image(depth_map_figure(maps, None, f" · step {step}")), step)
            for name, values in maps.scalars.items():
                writer.add_histogram(f"{name}/all", values[~np.isnan(values)], step)
        if self.save_npz:
            maps.save(self.log_dir / "depth_attention" / f"step_{step:07d}.npz")

    def write_final(self, trainer: L.Trainer, maps: DepthMaps, step: int) -> None:
        writer = tensorboard(trainer)
        if writer is None or maps.heads == 1:
            return
        width = len(str(maps.heads - 1))
        for h in range(maps.heads):
            image = to_image(depth_map_figure(maps, h, f" · step {step}"))
            add_image(writer, f"depth_attention/head_{h:0{width}d}", image, step)
