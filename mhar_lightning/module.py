"""The LightningModule: next-token training of a `Decoder` with a pluggable residual strategy."""

import math
from dataclasses import asdict
from typing import Any

import lightning as L
import torch
from torch import Tensor

from mhar_lightning.config import ModelConfig
from mhar_lightning.loss import chunked_cross_entropy
from mhar_lightning.model import Decoder
from mhar_lightning.optim import OptimizerConfig, build_optimizer
from mhar_lightning.residual import Residual, make_residual


class LanguageModel(L.LightningModule):
    """Causal language model training: fp32 chunked cross-entropy, AdamW groups, warmup + cosine/WSD.

    Args:
        preset: named `ModelConfig` size (`tiny`, `100m`, `350m`, `1b`, `llama3-8b`).
        residual: strategy name (`sum`, `attnres`, `mhar`, `delta-mhar`), a `Residual` or a
            `{class_path, init_args}` mapping.
        vocab_size: overrides the preset's vocabulary (linked to the data's tokenizer by the CLI).
        seq_len: training sequence length; becomes the model's `max_seq_len` (linked to the data).
        model_overrides: any other `ModelConfig` fields to change.
        optimizer: AdamW and schedule settings.
        grad_clip: max global gradient norm (0 disables clipping).
        loss_chunk_tokens: tokens per chunk of fp32 logits in the loss.
    """

    def __init__(
        self,
        preset: str = "tiny",
        residual: Residual | str | dict[str, Any] = "sum",
        vocab_size: int | None = None,
        seq_len: int | None = None,
        model_overrides: dict[str, Any] | None = None,
        optimizer: OptimizerConfig | dict[str, Any] | None = None,
        grad_clip: float = 1.0,
        loss_chunk_tokens: int = 4096,
    ) -> None:
        super().__init__()
        overrides = dict(model_overrides or {})
        if vocab_size is not None:
            overrides["vocab_size"] = vocab_size
        if seq_len is not None:
            overrides["max_seq_len"] = seq_len
        self.model_config = ModelConfig.preset(preset, **overrides)
        self.residual = make_residual(residual)
        self.optimizer_config = OptimizerConfig(**optimizer) if isinstance(optimizer, dict) else optimizer or OptimizerConfig()
        self.grad_clip = grad_clip
        self.loss_chunk_tokens = loss_chunk_tokens
        self.save_hyperparameters(ignore=["residual"])
        self.hparams["residual"] = self.residual.spec()
        self.hparams["optimizer"] = asdict(self.optimizer_config)
        self.decoder: Decoder | None = None
        self.flops_per_batch = 0

    def configure_model(self) -> None:
        """Build the decoder (under Lightning's init context, so big models can start on the meta device)."""
        if self.decoder is None:
            self.decoder = Decoder(self.model_config, self.residual)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.decoder(tokens)

    def loss(self, batch: Tensor) -> Tensor:
        """Mean next-token loss of a [B, T + 1] batch of token windows."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        hidden = self.decoder.hidden(inputs)
        return chunked_cross_entropy(hidden, self.decoder.head.weight, targets, self.loss_chunk_tokens)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        batch_size, seq_len = batch.shape[0], batch.shape[1] - 1
        self.flops_per_batch = self.model_config.flops_per_token(seq_len) * batch_size * seq_len
        loss = self.loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def test_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("test/loss", loss, sync_dist=True)
        return loss

    def on_validation_epoch_end(self) -> None:
        loss = self.trainer.callback_metrics.get("val/loss")
        if loss is not None:
            self.log("val/ppl", math.exp(min(float(loss), 50.0)))

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.decoder.parameters(), self.grad_clip)
            self.log("train/grad_norm", norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def configure_optimizers(self):
        total_steps = max(1, int(self.trainer.estimated_stepping_batches))
        optimizer, scheduler = build_optimizer(self.decoder, self.optimizer_config, total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
