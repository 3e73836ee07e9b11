"""Scaling a `Decoder` over GPUs with FSDP2: activation checkpointing, per-block compile, sharding.

`parallelize` applies them in torchtitan's order: `apply_activation_checkpointing`, then `compile_blocks`, then
`apply_fsdp` and `materialize` (the model is built on the meta device, so each rank only ever allocates its own shards).
"""

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
import torch._inductor
from torch import nn
from torch._dynamo.utils import maybe_enable_compiled_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from mhar_lightning.config import ModelConfig
from mhar_lightning.model import Decoder
from mhar_lightning.residual import Residual


class ActivationCheckpointing(StrEnum):
    """What each transformer block keeps for backward.

    `full` keeps only the block's input stream and recomputes the block; `selective` keeps the outputs of
    matrix products and attention and recomputes the cheap, memory-heavy ops (norms, SwiGLU, RoPE, routing).
    """

    NONE = "none"
    FULL = "full"
    SELECTIVE = "selective"


@dataclass(frozen=True)
class ParallelConfig:
    """How `parallelize` prepares a decoder: per-block activation checkpointing and compile, FSDP2 mixed precision.

    `compile_options` are Inductor's (checked by `inductor_options`); `param_dtype` and `reduce_dtype` are FSDP2's
    compute and gradient-reduction dtypes (master weights and optimizer state stay fp32).
    """

    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.NONE
    compile: bool = False
    compile_options: dict[str, Any] = field(default_factory=lambda: dict(INDUCTOR_OPTIONS))
    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32


def parallelize(decoder: Decoder, mesh: DeviceMesh | None, config: ParallelConfig) -> None:
    """Prepare `decoder` for training in place: activation checkpointing, then per-block compile, then, given
    Lightning's `ModelParallelStrategy` `mesh`, FSDP2 sharding and each rank's shards allocated and initialised.

    Parameter names and state-dict keys stay the plain decoder's. Without a mesh (one device, DDP) the decoder stays
    whole; with one it must have been built on the meta device, and its shards land on the mesh's device type on
    the current device (the rank's GPU, as for FSDP2's own placement).
    """
    apply_activation_checkpointing(decoder, config.activation_checkpointing)
    if config.compile:
        compile_blocks(decoder, config.compile_options)
    if mesh is None:
        return
    mesh = fsdp_mesh(mesh)
    apply_fsdp(decoder, mesh, config.param_dtype, config.reduce_dtype)
    materialize(decoder, mesh.device_type, mesh)


_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(forward: Callable, selective: bool) -> Callable:
    """`forward` run under non-reentrant activation checkpointing (the module keeps its parameter names)."""
    kwargs = (
        {"context_fn": functools.partial(create_selective_checkpoint_contexts, _selective_policy)} if selective else {}
    )

    @functools.wraps(forward)
    def run(*args):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def apply_activation_checkpointing(decoder: Decoder, mode: ActivationCheckpointing | str) -> None:
    """Checkpoint every transformer block's forward in place (`none`, `full` or `selective`)."""
    mode = ActivationCheckpointing(mode)
    if mode == ActivationCheckpointing.NONE:
        return
    for block in decoder.blocks:
        block.forward = _checkpointed(block.forward, selective=mode == ActivationCheckpointing.SELECTIVE)


INDUCTOR_OPTIONS: dict[str, Any] = {"combo_kernels": True}
"""Inductor options of every graph the kit compiles. Combo kernels launch independent small kernels as one: in a
350m block-MHAR step on an H200 they cut the host time from 89 to 60 ms."""
GRAPHS_PER_BLOCK = 4  # compiled graphs a block may need: training and no-grad evaluation, each with a shape change


