"""The fused depth-routing op against the fp64 reference (CPU through TRITON_INTERPRET, or the GPU)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.utils.checkpoint
from mhar_lightning.kernels import (
    ENV_BACKEND,
    depth_route,
    depth_route_lse,
    forward_kernel,
    merge_source,
    op,
    reference,
    resolve_backend,
    route_launch,
)
from torch._dynamo.utils import maybe_enable_compiled_autograd

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # small cases run on the card when there is one, else in the interpreter
TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}  # fp32: an fp32 PyTorch reference itself reaches 1.1e-5 at S = 64


def rel(a: torch.Tensor, b: torch.Tensor, scale: float = 0.0) -> float:
    """Relative error ||a - b|| / max(||b||, scale)."""
    assert torch.isfinite(a).all()
    return ((a.double() - b.double()).norm() / max(b.double().norm().item(), scale, 1e-30)).item()


def make(S, d, lead, dtypes, device=DEVICE, seed=0, queries=None):
    """Fresh random sources (dtype per source), query and gain ([queries, d] if given, else [d]) and upstream
    gradient; the gain is away from 1, the query nonzero."""
    gen = torch.Generator().manual_seed(seed)
    sources = [(torch.randn(*lead, d, generator=gen) * (0.5 + n)).to(device, dt) for n, dt in enumerate(dtypes)]
    q_shape = (d,) if queries is None else (queries, d)
    query = (torch.randn(q_shape, generator=gen) * 0.5).to(device)
    gain = (1 + 0.2 * torch.randn(q_shape, generator=gen)).to(device)
    grad_out = torch.randn(*q_shape[:-1], *lead, d, generator=gen).to(device)
    return sources, query, gain, grad_out


def check_against_reference(sources, query, gain, grad_out, heads, tol):
    """Forward and every gradient of the Triton path vs the reference in fp64 on the same (rounded) inputs."""
    leaves = [v.detach().requires_grad_() for v in sources]
    q, g = query.detach().requires_grad_(), gain.detach().requires_grad_()
    out = depth_route(leaves, q, g, heads, backend="triton")
    assert out.dtype == reference.depth_route(sources, query, gain, heads).dtype
    go = grad_out.to(out.dtype)
    out.backward(go)

    ref_leaves = [v.detach().double().requires_grad_() for v in sources]
    rq, rg = query.detach().double().requires_grad_(), gain.detach().double().requires_grad_()
    ref = reference.depth_route(ref_leaves, rq, rg, heads)
    ref.backward(go.double())

    assert rel(out, ref) < tol
    for a, b in zip(leaves, ref_leaves, strict=True):
        assert a.grad.dtype == a.dtype and rel(a.grad, b.grad) < tol
    # with one source the softmax is constant and d query = d gain = 0 exactly: measure against the
    # gradient scale of the op instead of zero
    scale = ref_leaves[0].grad.norm().item() if len(sources) == 1 else 0.0
    assert rel(q.grad, rq.grad, scale) < tol and rel(g.grad, rg.grad, scale) < tol


CASES = [  # (S, d, heads): non-power-of-two widths and head sizes, 1 to 64 sources
    (1, 8, 1),
    (3, 24, 4),
    (5, 40, 8),
    (2, 48, 16),
    (7, 12, 2),
    (64, 16, 4),
    (3, 64, 8),  # 16-byte aligned rows and heads: the vectorised path on a GPU
    (4, 192, 2),  # head size 96: not a power of two, padded in the [heads, head size] tile
    (2, 256, 4),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,d,heads", CASES)
def test_matches_reference(S, d, heads, dtype):
    sources, query, gain, grad_out = make(S, d, (2, 3), [dtype] * S, seed=S * 1000 + d + heads)
    check_against_reference(sources, query, gain, grad_out, heads, TOL[dtype])


@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16),  # embedding + block outputs: the model's case
        (torch.bfloat16, torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32, torch.bfloat16),
    ],
)
def test_source_dtype_patterns(dtypes):
    """Each launch specialises its loads on the dtype of source 0 and of the rest (one dtype, or either)."""
    sources, query, gain, grad_out = make(len(dtypes), 40, (2, 3), dtypes, seed=len(dtypes))
    check_against_reference(sources, query, gain, grad_out, 8, TOL[torch.bfloat16])


@pytest.mark.parametrize("queries", [2, 3])
@pytest.mark.parametrize(
    "S,d,heads,dtypes",
    [(1, 8, 1, "fp32"), (4, 40, 8, "mixed"), (3, 192, 2, "bf16"), (6, 24, 4, "mixed"), (10, 24, 4, "fp32")],
)
def test_several_queries_match_reference(queries, S, d, heads, dtypes):
    """Q queries over the same sources, two per pass (3 takes a second pass): each mix, the source gradients
    summed over the queries and every query's and gain's gradient match Q separate fp64 routes."""
    first = torch.float32 if dtypes != "bf16" else torch.bfloat16
    rest = torch.float32 if dtypes == "fp32" else torch.bfloat16
    kinds = [first] + [rest] * (S - 1)
    sources, query, gain, grad_out = make(S, d, (2, 3), kinds, seed=S + d, queries=queries)
    tol = TOL[torch.float32 if dtypes == "fp32" else torch.bfloat16]
    check_against_reference(sources, query, gain, grad_out, heads, tol)


@pytest.mark.parametrize("queries", [None, 2])
def test_log_sum_exp_and_merged_source_match_reference(queries):
    """The op's log-sum-exp and its gradient (used to merge a later source, `merge_source`) vs fp64."""
    d, heads = 40, 8
    dtypes = [torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16]
    sources, query, gain, grad_out = make(4, d, (2, 3), dtypes, seed=11, queries=queries)

    def loss(shared, extra, q, g, backend):
        mix, lse = depth_route_lse(shared, q, g, heads, backend=backend)
        if q.dim() == 1:
            merged = merge_source(mix, lse, extra, q, g, heads)
        else:
            parts = zip(mix, lse, q, g, strict=True)
            merged = torch.stack([merge_source(m, s, extra, qk, gk, heads) for m, s, qk, gk in parts])
            lse = torch.stack(lse)
        return (merged.double() * grad_out.double()).sum() + (lse.double() * lse.double().sin()).sum()

    leaves = [v.detach().requires_grad_() for v in (*sources, query, gain)]
    loss(leaves[:2], leaves[2], *leaves[-2:], "triton").backward()
    ref = [v.detach().double().requires_grad_() for v in (*sources, query, gain)]
    loss(ref[:2], ref[2], *ref[-2:], "reference").backward()
    for a, b in zip(leaves, ref, strict=True):
        if a.grad is not None or b.grad is not None:
            assert rel(a.grad, b.grad) < TOL[torch.bfloat16]


