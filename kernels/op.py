"""`mhar::depth_route`, `mhar::depth_route_backward` and `mhar::merge_norm_backward`: `torch.library` ops over the
Triton kernels, with autograd from `torch.autograd.Function`s that call them.

The ops have fake (shape-only) implementations, so `torch.compile(fullgraph=True)` traces a block through the
Function without graph breaks, and checkpoint recomputation simply calls them again (no state is kept across
calls). Their autograd key falls through in C++: a `custom_op` would run its autograd and aliasing-check
layers in Python on every call, also inside compiled graphs, which costs more host time than the kernel
launches themselves (docs/kernels.md). Call the ops through `depth_route_lse`: called directly they
record no gradient.
The autograd context saves only the sources (references), the per-head log-sum-exp and each source row's inverse
RMS ([rows, S] fp32, so the backward need not reduce every row again): the backward recomputes everything else
from them, including <grad, mix> (exact even when the mix is stored in bf16).
The ops take Q folded queries `u = query * norm_weight` ([Q, d]: every query reads the sources in the same
pass, so the sublayers that route over identical sources share one call and one gradient write per source)
and return the partial sums of their gradient:
folding, reducing and the chain rule to the parameters stay in traced code, which Inductor fuses, so the
ops do little per call besides launching their kernels (host time matters: about 50 calls a step).
The backward ops take the number of partial sums (`blocks`) as an argument, so a compiled graph records it: a graph
compiled for other launch settings misses the compiler's disk cache, and a stale one fails with a clear error.
"""

import functools
from collections.abc import Sequence

import torch
from mhar_lightning.kernels import route_launch, triton_merge
from mhar_lightning.kernels.query import RouteQuery, check_counts
from torch import Tensor

_LIB = torch.library.Library("mhar", "DEF")
_LIB.define("depth_route(Tensor[] sources, Tensor u, int heads, float eps, int[] counts) -> (Tensor[], Tensor, Tensor)")
_LIB.define(
    "depth_route_backward(Tensor[] grad_out, Tensor? grad_lse, Tensor lse, Tensor rms, Tensor[] sources, Tensor u, "
    "int heads, int[] counts, int blocks) -> Tensor[]"
)
_LIB.define(
    "merge_norm_backward(Tensor grad_out, Tensor mix, Tensor source, Tensor u, Tensor weight, Tensor stats, int heads, "
    "int blocks) -> (Tensor, Tensor, Tensor, Tensor)"
)


def _route(
    sources: list[Tensor], u: Tensor, heads: int, eps: float, counts: list[int]
) -> tuple[list[Tensor], Tensor, Tensor]:
    """Q mixes [..., d] (bf16 if all sources are bf16, else fp32), log-sum-exps [Q, ..., heads] and the sources'
    inverse RMS [rows, S] (fp32, for the backward); query k reads the first counts[k] sources."""
    return route_launch.route_forward(sources, u, heads, eps, counts)


def _route_fake(sources, u, heads, eps, counts):
    lead, n_queries = sources[0].shape[:-1], u.shape[0]
    out = [sources[0].new_empty((*lead, u.shape[-1]), dtype=route_launch.out_dtype(sources)) for _ in range(n_queries)]
    lse = sources[0].new_empty((n_queries, *lead, heads), dtype=torch.float32)
    return out, lse, sources[0].new_empty((lead.numel(), len(sources)), dtype=torch.float32)


def _route_backward(
    grad_out: list[Tensor],
    grad_lse: Tensor | None,
    lse: Tensor,
    rms: Tensor,
    sources: list[Tensor],
    u: Tensor,
    heads: int,
    counts: list[int],
    blocks: int,
) -> list[Tensor]:
    """Gradients [d source_0, ..., d source_{S-1}] (each in its source's dtype) and du's partial sums [blocks, Q, d]."""
    grads, du_parts = route_launch.route_backward(grad_out, grad_lse, lse, rms, sources, u, heads, counts)
    _check_blocks("depth_route_backward", du_parts.shape[0], blocks)
    grads = [g if g.dtype == v.dtype else g.to(v.dtype) for g, v in zip(grads, sources, strict=True)]
    return [*grads, du_parts]


