"""The merged read and its pre-norm with the fused backward against the fp64 reference (CPU through
TRITON_INTERPRET, or the GPU)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.utils.checkpoint
from mhar_lightning.kernels import merge_norm, op, reference, triton_merge
from torch._dynamo.utils import maybe_enable_compiled_autograd

from mhar_lightning.norm import rms_norm

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all()
    return ((a.double() - b.double()).norm() / max(b.double().norm().item(), 1e-30)).item()


def make(d, heads, lead, dtype, device=DEVICE, seed=0):
    """Fresh random route (mix and per-head log-sum-exp), added source, query, key gain, norm gain and upstream
    gradient; logits and log-sum-exps of similar size, so both sides of every two-way softmax carry weight."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen) * scale + shift).to(device)

    mix, source = randn(*lead, d).to(dtype), randn(*lead, d, scale=2.0).to(dtype)
    lse = randn(*lead, heads, scale=0.5)
    query, gain = randn(d, scale=2.0 / (d / heads) ** 0.5), randn(d, scale=0.2, shift=1.0)
    weight = randn(d, scale=0.2, shift=1.0)
    return mix, lse, source, query, gain, weight, randn(*lead, d)


def check(d, heads, lead, dtype, autocast=False, seed=0):
    """Output and every gradient (mix, lse, source, query, key gain, norm gain) of the Triton path vs fp64."""
    inputs = make(d, heads, lead, dtype, seed=seed)
    leaves = [x.detach().requires_grad_() for x in inputs[:-1]]
    mix, lse, source, query, gain, weight = leaves
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        out = merge_norm(mix, lse, source, query, gain, heads, weight, 1e-6, 1e-5, backend="triton")
    expected_dtype = torch.bfloat16 if autocast else torch.promote_types(dtype, torch.float32)
    assert out.dtype == expected_dtype
    go = inputs[-1].to(out.dtype)
    out.backward(go)

    ref_leaves = [x.detach().double().requires_grad_() for x in inputs[:-1]]
    ref = rms_norm(reference.merge_source(*ref_leaves[:5], heads, 1e-6), ref_leaves[5], 1e-5)
    ref.backward(go.double())
    assert rel(out, ref) < TOL[torch.bfloat16 if torch.bfloat16 in (dtype, out.dtype) else torch.float32]
    for name, a, b in zip(("mix", "lse", "source", "query", "gain", "weight"), leaves, ref_leaves, strict=True):
        assert a.grad.dtype == a.dtype, name
        assert rel(a.grad, b.grad) < TOL[dtype], name


CASES = [(8, 1), (24, 4), (40, 8), (48, 16), (12, 2), (64, 8), (192, 2)]  # non-power-of-two widths and heads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,heads", CASES)
def test_matches_reference(d, heads, dtype):
    check(d, heads, (3, 7), dtype, seed=d + heads)  # 21 rows: two backward programs, the second partly full


def test_autocast_output_and_leading_dims():
    """Under autocast the normed row leaves in the autocast dtype, as the sublayer's matmuls would cast it."""
    check(40, 4, (2, 3, 5), torch.bfloat16, autocast=True)


def test_gradients_fully_overwritten():
    """Gradient buffers poisoned with NaN are completely written by the backward kernel."""
    mix, lse, source, query, gain, weight, go = make(40, 8, (3, 7), torch.float32)
    u = query * gain
    _, stats = triton_merge.merge_norm_forward(mix, lse, source, u, weight, 8, 1e-6, 1e-5, mix.dtype)
    grads = tuple(torch.full_like(x, float("nan")) for x in (mix, lse, source))
    results = triton_merge.merge_norm_backward(go, mix, source, u, weight, stats, 8, grads=grads)
    assert all(torch.isfinite(x).all() for x in results)


def test_opcheck():
    mix, lse, source, query, gain, weight, go = make(24, 4, (2, 3), torch.bfloat16)
    u = query * gain
    _, stats = triton_merge.merge_norm_forward(mix, lse, source, u, weight, 4, 1e-6, 1e-5, torch.bfloat16)
    blocks = triton_merge.backward_blocks(stats.shape[0])
    torch.library.opcheck(op.merge_norm_backward_op, (go.to(torch.bfloat16), mix, source, u, weight, stats, 4, blocks))
    with pytest.raises(RuntimeError, match="expects .* partial sums"):
        op.merge_norm_backward_op(go.to(torch.bfloat16), mix, source, u, weight, stats, 4, blocks + 1)


def gradients(inputs, heads: int, checkpointed: bool = False, compiled_autograd: bool = False) -> list[torch.Tensor]:
    """Every input's gradient of the fused path (under activation checkpointing or compiled autograd if asked)."""
    leaves = [x.detach().requires_grad_() for x in inputs[:-1]]

    def f(*xs):
        return merge_norm(*xs[:5], heads, xs[5], backend="triton")

    out = torch.utils.checkpoint.checkpoint(f, *leaves, use_reentrant=False) if checkpointed else f(*leaves)
    with maybe_enable_compiled_autograd(compiled_autograd, fullgraph=False, dynamic=False):
        out.backward(inputs[-1].to(out.dtype))
    return [x.grad for x in leaves]