@pytest.mark.parametrize(
    "counts,dtypes",
    [
        ((5, 4), "mixed"),
        ((4, 5), "bf16"),
        ((1, 5), "fp32"),
        ((3, 3), "mixed"),
        ((5, 2, 4), "mixed"),
        ((2,), "fp32"),
        ((1, 4), "mixed"),  # four sources reach the kernels: the statistics kernel's last pair is half empty
        ((4, 1), "fp32"),
    ],
)
def test_queries_reading_fewer_sources_match_reference(counts, dtypes):
    """Query k reads only the first counts[k] sources: each mix, log-sum-exp and every gradient match separate
    fp64 routes over those sources (a source a query skips gets no gradient from it). Each mix and log-sum-exp is a
    tensor of its own, and each gets its own upstream gradient."""
    S, d, heads = 5, 40, 8
    first = torch.float32 if dtypes != "bf16" else torch.bfloat16
    rest = torch.float32 if dtypes == "fp32" else torch.bfloat16
    sources, query, gain, grad_out = make(
        S, d, (2, 3), [first] + [rest] * (S - 1), seed=sum(counts), queries=len(counts)
    )

    def loss(mix, lse):
        return (mix.double() * grad_out.double()).sum() + (lse.double() * lse.double().sin()).sum()

    leaves = [v.detach().requires_grad_() for v in (*sources, query, gain)]
    mixes, lses = depth_route_lse(leaves[:S], leaves[S], leaves[S + 1], heads, counts=counts, backend="triton")
    assert len(mixes) == len(lses) == len(counts)
    mix, lse = torch.stack(mixes), torch.stack(lses)
    loss(mix, lse).backward()
    ref = [v.detach().double().requires_grad_() for v in (*sources, query, gain)]
    pairs = [reference.depth_route_lse(ref[:c], ref[S][k], ref[S + 1][k], heads) for k, c in enumerate(counts)]
    ref_mix, ref_lse = torch.stack([m for m, _ in pairs]), torch.stack([z for _, z in pairs])
    loss(ref_mix, ref_lse).backward()
    tol = TOL[torch.float32 if dtypes == "fp32" else torch.bfloat16]
    assert rel(mix, ref_mix) < tol and rel(lse, ref_lse) < tol
    for a, b in zip(leaves, ref, strict=True):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            assert rel(a.grad, b.grad) < tol


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_counts_out_of_range_are_refused(backend):
    sources, query, gain, _ = make(3, 8, (1, 2), [torch.float32] * 3, queries=2)
    for counts in ((3,), (0, 3), (3, 4)):
        with pytest.raises(ValueError, match=r"must give 1 to 3 sources for each of the 2 queries"):
            depth_route_lse(sources, query, gain, 1, counts=counts, backend=backend)


