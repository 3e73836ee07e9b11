"""The LightningModule: next-token training of a `Decoder` with a pluggable residual strategy."""

import math
from dataclasses import asdict
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
)

from mhar_lightning.bits_per_byte import BitsPerByte
from mhar_lightning.callbacks import ResumeDueValidation, SameWorldSize
from mhar_lightning.checkpoint.finite import check_finite_state
from mhar_lightning.config import ModelConfig, padded_vocab
from mhar_lightning.convert import converted_state_dict, pretrained_model
from mhar_lightning.data.token_bytes import token_bytes
from mhar_lightning.divergence import NonFiniteGuard, tensors_finite
from mhar_lightning.dtypes import dtype_from_name
from mhar_lightning.errors import CheckpointError
from mhar_lightning.loss import chunked_cross_entropy
from mhar_lightning.model import Decoder
from mhar_lightning.optim import OptimizerConfig, build_optimizer
from mhar_lightning.parallel import (
    ActivationCheckpointing,
    ParallelConfig,
    compiled_backward,
    full_tensor,
    inductor_options,
    parallelize,
)
from mhar_lightning.residual import Residual, make_residual

DDP_GPU_COMPILED_AUTOGRAD_SINCE = (2, 12)  # torch 2.11 failed on two H200s (NCCL); 2.11 and 2.13 pass on CPUs (gloo)


def torch_release() -> tuple[int, int]:
    """The installed torch's (major, minor)."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def compiled_autograd_unsupported(trainer: L.Trainer) -> str | None:
    """Why compiled autograd cannot run under `trainer`'s strategy, or None where it can."""
    strategy = trainer.strategy
    if trainer.world_size == 1:
        return None
    if not isinstance(strategy, DDPStrategy):
        name = type(strategy).__name__
        return f"it runs in one process or under DDP, not under {name} across {trainer.world_size} ranks"
    if strategy.root_device.type == "cuda" and torch_release() < DDP_GPU_COMPILED_AUTOGRAD_SINCE:
        return (
            "under DDP on GPUs it crashed with torch 2.11 (in DDP's compiled gradient hook, leaving the ranks hung) "
            f"and this is torch {torch.__version__}"
        )
    return None


def check_sharded_precision(precision: str) -> None:
    """Refuse a Trainer precision that casts the fp32 master weights: under FSDP2 its own policy sets the dtypes."""
    if precision.endswith("-true") and precision != "32-true":
        raise ValueError(
            f"precision={precision} casts the fp32 master weights; use precision=32-true with"
            " ModelParallelStrategy (param_dtype and reduce_dtype set FSDP2's mixed precision)"
        )