def _route_backward_fake(grad_out, grad_lse, lse, rms, sources, u, heads, counts, blocks):
    du_parts = u.new_empty((blocks, *u.shape), dtype=torch.float32)
    return [v.new_empty(v.shape) for v in sources] + [du_parts]


def _merge_norm_backward(
    grad_out: Tensor, mix: Tensor, source: Tensor, u: Tensor, weight: Tensor, stats: Tensor, heads: int, blocks: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`triton_merge.merge_norm_backward`, its partial sums checked against the `blocks` the caller expects."""
    *grads, parts = triton_merge.merge_norm_backward(grad_out, mix, source, u, weight, stats, heads)
    _check_blocks("merge_norm_backward", parts.shape[1], blocks)
    return (*grads, parts)


def _check_blocks(name: str, made: int, expected: int) -> None:
    """A graph compiled for other launch settings (e.g. by another version of the kit, from the compiler's disk
    cache) expects another number of partial sums: say so instead of failing inside the graph."""
    if made != expected:
        raise RuntimeError(
            f"mhar::{name}: the caller expects {expected} partial sums, the kernels write {made}; a compiled graph "
            "from another version of mhar-lightning? Clear the compiler's cache (TORCHINDUCTOR_CACHE_DIR) and rerun"
        )


def _merge_norm_backward_fake(grad_out, mix, source, u, weight, stats, heads, blocks):
    parts = mix.new_empty((2, blocks, mix.shape[-1]), dtype=torch.float32)
    lse = mix.new_empty((*mix.shape[:-1], heads), dtype=torch.float32)
    return mix.new_empty(mix.shape), lse, source.new_empty(source.shape), parts


for _name, _impl, _fake in (
    ("depth_route", _route, _route_fake),
    ("depth_route_backward", _route_backward, _route_backward_fake),
    ("merge_norm_backward", _merge_norm_backward, _merge_norm_backward_fake),
):
    _LIB.impl(_name, _impl, "CPU")  # the Triton interpreter (TRITON_INTERPRET=1)
    _LIB.impl(_name, _impl, "CUDA")
    _LIB.impl(_name, torch.library.fallthrough_kernel, "Autograd")
    torch.library.register_fake(f"mhar::{_name}", _fake, lib=_LIB)

route = torch.ops.mhar.depth_route.default
route_backward = torch.ops.mhar.depth_route_backward.default
merge_norm_backward_op = torch.ops.mhar.merge_norm_backward.default


class _Route(torch.autograd.Function):
    """Autograd of `route`: the backward op recomputes the softmax from the saved sources, log-sum-exp and inverse
    RMS. Each mix is an output of its own, so each arrives with its own gradient and none is concatenated."""

    @staticmethod
    def forward(ctx, u: Tensor, heads: int, eps: float, counts: list[int], *sources: Tensor):
        out, lse, rms = route(list(sources), u, heads, eps, counts)
        ctx.save_for_backward(lse, rms, u, *sources)
        ctx.heads, ctx.counts = heads, counts
        return *out, lse

    @staticmethod
    def backward(ctx, *grad_outputs: Tensor):  # autograd gives an unused output a zero gradient (materialize_grads)
        *grad_out, grad_lse = grad_outputs
        lse, rms, u, *sources = ctx.saved_tensors
        blocks = route_launch.du_blocks(sources[0].shape[:-1].numel(), len(sources))
        *grads, du_parts = route_backward(grad_out, grad_lse, lse, rms, sources, u, ctx.heads, ctx.counts, blocks)
        return du_parts.sum(0), None, None, None, *grads


class _MergeNorm(torch.autograd.Function):
    """A merged read normed by its sublayer's RMSNorm: the forward in PyTorch ops (`triton_merge.merge_norm_forward`,
    fused by the compiler with its neighbours), the backward one kernel from the forward's statistics."""

    @staticmethod
    def forward(ctx, mix, lse, source, u, weight, heads: int, eps: float, norm_eps: float, out_dtype: torch.dtype):
        out, stats = triton_merge.merge_norm_forward(mix, lse, source, u, weight, heads, eps, norm_eps, out_dtype)
        ctx.save_for_backward(mix, source, u, weight, stats)
        ctx.heads = heads
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        mix, source, u, weight, stats = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        blocks = triton_merge.backward_blocks(stats.shape[0])
        dmix, dlse, dsrc, parts = merge_norm_backward_op(grad_out, mix, source, u, weight, stats, ctx.heads, blocks)
        du, dw = parts.sum(1)
        return dmix, dlse, dsrc, du, dw.to(weight.dtype), None, None, None, None