def test_rows_span_several_gradient_blocks():
    """40 rows: the gradient kernel's blocks of APPLY_ROWS rows, the last one partial, and their du partial sums."""
    assert route_launch.APPLY_ROWS < 40 < 2 * route_launch.APPLY_ROWS
    sources, query, gain, grad_out = make(3, 24, (5, 8), [torch.float32, torch.bfloat16, torch.float32], seed=7)
    check_against_reference(sources, query, gain, grad_out, 4, TOL[torch.bfloat16])
    sources, query, gain, grad_out = make(3, 24, (5, 8), [torch.bfloat16] * 3, seed=8, queries=2)
    check_against_reference(sources, query, gain, grad_out, 4, TOL[torch.bfloat16])


def test_mixed_dtypes_broadcast_and_strided_sources():
    """fp32 embedding + bf16 outputs + a stride-0 null + transposed / sliced leading dims."""
    d, heads = 24, 4
    sources, query, gain, grad_out = make(4, d, (3, 2), [torch.float32, torch.bfloat16, torch.bfloat16, torch.float32])
    null = torch.randn(d, device=DEVICE)
    base = torch.randn(2, 6, d, device=DEVICE)
    strided = [
        null.expand(3, 2, d),
        base.transpose(0, 1)[::2],
        sources[1].transpose(0, 1).contiguous().transpose(0, 1),
        *sources,
    ]
    assert strided[1].shape == (3, 2, d) and not strided[1].is_contiguous()
    check_against_reference(strided, query, gain, grad_out, heads, TOL[torch.bfloat16])
    fp32_only = [null.expand(3, 2, d), base.transpose(0, 1)[::2]]
    check_against_reference(fp32_only, query, gain, grad_out, heads, TOL[torch.float32])


def test_more_leading_dims_and_other_dtypes():
    """4-D sources (one sliced, so no [rows, d] view exists) and an fp16 source (read through an fp32 copy)."""
    d, heads = 16, 2
    sources, query, gain, grad_out = make(3, d, (2, 2, 3), [torch.float32, torch.float16, torch.bfloat16])
    sliced = torch.randn(2, 4, 3, d, device=DEVICE)[:, ::2]
    check_against_reference([*sources, sliced], query, gain, grad_out, heads, TOL[torch.bfloat16])