class LanguageModel(L.LightningModule):
    """Causal language model training: fp32 chunked cross-entropy, AdamW or Muon groups, warmup + cosine/WSD.

    Args:
        preset: named `ModelConfig` size (`tiny`, `100m`, `350m`, `1b`, `llama3-8b`); default `tiny`, or with
            `init_from` the directory's shape (a preset given then must agree with it).
        residual: strategy name (`sum`, `attnres`, `mhar`, `delta-mhar`), a `Residual` or a
            `{class_path, init_args}` mapping; default `sum`, or with `init_from` the directory's strategy.
        vocab_size: the tokenizer's vocabulary (linked to `data.tokenizer` by the CLI): the model's is rounded up to
            a multiple of 64, or with `init_from` is the directory's, which must hold it.
        seq_len: training sequence length; becomes the model's `max_seq_len` (linked to the data).
        model_overrides: any other `ModelConfig` fields to change (with `init_from`, only to the same values).
        optimizer: the optimizer (AdamW, or Muon for the hidden matrices), its groups' settings and the schedule.
        grad_clip: max global gradient norm (0 disables clipping).
        skip_nonfinite: a step whose loss or gradient norm is not finite stops the run (`TrainingDiverged`) before
            it is applied; with N > 0, up to N such steps in a row are skipped (gradients dropped, warned) instead.
        loss_chunk_tokens: tokens per chunk of fp32 logits in the loss.
        activation_checkpointing: per transformer block: `none`, `full` or `selective` (see `parallel.py`).
        compile: `torch.compile` each transformer block.
        compile_options: Inductor options for the compiled blocks and compiled-autograd graphs (default: the kit's,
            `parallel.INDUCTOR_OPTIONS`, which turns on combo kernels; `{}` for Inductor's own defaults).
        compiled_autograd: run each backward through torch's compiled autograd: compiled graphs, with the gradient
            sums that routed strategies leave between routing calls, instead of the autograd engine's per-node host
            work. One process or DDP (whose gradient all-reduce then runs inside the captured graphs); refused
            under FSDP2, where it left the root group's gradients unreduced (CPU, torch 2.13). `auto` (the GPU
            recipes' setting) turns it on where it runs and off, with a message, where it does not.
        init_from: a converted checkpoint directory (`mhar convert-hf`) whose shape, routing and weights start the
            run.
        param_dtype, reduce_dtype: FSDP2 compute and gradient-reduction dtypes (ModelParallelStrategy only;
            master weights and optimizer state stay fp32).
    """

    def __init__(
        self,
        preset: str | None = None,
        residual: Residual | str | dict[str, Any] | None = None,
        vocab_size: int | None = None,
        seq_len: int | None = None,
        model_overrides: dict[str, Any] | None = None,
        optimizer: OptimizerConfig | dict[str, Any] | None = None,
        grad_clip: float = 1.0,
        skip_nonfinite: int = 0,
        loss_chunk_tokens: int = 4096,
        activation_checkpointing: str = "none",
        compile: bool = False,
        compile_options: dict[str, Any] | None = None,
        compiled_autograd: bool | Literal["auto"] = False,
        init_from: str | None = None,
        param_dtype: str = "bfloat16",
        reduce_dtype: str = "float32",
    ) -> None:
        super().__init__()
        if not grad_clip >= 0:  # NaN too
            raise ValueError(
                f"model.grad_clip={grad_clip} is no gradient norm: set --model.grad_clip to a positive norm (e.g. 1.0),"
                " or to 0 to turn clipping off"
            )
        if loss_chunk_tokens < 1:
            raise ValueError(
                f"model.loss_chunk_tokens={loss_chunk_tokens} must be >= 1: set --model.loss_chunk_tokens to a positive"
                " count (default 4096)"
            )
        if init_from is not None:
            self.model_config, self.residual = pretrained_model(
                init_from,
                preset=preset,
                residual=residual,
                overrides=model_overrides,
                vocab_size=vocab_size,
                seq_len=seq_len,
            )
        else:
            overrides = dict(model_overrides or {})
            if vocab_size is not None:
                overrides["vocab_size"] = padded_vocab(vocab_size)
            if seq_len is not None:
                overrides["max_seq_len"] = seq_len
            self.model_config = ModelConfig.preset("tiny" if preset is None else preset, **overrides)
            self.residual = make_residual("sum" if residual is None else residual)
        with torch.device("meta"):  # a strategy that does not fit the model fails here, not mid-fit
            self.residual.spawn(self.model_config, range(2))
        self.optimizer_config = OptimizerConfig.of(optimizer)
        self.grad_clip = grad_clip
        self.nonfinite = NonFiniteGuard(skip_nonfinite)
        self.loss_chunk_tokens = loss_chunk_tokens
        self.parallel_config = ParallelConfig(
            activation_checkpointing=ActivationCheckpointing(activation_checkpointing),
            compile=compile,
            compile_options=inductor_options(compile_options),
            param_dtype=dtype_from_name(param_dtype),
            reduce_dtype=dtype_from_name(reduce_dtype),
        )
        self.compiled_autograd = compiled_autograd
        self.init_from = init_from
        self.save_hyperparameters(ignore=["residual"])
        self.hparams["residual"] = self.residual.spec()
        self.hparams["model_config"] = self.model_config.to_dict()  # what tools (export-hf) rebuild the decoder from
        config = self.optimizer_config
        self.hparams["optimizer"] = {**asdict(config), "name": str(config.name), "schedule": str(config.schedule)}
        self.decoder: Decoder | None = None
        self.flops_per_batch = 0
        self._step_loss: Tensor | None = None
        self.bits_per_byte: BitsPerByte | None = None

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype FSDP2's mixed precision computes in when sharded; None where the Trainer's precision decides."""
        return self.parallel_config.param_dtype if self._device_mesh is not None else None

    def configure_model(self) -> None:
        """Build the decoder and `parallelize` it: sharded with FSDP2 under `ModelParallelStrategy`, whole otherwise.

        With a device mesh the decoder is built on the meta device and each rank allocates and initialises only its
        shards, so a large model never exists whole on one rank. `init_from` weights are read on rank 0 only and
        scattered shard by shard. Without a trainer (e.g. `load_from_checkpoint`) `init_from` is skipped: the
        checkpoint holds the weights.
        """
        if self.decoder is not None:
            return
        mesh = self._device_mesh
        if mesh is None:
            decoder = Decoder(self.model_config, self.residual)
        else:
            check_sharded_precision(str(self.trainer.precision))
            with torch.device("meta"):
                decoder = Decoder(self.model_config, self.residual)
        parallelize(decoder, mesh, self.parallel_config)
        if self.init_from is not None and self._trainer is not None:
            self._load_init_from(decoder, sharded=mesh is not None)
        self.decoder = decoder

    def _load_init_from(self, decoder: Decoder, sharded: bool) -> None:
        """Load the `init_from` weights, memory-mapped and checked against `decoder`'s parameter names and shapes on
        every rank: whole, or read on rank 0 only and scattered into the shards."""
        state = converted_state_dict(self.init_from)
        expected = {name: tuple(p.shape) for name, p in decoder.state_dict().items()}
        found = {name: tuple(t.shape) for name, t in state.items()}
        if expected != found:
            diff = sorted(set(expected.items()) ^ set(found.items()))[:4]
            raise ValueError(
                f"init_from={self.init_from} holds tensors that its mhar_config.json does not describe (first "
                f"differences: {diff}); convert it again with `mhar convert-hf`"
            )
        check_finite_state(state, self.init_from)
        if not sharded:
            decoder.load_state_dict(state)
            return
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(decoder, state if self.global_rank == 0 else {}, options=options)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.decoder(tokens)

    def loss(self, batch: Tensor, bits_per_byte: BitsPerByte | None = None) -> Tensor:
        """Mean next-token loss of a [B, T + 1] batch of token windows (added to `bits_per_byte` if given)."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        hidden = self.decoder.hidden(inputs)
        loss = chunked_cross_entropy(hidden, self.decoder.head.weight, targets, self.loss_chunk_tokens)
        if bits_per_byte is not None:
            bits_per_byte.update(hidden, self.decoder.head.weight, targets, loss, self.loss_chunk_tokens)
        return loss

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        batch_size, seq_len = batch.shape[0], batch.shape[1] - 1
        self.flops_per_batch = self.model_config.flops_per_token(seq_len) * batch_size * seq_len
        loss = self.loss(batch)
        self.nonfinite.watch_loss(loss)
        self.log("train/loss", loss)  # not prog_bar: Lightning would copy it to the host, a GPU sync, every step
        self._step_loss = loss
        return loss

    def validation_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self.loss(batch, self.bits_per_byte)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def test_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("test/loss", loss, sync_dist=True)
        return loss

    def on_validation_epoch_start(self) -> None:
        """Bits per byte need the UTF-8 bytes of every token id: a table made once, from the data's tokenizer."""
        tokenizer = getattr(self.trainer.datamodule, "tokenizer", None)
        if self.bits_per_byte is None and tokenizer is not None:
            self.bits_per_byte = BitsPerByte(token_bytes(tokenizer, self.model_config.vocab_size))
        if self.bits_per_byte is not None:
            self.bits_per_byte.reset()

    def on_validation_epoch_end(self) -> None:
        loss = self.trainer.callback_metrics.get("val/loss")
        if loss is not None:
            self.log("val/ppl", math.exp(min(float(loss), 50.0)))
        if self.bits_per_byte is not None:
            bpb = self.bits_per_byte.value(lambda sums: self.trainer.strategy.reduce(sums, reduce_op="sum"))
            if bpb is not None:
                self.log("val/bpb", bpb)

    def check_strategy(self, trainer: L.Trainer) -> None:
        """Refuse training settings that `trainer`'s strategy cannot run, and resolve `compiled_autograd="auto"`."""
        reason = compiled_autograd_unsupported(trainer)
        if self.compiled_autograd == "auto":
            self.compiled_autograd = reason is None
            if reason:
                rank_zero_info(f"compiled_autograd=auto: off, as {reason}")
        elif self.compiled_autograd and reason:
            raise ValueError(f"compiled_autograd=true is refused: {reason}; set model.compiled_autograd=false")

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.check_strategy(self.trainer)
            if self.compiled_autograd and self.trainer.world_size > 1:
                # Before DDP wraps the model: its C++ reducer refuses compiled autograd, the Python one hooks every
                # parameter's gradient, so that the all-reduce is captured with the backward.
                torch._dynamo.config.optimize_ddp = "python_reducer"

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        if self.compiled_autograd and self._step_loss is not None:
            loss = self._tensor_scaled(loss)
        with compiled_backward(self.compiled_autograd, self.parallel_config.compile_options):
            super().backward(loss, *args, **kwargs)
        self._step_loss = None

    def _tensor_scaled(self, loss: Tensor) -> Tensor:
        """`loss` rebuilt as this step's own loss times a tensor factor, with the same value and gradients.

        Lightning hands `backward` the step's loss divided by `accumulate_grad_batches`, a Python int. Compiled
        autograd (torch 2.11, CUDA) lifts that saved scalar into the captured graph as an input and then calls
        `.item()` on it, which fails for an int: every compiled-autograd step under the Trainer crashed in its
        first backward. Scaling by a 0-d tensor instead leaves no Python scalar in the graph.
        """
        step_loss = self._step_loss.detach()
        factor = torch.where(step_loss != 0, loss.detach() / step_loss, 1.0 / self.trainer.accumulate_grad_batches)
        return self._step_loss * factor

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Clip the gradients; stop (or skip) a step whose loss or gradient norm is not finite before it is applied."""
        if self.grad_clip > 0:
            norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.decoder.parameters(), self.grad_clip))
            self.log("train/grad_norm", norm)
        else:
            norm = full_tensor(
                torch.nn.utils.get_total_norm(p.grad for p in self.decoder.parameters() if p.grad is not None)
            )
        if self._trainer is not None and self.nonfinite.check(self.trainer, norm, optimizer):
            optimizer.zero_grad(set_to_none=True)
        if self.nonfinite.skip_limit:
            self.log("train/skipped_steps", float(self.nonfinite.skipped))

    def on_train_end(self) -> None:
        self.nonfinite.settle()  # the last steps' flags, read on the device's time so far

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse weights (and a sharded checkpoint's optimizer state) that are not finite: a checkpoint saved after
        training diverged (`mhar` checks a single file's optimizer state when it reads the file)."""
        source = str((self._trainer.ckpt_path if self._trainer is not None else None) or "being loaded")
        if "state_dict" in checkpoint or self._trainer is None:
            check_finite_state(checkpoint.get("state_dict", {}), source)
            return
        # sharded (ModelParallelStrategy): already loaded into this rank's shards of the model and optimizer
        state = [t for o in self.trainer.optimizers for s in o.state.values() for t in s.values() if torch.is_tensor(t)]
        if not tensors_finite([*self.parameters(), *self.buffers(), *state], self.trainer):
            raise CheckpointError(
                f"checkpoint {source} has non-finite weights or optimizer state: training had diverged when it was"
                " saved; use an earlier checkpoint"
            )

    def configure_callbacks(self) -> list[L.Callback]:
        """Callbacks every run needs: resuming on another number of ranks would silently misalign the data, and a
        resumed run would skip the validation it was killed in."""
        return [SameWorldSize(), ResumeDueValidation()]

    def configure_optimizers(self):
        # Not `trainer.estimated_stepping_batches`: in Lightning 2.6 it builds the train loader before a resume
        # restores its state, silently losing the data position (Lightning issue #20550).
        total_steps = self.trainer.max_steps
        if total_steps is None or total_steps < 1:
            raise ValueError("set trainer.max_steps: the learning-rate schedule is defined over optimizer steps")
        optimizer, scheduler = build_optimizer(self.decoder, self.optimizer_config, total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
