"""The fused hyper-connections boundary against its fp64 reference (CPU through TRITON_INTERPRET, or the GPU)."""

import os
import subprocess
import sys

import pytest
import torch

from mhar_lightning.config import ModelConfig
from mhar_lightning.kernels import ENV_BACKEND
from mhar_lightning.kernels.hyper_connections import boundary_reference, hc_boundary
from mhar_lightning.model import Decoder
from mhar_lightning.residual import HyperConnections

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all()
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def boundary_inputs(lead: tuple[int, ...], n: int, d: int, write: bool, seed: int = 0) -> list[torch.Tensor | None]:
    """Streams, a sublayer output, mix and write weights (if `write`), a projection, static weights and scales, all
    fp64 and away from the initialisation (the dynamic terms are not small)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    eye = torch.eye(n, dtype=torch.float64)
    optional = [r(*lead, d), eye + 0.2 * r(*lead, n, n), 1 + 0.2 * r(*lead, n)] if write else [None] * 3
    return [r(*lead, n, d) * 2, *optional, r(d, n + 2) * 2 / d**0.5, eye[0] + 0.2 * r(n), eye + 0.2 * r(n, n),
            1 + 0.2 * r(n), torch.tensor([0.4, 0.3], dtype=torch.float64)]  # fmt: skip


@pytest.mark.parametrize(
    ("lead", "n", "d", "write"),
    [((2, 5), 4, 96, True), ((7,), 4, 64, False), ((3, 2), 2, 32, True), ((3,), 8, 48, True), ((1, 9), 4, 256, True)],
)
def test_fused_boundary_matches_fp64_reference(lead, n, d, write) -> None:
    """Every output and every input's gradient, in fp32 against fp64 (tokens that do not fill the last program,
    widths that are not powers of two, with and without the write)."""
    inputs = boundary_inputs(lead, n, d, write)
    want_in = [None if t is None else t.clone().requires_grad_() for t in inputs]
    got_in = [None if t is None else t.to(DEVICE, torch.float32).requires_grad_() for t in inputs]
    want = boundary_reference(*want_in, EPS)
    got = hc_boundary(*got_in, EPS, backend="triton")
    first = 0 if write else 1  # without a write the streams pass through unchanged
    for a, b in zip(got[first:], want[first:]):
        assert rel(a.cpu(), b) < 2e-6
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in want[first:]]
    torch.autograd.backward(want[first:], grads)
    torch.autograd.backward(got[first:], [x.to(DEVICE, torch.float32) for x in grads])
    for i, (a, b) in enumerate(zip(got_in, want_in)):
        if b is not None:
            assert rel(a.grad.cpu(), b.grad) < 5e-6, f"input {i}"


def test_bf16_streams_stay_within_bf16_rounding() -> None:
    """Streams and sublayer output in bf16 (FSDP2's compute dtype): statistics in fp32, outputs within bf16's
    rounding of the fp64 reference."""
    inputs = boundary_inputs((3, 5), 4, 64, True)
    want = boundary_reference(*inputs, EPS)
    low = [t.to(DEVICE, torch.bfloat16) if i < 2 else t.to(DEVICE, torch.float32) for i, t in enumerate(inputs)]
    got = hc_boundary(*low, EPS, backend="triton")
    for a, b in zip(got, want):
        assert rel(a.cpu(), b) < 2e-2


def test_boundary_op_passes_opcheck() -> None:
    """Fake shapes, schema and autograd registration of `mhar::hc_boundary` agree with its real outputs."""
    h, y, mix, write, w, read0, mix0, write0, scale = (
        None if t is None else t.to(DEVICE, torch.float32) for t in boundary_inputs((6,), 4, 32, True)
    )
    w = torch.nn.functional.pad(w, (0, 10))
    for args in ((h, y, mix, write), (h, None, None, None)):
        inputs = [t if t is None else t.clone().requires_grad_() for t in args]
        torch.library.opcheck(
            torch.ops.mhar.hc_boundary,
            (*inputs, w.clone().requires_grad_(), read0, mix0, write0, scale, EPS, False),
            test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
        )


def test_decoder_through_the_fused_boundary_matches_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hyper-connections decoder with trained-looking weights: logits and every gradient through the fused
    boundaries equal those through the reference (fp32)."""
    config = ModelConfig.preset("tiny", vocab_size=64, d_model=32, n_heads=2, n_kv_heads=2, n_layers=2, ffn_hidden=64)
    torch.manual_seed(0)
    model = Decoder(config, HyperConnections()).to(DEVICE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".residual." in name:
                p.normal_(std=0.3)
    tokens = torch.randint(0, 64, (2, 12), device=DEVICE)
    results = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv(ENV_BACKEND, backend)
        model.zero_grad()
        logits = model(tokens)
        logits.square().mean().backward()
        results[backend] = logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    (ref_logits, ref_grads), (logits, grads) = results["reference"], results["triton"]
    assert rel(logits, ref_logits) < 1e-5
    for name, grad in ref_grads.items():
        assert rel(grads[name], grad) < 1e-4, name


def test_compiled_blocks_trace_the_fused_boundary_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each block compiles as one graph through `mhar::hc_boundary` (its fake and autograd registrations), and the
    compiled model gives the eager logits and gradients."""
    monkeypatch.setenv(ENV_BACKEND, "triton")
    config = ModelConfig.preset("tiny", vocab_size=64, d_model=32, n_heads=2, n_kv_heads=2, n_layers=2, ffn_hidden=64)
    torch.manual_seed(0)
    model = Decoder(config, HyperConnections()).to(DEVICE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".residual." in name:
                p.normal_(std=0.3)
    tokens = torch.randint(0, 64, (2, 12), device=DEVICE)
    runs = []
    for compiled in (False, True):
        if compiled:
            torch._dynamo.reset()
            for block in model.blocks:
                block.compile(backend="aot_eager", fullgraph=True)
        model.zero_grad()
        logits = model(tokens)
        logits.square().mean().backward()
        runs.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    torch._dynamo.reset()
    (eager, eager_grads), (logits, grads) = runs
    assert rel(logits, eager) < 1e-6
    for a, b in zip(grads, eager_grads):
        assert rel(a, b) < 1e-5


COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mhar_lightning.kernels import hyper_kernels as hk

def kind(name, f32):
    if name in ("y_ptr", "g_y_ptr"):
        return "*bf16"
    if name == "w_ptr":
        return "*fp32" if f32 else "*bf16"
    return "*fp32" if name.endswith("_ptr") else "fp32" if name == "eps" else "i32"

unused_without_write = {"y_ptr", "mix_ptr", "write_ptr", "hn_ptr", "g_hn_ptr", "g_y_ptr", "g_mix_ptr", "g_write_ptr"}
for fn in (hk._boundary_forward_kernel, hk._boundary_backward_kernel):
    for write, f32 in ((True, False), (False, True)):
        consts = {"N": 4, "R": hk.ROWS // 4, "BD": hk.COLUMNS, "CP": 16, "WRITE": write, "F32": f32}
        if "G_HN" in fn.arg_names:
            consts["G_HN"] = write
        if not write:
            consts |= {n: None for n in unused_without_write if n in fn.arg_names}
        sig = {n: "constexpr" if n in consts else kind(n, f32) for n in fn.arg_names}
        triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": hk.WARPS})
"""


def test_kernels_compile_for_hopper(tmp_path) -> None:
    """The interpreter runs code the compiler rejects, so both kernels are also compiled for sm_90 without it: with
    and without the write, the projection in bf16 and in fp32."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True,
                          cwd=tmp_path)  # not the checkout, whose source folders would shadow the installed package
    assert done.returncode == 0, done.stderr[-3000:]