def test_outputs_fully_overwritten():
    """Buffers poisoned with NaN are completely written by both kernels (two queries)."""
    S, d, heads = 3, 40, 8
    sources, query, gain, grad_out = make(S, d, (2, 3), [torch.float32] * S, queries=2)
    u = query * gain
    out = [torch.full((2, 3, d), float("nan"), device=DEVICE) for _ in range(2)]
    lse = torch.full((2, 2, 3, heads), float("nan"), device=DEVICE)
    rms = torch.full((6, S), float("nan"), device=DEVICE)
    route_launch.route_forward(sources, u, heads, 1e-6, out=out, lse=lse, rms=rms)
    assert all(torch.isfinite(x).all() for x in (*out, lse, rms))
    grads = [torch.full_like(v, float("nan")) for v in sources]
    route_launch.route_backward(grad_out.unbind(0), None, lse, rms, sources, u, heads, grads=grads)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("placement", ["one buffer", "skewed", "reversed", "mixed dtypes"])
def test_query_gradients_anywhere_in_memory(placement):
    """The kernels read the second query's gradient at an offset (rows and elements) from the first's: gradients in
    one buffer, apart by part of a row, in reverse order in memory, or of two dtypes all give fp64's gradients."""
    S, d, heads = 3, 40, 8
    sources, query, gain, grad_out = make(S, d, (2, 3), [torch.bfloat16] * S, queries=2, seed=13)
    u = query * gain
    _, lse, rms = route_launch.route_forward(sources, u, heads, 1e-6)
    n = grad_out[0].numel()
    buf = torch.empty(2 * n + 8, dtype=torch.bfloat16, device=DEVICE)
    first, second = buf[:n].view_as(grad_out[0]), buf[n + 8 :].view_as(grad_out[0])  # 8: not a multiple of d
    if placement == "one buffer":
        gos = list(grad_out.to(torch.bfloat16).unbind(0))
    elif placement == "mixed dtypes":
        gos = [grad_out[0].to(torch.bfloat16), grad_out[1]]
    else:
        gos = [first, second] if placement == "skewed" else [second, first]
        for g, values in zip(gos, grad_out, strict=True):
            g.copy_(values)
    grads, du = route_launch.route_backward(gos, None, lse, rms, sources, u, heads)

    ref = [v.detach().double().requires_grad_() for v in sources]
    ref_u = u.detach().double().requires_grad_()
    ones = torch.ones(d, dtype=torch.float64, device=DEVICE)
    outs = [reference.depth_route(ref, ref_u[k], ones, heads) for k in range(2)]
    torch.autograd.backward(outs, [g.to(torch.bfloat16).double() for g in gos])
    assert max(rel(a, b.grad) for a, b in zip(grads, ref, strict=True)) < TOL[torch.bfloat16]
    assert rel(du.sum(0), ref_u.grad) < TOL[torch.bfloat16]


def test_backward_tolerates_rounding_of_forward_statistics():
    """On a GPU the backward recomputes the logits in another reduction order, and the forward's lse and r carry
    approximate exp, log and rsqrt: the backward sees them a few ulp off. Perturbed so, a sharp softmax's source
    gradients must still match fp64 (weights not renormalised in the backward missed by 10x)."""
    S, d, heads = 24, 128, 2
    sources, query, gain, grad_out = make(S, d, (3, 4), [torch.float32] * S, queries=2, seed=5)
    u = query * gain * 4  # logits of std about 20: nearly one-hot weights
    _, lse, rms = route_launch.route_forward(sources, u, heads, 1e-6)
    gen = torch.Generator().manual_seed(0)
    for stat in (lse, rms):
        stat *= 1 + 4 * 2.0**-24 * torch.randn(stat.shape, generator=gen).to(stat.device)
    grads, _ = route_launch.route_backward(grad_out.unbind(0), None, lse, rms, sources, u, heads)
    ref_leaves = [v.detach().double().requires_grad_() for v in sources]
    ref = torch.stack([reference.depth_route(ref_leaves, uk.double(), torch.ones_like(uk.double()), heads) for uk in u])
    ref.backward(grad_out.double())
    assert max(rel(a, b.grad) for a, b in zip(grads, ref_leaves, strict=True)) < TOL[torch.float32]