def test_checkpointed_and_deterministic():
    """Recomputed under activation checkpointing, the merged read gives the same gradients, bit for bit, run after
    run (no state kept across calls; parameter gradients reduced without atomics)."""
    inputs = make(40, 8, (3, 7), torch.bfloat16, seed=4)
    plain, again, ckpt = (gradients(inputs, 8, checkpointed=c) for c in (False, False, True))
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(plain, again, ckpt, strict=True))


def test_compiled_autograd_matches_eager(monkeypatch):
    """With the backward captured by compiled autograd (`model.compiled_autograd: true`), gradients equal eager's.
    Without a GPU the captured graph runs as traced, not through Inductor's slow C++ build on a CPU."""
    if not CUDA:
        monkeypatch.setattr(torch._inductor, "compile", lambda graph, inputs: graph)
    inputs = make(40, 8, (3, 7), torch.float32, seed=6)
    compiles = torch._dynamo.utils.counters["compiled_autograd"]["compiles"]
    for eager, captured in zip(gradients(inputs, 8), gradients(inputs, 8, compiled_autograd=True), strict=True):
        assert rel(captured, eager) < 1e-6
    assert torch._dynamo.utils.counters["compiled_autograd"]["compiles"] > compiles  # the backward was captured


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_traced_by_torch_compile_matches_eager(dtype):
    """Traced into a compiled graph (as in a compiled block) and followed by a matmul, the fused path gives eager's
    gradients. Under torch 2.11 an output made by a no-op `to` (no autocast, so the normed row already had the
    output dtype) came back with no gradient."""
    inputs = make(32, 4, (2, 4), dtype, seed=7)
    proj = torch.randn(32, 16, device=DEVICE, dtype=torch.promote_types(dtype, torch.float32))

    def f(mix, lse, source, query, gain, weight):
        return (merge_norm(mix, lse, source, query, gain, 4, weight, backend="triton") @ proj).square().sum()

    def grads(fn):
        leaves = [x.detach().requires_grad_() for x in inputs[:-1]]
        fn(*leaves).backward()
        return [x.grad for x in leaves]

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for name, a, b in zip(("mix", "lse", "source", "query", "gain", "weight"), grads(compiled), grads(f), strict=True):
        assert rel(a, b) < 1e-6, name


def test_shapes_checked():
    mix, lse, source, query, gain, weight, _ = make(24, 4, (2, 3), torch.float32)
    with pytest.raises(ValueError, match="merge_norm needs mix and source of one shape"):
        merge_norm(mix, lse[..., :2], source, query, gain, 4, weight, backend="triton")


COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mhar_lightning.kernels import triton_merge as tm

fn = tm._merge_norm_backward_kernel
for bf16 in (False, True):
    consts = {"BH": 8, "BDH": 128, "ROUND": bf16, "BR": tm.BACKWARD_ROWS}
    def kind(name):
        if name.endswith("_ptr"):
            return "*bf16" if bf16 and name in ("mix_ptr", "src_ptr", "g_ptr", "dmix_ptr", "dsrc_ptr") else "*fp32"
        return "i32"
    sig = {n: "constexpr" if n in consts else kind(n) for n in fn.arg_names}
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4})
"""


def test_kernels_compile_for_hopper(tmp_path):
    """The kernel also compiles for sm_90 (fp32 and bf16 rows) in a process without the interpreter, which accepts
    code the compiler rejects."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,heads", [(1024, 8), (1536, 8), (2048, 16), (3072, 1)])
def test_matches_reference_cuda(d, heads, dtype):
    check(d, heads, (4, 65), dtype, seed=d + heads)
    check(d, heads, (4, 65), dtype, autocast=True, seed=d)


def test_bf16_backward_reads_the_rows_the_forward_stored():
    """With bf16 rows the forward stores the merged row and its normalised form in bf16; the backward kernel
    recomputes them rounded alike, so the norm gain's gradient, sum g * n, is exact for the stored n (the unrounded
    n is about 2e-3 off)."""
    mix, lse, source, query, gain, weight, go = make(64, 8, (4, 16), torch.bfloat16, seed=3)
    weight.requires_grad_()
    merge_norm(mix, lse, source, query, gain, 8, weight, backend="triton").backward(go)
    stored = rms_norm(reference.merge_source(mix, lse, source, query, gain, 8, 1e-6), torch.ones_like(weight), 1e-5)
    assert stored.dtype == torch.float32 and torch.equal(stored, stored.bfloat16().float())
    assert rel(weight.grad, (go.double() * stored.double()).flatten(0, -2).sum(0)) < 1e-5