def depth_route_lse(
    sources: Sequence[Tensor], query: RouteQuery, counts: Sequence[int] | None = None
) -> tuple[Tensor, Tensor] | tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """The fused route with the reference's contract (shapes, checks, promoted output dtype), and the per-head
    log-sum-exp of its logits ([..., heads], fp32), through which `reference.merge_source` adds a source later.

    A [d] query gives outputs [..., d] and [..., heads]; [Q, d] queries over the same sources give Q mixes and Q
    log-sum-exps, each a tensor of its own, so each consumer's gradient reaches the backward kernels without a
    concatenation, two queries per pass over the sources; `counts` then gives the number of leading sources each
    query reads (default: all).
    Sources may differ in dtype (fp32 and bf16 are read natively, others through an fp32 copy) and
    may be broadcast views (e.g. `null.expand_as(x)`, read through stride 0, never materialised).
    """
    if len(sources) == 0:
        raise ValueError("depth routing needs at least one source")
    d = query.d
    if any(v.shape[-1] != d for v in sources):
        raise ValueError(f"source widths {[v.shape[-1] for v in sources]} do not all match query width {d}")
    if any(v.shape != sources[0].shape for v in sources):
        lead = torch.broadcast_shapes(*(v.shape for v in sources))[:-1]
        sources = [v.expand(*lead, d) for v in sources]
    u = query.folded(torch.float32).reshape(-1, d)
    counts = check_counts(counts, len(u), len(sources))
    dtype = functools.reduce(torch.promote_types, (v.dtype for v in sources))
    mixes, lses = [], []
    tracked = torch.is_grad_enabled() and (u.requires_grad or any(v.requires_grad for v in sources))
    for first in range(0, len(u), route_launch.MAX_QUERIES):
        chunk = counts[first : first + route_launch.MAX_QUERIES]
        args = (u[first : first + len(chunk)], query.heads, query.eps, chunk)
        if tracked:
            *out, lse = _Route.apply(*args, *sources[: max(chunk)])
        else:  # dynamo inlines a Function's forward without gradients and then drops its ctx at two sources
            out, lse, _ = route(list(sources[: max(chunk)]), *args)
        mixes += [mix.to(dtype) for mix in out]
        lses += lse.unbind(0)
    return (tuple(mixes), tuple(lses)) if query.query.dim() == 2 else (mixes[0], lses[0])


def depth_route(sources: Sequence[Tensor], route: RouteQuery) -> Tensor:
    """The fused route (see `depth_route_lse`) without its log-sum-exp: [..., d], or [Q, ..., d] for [Q, d] queries."""
    out = depth_route_lse(sources, route)[0]
    return torch.stack(out) if route.query.dim() == 2 else out


def merge_norm(
    mix: Tensor, lse: Tensor, source: Tensor, route: RouteQuery, weight: Tensor, norm_eps: float, out_dtype: torch.dtype
) -> Tensor:
    """`reference.merge_norm` (the route `mix` [..., d], `lse` [..., heads] with `source` added, then normed) with
    one fused kernel for all its gradients."""
    d, heads = route.d, route.heads
    if mix.shape != source.shape or lse.shape != (*mix.shape[:-1], heads) or mix.shape[-1] != d:
        raise ValueError(
            f"merge_norm needs mix and source of one shape [..., {d}] and lse [..., {heads}]; got mix "
            f"{tuple(mix.shape)}, source {tuple(source.shape)}, lse {tuple(lse.shape)}"
        )
    mix, source = (x.contiguous() if x.dtype in triton_merge.DTYPES else x.float().contiguous() for x in (mix, source))
    u = route.folded(torch.float32)
    lse, weight = lse.float().contiguous(), weight.contiguous()
    return _MergeNorm.apply(mix, lse, source, u, weight, heads, route.eps, norm_eps, out_dtype)