@pytest.mark.parametrize("lazy", [True, False])
def test_forward_with_sharp_rising_logits_matches_reference(lazy, monkeypatch):
    """Logits whose running max jumps by more than RESCALE_MARGIN along depth, and in all by more than exp's fp32
    range: the mix and log-sum-exp match fp64 whether the forward moves its reference max only on such jumps (lazy:
    any one-warp launch, and the interpreter) or at every source."""
    monkeypatch.setattr(route_launch, "LAZY_RESCALE_WARPS", 1 if lazy else 0)
    S, d, heads = 16, 32, 2
    sources, query, gain, _ = make(S, d, (3, 5), [torch.float32] * S, queries=2, seed=3)
    u = query * gain * 30
    ref = [v.double() for v in sources]
    one = torch.ones(d, dtype=torch.float64, device=DEVICE)
    running = torch.stack([reference.depth_logits(ref, uk.double(), one, heads) for uk in u]).cummax(-1).values
    assert ((running[..., 1:] - running[..., :-1]) > forward_kernel.RESCALE_MARGIN.value).any()  # rescales mid-loop
    assert (running[..., -1] - running[..., 0] > 100).any()  # exp(100) overflows fp32 without a rescale
    mix, lse, _ = route_launch.route_forward(sources, u, heads, 1e-6)
    ref_mix, ref_lse = reference.depth_route_lse(ref, u.double(), torch.ones_like(u.double()), heads)
    mix, ref_mix, ref_lse = torch.stack(mix), torch.stack(ref_mix), torch.stack(ref_lse)
    assert rel(mix, ref_mix) < TOL[torch.float32] and rel(lse, ref_lse) < TOL[torch.float32]


COMPILE_FOR_HOPPER = """
import itertools, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mhar_lightning.kernels import route_launch as tr

def kind(name):
    if name == "table":
        return "*i64"
    if name.endswith("_ptr"):
        return "*bf16" if name in ("out0_ptr", "out1_ptr", "gout_ptr") else "*fp32"
    return "fp32" if name == "eps" else "i32"

extra = {tr._forward_kernel: ("forward", {}),
         tr._backward_stats_kernel: ("stats", {"HAS_GLSE": True, "SC": tr.STATS_SOURCES}),
         tr._backward_apply_kernel: ("apply", {"BR": tr.APPLY_ROWS})}
part, parts = map(int, sys.argv[1:])  # this process compiles every parts-th case from the part-th
pairwise = [(1, (0, 1), 1024), (1, (1, 2), 2048), (2, (0, 1), 2048), (2, (1, 2), 1024)]  # each pair of settings
cases = itertools.product(extra.items(), pairwise)
for (fn, (kernel, more)), (q, (k0, kr), d) in itertools.islice(cases, part, None, parts):
    bh, bdh, warps = tr.kernel_launch(kernel, d, 8)  # the launch's warps: one for the forward at d = 1024
    consts = {"BH": bh, "BDH": bdh, "K0": k0, "KR": kr, "ALIGN": True, "Q": q} | more
    if fn is tr._forward_kernel:
        consts["LAZY"] = tr.lazy_rescale(warps)
    sig = {n: "constexpr" if n in consts else kind(n) for n in fn.arg_names}
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": warps})
"""


