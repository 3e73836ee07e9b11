"""The memory plan: per-GPU bytes of one FSDP2 training step as `parallel.apply_fsdp` shards it, before any run."""

from dataclasses import dataclass

from mhar_lightning.config import ModelConfig
from mhar_lightning.parallel import ActivationCheckpointing

GiB = 1024**3


@dataclass(frozen=True)
class MemoryPlan:
    """Estimated bytes per GPU of one FSDP2 training step (AdamW, fp32 master weights and reduce, bf16 compute)."""

    params: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations

    def table(self) -> str:
        """A Markdown table in GiB."""
        rows = [("parameters", self.params), ("gradients", self.grads), ("optimizer (AdamW)", self.optimizer)]
        rows += [("activations", self.activations), ("total", self.total)]
        return "| | GiB |\n| --- | ---: |\n" + "\n".join(f"| {name} | {b / GiB:.1f} |" for name, b in rows)


def memory_plan(
    config: ModelConfig,
    world_size: int,
    micro_batch: int,
    seq_len: int,
    activation_checkpointing: ActivationCheckpointing | str = "none",
    routing_params: int = 0,
    stream_tensors: int = 1,
    loss_chunk_tokens: int = 4096,
) -> MemoryPlan:
    """Per-GPU memory of FSDP2 training as `apply_fsdp` sets it up (an estimate: no allocator slack or buffers).

    params: fp32 shards plus bf16 all-gathered copies (two blocks in flight, and the unsharded embedding, norm and
    head); grads: fp32 shards plus bf16 unsharded gradients of two blocks; optimizer: AdamW's two fp32 moments.
    activations: bf16 tensors kept for backward per token and block (see docs/scaling.md), the residual stream's
    `stream_tensors` live tensors per block boundary (1 for `sum`; more for routed strategies), one checkpointed
    block being recomputed, and one chunk of fp32 logits in the loss.
    """
    mode = ActivationCheckpointing(activation_checkpointing)
    d, f, v, n = config.d_model, config.ffn_hidden, config.vocab_size, config.n_layers
    kv = config.n_kv_heads * config.head_dim
    total = config.num_params() + routing_params
    shard = -(-total // world_size)
    block = config.block_params() + routing_params // n
    edges = v * d * (1 if config.tie_embeddings else 2) + d
    tokens = micro_batch * seq_len
    # bytes per token a block keeps: norm inputs (fp32) and outputs, q/k/v, attention output, o input,
    # gate/up/silu/product of the MLP, the block's routing read and partial sums (2 bf16 tensors per sublayer).
    full_block = 2 * (4 * d + 2 * d) + 2 * (d + 2 * kv) + 2 * d + 2 * d + 4 * 2 * f + 2 * 2 * d
    kept = {
        ActivationCheckpointing.NONE: full_block,
        ActivationCheckpointing.SELECTIVE: 2 * (2 * d + 2 * kv) + 2 * d + 2 * (2 * f + d),  # matmul + attention outputs
        ActivationCheckpointing.FULL: 0,
    }[mode]
    stream = 2 * d * stream_tensors
    recompute = 0 if mode == ActivationCheckpointing.NONE else full_block
    activations = tokens * (n * (kept + stream) + recompute) + min(tokens, loss_chunk_tokens) * v * 4 * 2
    return MemoryPlan(
        params=4 * shard + 2 * (2 * block + edges),
        grads=4 * shard + 2 * 2 * block,
        optimizer=8 * shard,
        activations=activations,
    )