def inductor_options(options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`options` (default `INDUCTOR_OPTIONS`), refused by name if Inductor has no such option."""
    options = dict(INDUCTOR_OPTIONS if options is None else options)
    unknown = sorted(set(options) - set(torch._inductor.list_options()))
    if unknown:
        raise ValueError(f"unknown Inductor option(s) {unknown}; see torch._inductor.list_options()")
    return options


def compile_blocks(decoder: Decoder, options: Mapping[str, Any] | None = None) -> None:
    """`torch.compile` each transformer block in place (same parameter names and state-dict keys), with Inductor
    `options` (default `INDUCTOR_OPTIONS`).

    Blocks share one code object, but routed strategies pass a stream whose length grows with depth and each
    block has its own sublayer indices, so each block gets its own graph, for training and again for no-grad
    evaluation, with room for a shape change in each: the recompile limits are raised by `GRAPHS_PER_BLOCK` per
    block, else the blocks would fall back to eager once the limit is hit (at the first validation, say). Raised
    by, not to: graphs of decoders compiled earlier in the process keep counting against the limits. A strategy's
    `no_grad_inductor_options` are added to `options` for its no-grad graphs.
    """
    options = inductor_options(options)
    graphs = GRAPHS_PER_BLOCK * len(decoder.blocks)
    torch._dynamo.config.recompile_limit += graphs
    torch._dynamo.config.accumulated_recompile_limit += graphs
    for block in decoder.blocks:
        no_grad = inductor_options({**options, **block.residual.no_grad_inductor_options})
        if no_grad == options:
            block.compile(options=options)
        else:
            block.compile(backend=functools.partial(inductor_by_grad_mode, options=options, no_grad=no_grad))


def inductor_by_grad_mode(graph: torch.fx.GraphModule, example_inputs: list, *, options: dict, no_grad: dict):
    """Inductor as a `torch.compile` backend, with `options` for graphs traced with gradients on (training) and
    `no_grad` for the others. Dynamo calls its backend under the traced frame's grad mode, which is also how
    AOTAutograd decides whether a graph gets a backward."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(graph, example_inputs, config_patches=options if torch.is_grad_enabled() else no_grad)


@contextlib.contextmanager
def compiled_backward(enabled: bool = True, options: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Run the backward passes inside through torch's compiled autograd (one graph per backward), compiled with
    Inductor `options` (default `INDUCTOR_OPTIONS`); a no-op unless `enabled`.

    Entered every step, so `options` are not checked here (that costs about 0.16 ms): check them once with
    `inductor_options`. An unknown key still fails, less clearly, when the patch is applied.
    """
    if not enabled:
        yield
        return
    with (
        torch._inductor.config.patch(dict(INDUCTOR_OPTIONS if options is None else options)),
        maybe_enable_compiled_autograd(True, fullgraph=False, dynamic=False),
    ):
        yield


def apply_fsdp(
    decoder: Decoder,
    mesh: DeviceMesh,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
) -> None:
    """Shard `decoder` with FSDP2 over `mesh`: one group per block, embedding, norm + head, and the root.

    A 1-D mesh shards over all its ranks; a 2-D mesh is HSDP (replicate over dim 0, shard over dim 1).

    Each block's residual router is inside the block, so its routing parameters shard with it. The root holds the
    final router (used at the start and end of `hidden`) and, when the head is tied, the embedding and head, so
    that one group owns the shared weight. `hidden` (what the loss calls) is registered as a forward method, and
    the head and root stay unsharded after forward because the loss uses `head.weight` outside `head.forward`.
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    shard = functools.partial(fully_shard, mesh=mesh, mp_policy=policy)
    last = len(decoder.blocks) - 1
    for i, block in enumerate(decoder.blocks):
        shard(block, reshard_after_forward=i < last)  # the last block's backward comes right after its forward
    if not decoder.config.tie_embeddings:
        shard(decoder.embed, reshard_after_forward=True)
        shard([decoder.norm, decoder.head], reshard_after_forward=False)
    shard(decoder, reshard_after_forward=False)
    register_fsdp_forward_method(decoder, "hidden")


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The FSDP mesh for Lightning's `ModelParallelStrategy` mesh `(data_parallel, tensor_parallel)`.

    The kit has no tensor parallelism, so the second dimension is the shard group: a dimension of size 1 is
    dropped (plain FSDP over the other), and two real dimensions give HSDP, sharded within each group of
    `tensor_parallel_size` ranks (Lightning's default: the GPUs of one node) and replicated across groups.
    """
    if mesh.ndim == 1:
        return mesh
    replicate, shard = mesh.mesh_dim_names
    if mesh[shard].size() == 1:
        return mesh[replicate]
    if mesh[replicate].size() == 1:
        return mesh[shard]
    return mesh


@torch.no_grad()
def materialize(decoder: Decoder, device: torch.device | str, mesh: DeviceMesh | None = None) -> None:
    """Allocate a meta-device (possibly sharded over `mesh`) `decoder` on `device` and run the real init.

    Lightning's own materialisation calls each module's `reset_parameters`, which for `nn.Linear` is not our init.
    On GPUs, DTensor's RNG tracker gives every shard its own part of one random stream. On CPU it has none, and
    every rank would draw the same numbers, so identical shards; there each shard index gets its own seed (HSDP
    replicas share their shard's seed, so replicas stay equal).
    """
    decoder.to_empty(device=device)
    if mesh is None or torch.device(device).type != "cpu":
        decoder.init_weights()
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch.initial_seed() + 7919 * mesh.get_local_rank(mesh.ndim - 1))
        decoder.init_weights()


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered if FSDP2 shards it as a DTensor (a collective: call it on every rank)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def unsharded_parameter_count(decoder: nn.Module) -> int:
    """Parameters of the whole model (global shapes, shared weights once), sharded or not."""
    return sum(p.numel() for p in {id(p): p for p in decoder.parameters()}.values())


def routing_parameters(decoder: nn.Module) -> int:
    """Parameters of `decoder`'s residual routers (queries, key gains, gates, stream weights), sharded or not."""
    return sum(unsharded_parameter_count(m) for m in decoder.modules() if isinstance(m, Residual))


def routing_parameter_count(config: ModelConfig, residual) -> int:
    """Residual-routing parameters a `Decoder(config, residual)` adds (counted on the meta device)."""
    with torch.device("meta"):
        model = Decoder(config, residual)
    return unsharded_parameter_count(model) - config.num_params()