def test_kernels_compile_for_hopper(tmp_path):
    """The interpreter runs code the compiler rejects (a loop variable re-bound to a tensor, for one), so every
    kernel is also compiled for sm_90 in processes without the interpreter: for every pair of its settings (one or
    two queries, each load kind, d = 1024 and 2048 at the launch's warps) a case that has both, in two processes
    that compile half of the cases each (a compile uses one core)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    parts = 2
    compilers = [
        subprocess.Popen([sys.executable, "-c", COMPILE_FOR_HOPPER, str(part), str(parts)], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for part in range(parts)
    ]  # fmt: skip
    for compiler in compilers:
        _, stderr = compiler.communicate()
        assert compiler.returncode == 0, stderr[-3000:]


def test_launch_shape_runs_small_row_tiles_in_one_warp():
    """A tile of up to `one_warp_tile` elements gets one warp; a larger one `elems_per_thread` per thread, with the
    head size padded to a power of two (d = 1536, H = 8: [8, 256])."""
    assert route_launch.launch_shape(1024, 8, 16, 4, False, 1024) == (8, 128, 1)
    assert route_launch.launch_shape(1024, 8, 16, 1, False, 0) == (8, 128, 2)
    assert route_launch.launch_shape(2048, 8, 16, 4, False, 1024) == (8, 256, 4)
    assert route_launch.launch_shape(1536, 8, 8, 4, False, 1024) == (8, 256, 8)
    assert route_launch.launch_shape(2048, 8, 16, 4, True, 0) == (8, 256, 1)  # the interpreter: always one


def test_kernels_refuse_more_than_two_queries():
    sources, query, gain, _ = make(2, 8, (1, 2), [torch.float32] * 2, queries=3)
    with pytest.raises(ValueError, match="1 to 2 queries per call, got 3; split them"):
        route_launch.route_forward(sources, query * gain, 1, 1e-6)


def test_compiled_autograd_matches_eager(monkeypatch):
    """With the whole backward captured by torch's compiled autograd (`throughput.py --compiled-autograd`), the
    fused ops' gradients, the log-sum-exp's included, equal those of eager autograd. Without a GPU the captured graph
    runs as traced, not through Inductor, whose C++ build of it takes most of a minute on a CPU."""
    if not CUDA:
        monkeypatch.setattr(torch._inductor, "compile", lambda graph, inputs: graph)
    dtypes = [torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16]
    sources, query, gain, grad_out = make(4, 40, (2, 3), dtypes, seed=5, queries=2)

    def grads(compiled: bool) -> list[torch.Tensor]:
        leaves = [v.detach().requires_grad_() for v in (*sources, query, gain)]
        out, lse = depth_route_lse(leaves[:4], leaves[4], leaves[5], 8, counts=(4, 3), backend="triton")
        loss = sum((m.float() * g).sum() + z.square().sum() for m, g, z in zip(out, grad_out, lse, strict=True))
        with maybe_enable_compiled_autograd(compiled, fullgraph=False, dynamic=False):
            loss.backward()
        return [v.grad for v in leaves]

    compiles = torch._dynamo.utils.counters["compiled_autograd"]["compiles"]
    for eager, captured in zip(grads(False), grads(True), strict=True):
        assert rel(captured, eager) < 1e-6
    assert torch._dynamo.utils.counters["compiled_autograd"]["compiles"] > compiles  # the backward was captured


def test_checkpointed_and_deterministic():
    """Under activation checkpointing the recomputed route gives the same gradients, bit for bit, run after run."""
    sources, query, gain, grad_out = make(4, 40, (2, 3), [torch.float32, torch.bfloat16, torch.bfloat16, torch.float32])

    def grads(checkpointed: bool) -> list[torch.Tensor]:
        leaves = [v.detach().requires_grad_() for v in (*sources, query, gain)]

        def f(*xs):
            return depth_route(list(xs[:-2]), xs[-2], xs[-1], 8, backend="triton") * 2

        out = torch.utils.checkpoint.checkpoint(f, *leaves, use_reentrant=False) if checkpointed else f(*leaves)
        out.backward(grad_out.to(out.dtype))
        return [x.grad for x in leaves]

    plain, again, ckpt = grads(False), grads(False), grads(True)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(plain, again, ckpt, strict=True))


def test_opcheck():
    sources, query, gain, grad_out = make(3, 24, (2, 3), [torch.float32, torch.bfloat16, torch.float32], queries=2)
    u = query * gain
    for counts in ([3, 3], [3, 2]):
        out, lse, rms = op.route(sources, u, 4, 1e-6, counts)
        gouts = list(grad_out.unbind(0))
        blocks = route_launch.du_blocks(sources[0].shape[:-1].numel(), len(sources))
        torch.library.opcheck(op.route_backward, (gouts, None, lse, rms, sources, u, 4, counts, blocks))
        torch.library.opcheck(
            op.route_backward, (gouts, torch.randn_like(lse), lse, rms, sources, u, 4, counts, blocks)
        )
        leaves = [v.detach().requires_grad_() for v in sources]
        torch.library.opcheck(op.route, (leaves, u.detach().requires_grad_(), 4, 1e-6, counts))


def test_compiled_graph_records_the_launch_settings(monkeypatch):
    """A gradient kernel with other rows a program (as in another kit version) misses the compiler's disk cache
    rather than meeting a graph compiled for the old shape of du's partial sums; both give the same gradients."""
    sources, query, gain, _ = make(3, 16, (2, 40), [torch.float32] * 3)
    grads = []
    for rows in (route_launch.APPLY_ROWS, route_launch.APPLY_ROWS // 4):
        torch._dynamo.reset()
        monkeypatch.setattr(route_launch, "APPLY_ROWS", rows)
        leaves = [v.detach().requires_grad_() for v in (*sources, query, gain)]
        loss = torch.compile(lambda *xs: depth_route(list(xs[:3]), *xs[3:], 4, backend="triton").square().sum())
        loss(*leaves).backward()
        grads.append([x.grad for x in leaves])
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(*grads, strict=True))

def test_stale_block_count_is_a_clear_error():
    """A compiled graph that expects another number of du partial sums (launch settings of another kit version)."""
    sources, query, gain, grad_out = make(2, 24, (2, 3), [torch.float32] * 2)
    u = (query * gain).reshape(1, -1)
    _, lse, rms = op.route(sources, u, 4, 1e-6, [2])
    blocks = route_launch.du_blocks(6, 2)
    with pytest.raises(RuntimeError, match=f"expects {blocks + 1} partial sums, the kernels write {blocks}.*Clear"):
        op.route_backward([grad_out.reshape(2, 3, 24)], None, lse, rms, sources, u, 4, [2], blocks + 1)


@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
def test_compiled_without_gradients_matches_reference(no_grad):
    """Compiled evaluation (a validation between training steps) routes over any number of sources: dynamo once
    passed the fused route's arguments shifted by one at exactly two sources."""
    sources, query, gain, _ = make(3, 16, (2, 3), [torch.float32] * 3, queries=2)
    route = torch.compile(
        lambda *src: depth_route_lse(list(src), query, gain, 4, counts=(len(src), 1), backend="triton"),
        backend="eager",
        fullgraph=True,
    )
    for n in (1, 2, 3):
        with no_grad():
            (mix, first), (lse, _) = route(*sources[:n])
        want, want_lse = reference.depth_route_lse(sources[:n], query[0], gain[0], 4)
        assert rel(mix, want) < TOL[torch.float32] and rel(lse, want_lse) < TOL[torch.float32]
        assert rel(first, sources[0]) < TOL[torch.float32]
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU"))]
)
@pytest.mark.parametrize("residual", ["mhar", "delta-mhar"])
def test_compiled_decoder_block_fullgraph(monkeypatch, residual, compiler):
    """A real decoder block (block MHAR, delta-MHAR with its stride-0 null source) traces without graph breaks and
    gives eager's gradients, also through Inductor's generated code on the GPU (slow to compile on the CPU)."""
    from mhar_lightning.config import ModelConfig
    from mhar_lightning.model import Decoder, rope_cache
    from mhar_lightning.residual import make_residual

    monkeypatch.setenv(ENV_BACKEND, "triton")
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", d_model=32, n_layers=2, ffn_hidden=64, max_seq_len=8)
    kwargs = {"heads": 4, "blocks": 2} if residual == "mhar" else {"heads": 4, "block_size": 1}
    model = Decoder(cfg, make_residual(residual, **kwargs)).to(DEVICE)
    with torch.no_grad():  # away from the zero init, so every routing weight and gradient is exercised
        for name, p in model.named_parameters():
            if name.split(".")[-1] in ("query", "gate", "null"):
                p.normal_()
    block = model.blocks[1]
    stream = (*model.final_residual.start(torch.randn(2, 4, 32, device=DEVICE)), torch.randn(2, 4, 32, device=DEVICE))
    rope = rope_cache(cfg, 4, torch.device(DEVICE))
    out = torch.compile(block, fullgraph=True, backend=compiler)(stream, rope)
    sum(o.square().sum() for o in out).backward(retain_graph=True)
    grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    ref = block(stream, rope)
    sum(o.square().sum() for o in ref).backward()
    assert all(rel(a, b) < 1e-5 for a, b in zip(out, ref, strict=True))
    assert all(rel(a, p.grad) < 1e-5 for a, p in zip(grads, block.parameters(), strict=True))


def test_dispatch(monkeypatch):
    x = [torch.randn(2, 8, device=DEVICE)]
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    assert resolve_backend("auto", x) == ("triton" if CUDA else "reference")
    assert resolve_backend("triton", x) == "triton"
    monkeypatch.setenv(ENV_BACKEND, "reference")
    assert resolve_backend("auto", x) == "reference"
    assert resolve_backend("triton", x) == "triton"
    monkeypatch.setenv(ENV_BACKEND, "triton")
    assert resolve_backend("auto", x) == "triton"
    monkeypatch.setenv(ENV_BACKEND, "fast")
    with pytest.raises(ValueError):
        resolve_backend("auto", x)
    with pytest.raises(ValueError):
        resolve_backend("cuda", x)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_graph_capture_is_refused_cuda():
    """A replayed graph would read pointer tables the cache may have freed: capture fails with a clear error."""
    sources, query, gain, _ = make(2, 64, (2, 3), [torch.float32] * 2, device="cuda")
    depth_route(sources, query, gain, 2, backend="triton")
    with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            depth_route(sources, query, gain, 2, backend="triton")


def test_heads_must_divide_width():
    with pytest.raises(ValueError, match="must divide"):
        x = torch.randn(2, 12, device=DEVICE)
        depth_route([x], x[0], x[1], 5, backend="triton")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,d,heads", [(1, 1536, 1), (9, 1536, 8), (17, 3072, 16), (64, 1024, 2), (5, 2048, 4)])
def test_matches_reference_cuda(S, d, heads, dtype):
    sources, query, gain, grad_out = make(S, d, (4, 33), [dtype] * S, device="cuda", seed=S + d + heads)
    check_against_reference(sources, query, gain, grad_out, heads, TOL[dtype])
    sources, query, gain, grad_out = make(S, d, (4, 33), [dtype] * S, device="cuda", seed=S + d, queries=2)
    check_against_reference(sources, query, gain, grad_out, heads, TOL[dtype])


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_mixed_and_broadcast_cuda():
    dtypes = [torch.float32, torch.bfloat16, torch.bfloat16, torch.float32]
    sources, query, gain, grad_out = make(4, 1536, (2, 64), dtypes)
    null = torch.randn(1536, device="cuda")
    check_against_reference([null.expand_as(sources[0]), *sources], query, gain, grad_out, 8, TOL[torch.bfloat16])
