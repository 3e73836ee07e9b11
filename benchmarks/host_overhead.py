"""Host (Python) time per routing call, layer by layer, on a problem small enough that the GPU never binds.

At 350m a training step makes about 50 routing calls; when each costs more host time than GPU time the GPU
waits. This times, per call: an allocation, the cached pointer table, a bare Triton launch, the launchers,
the library ops, eager forward + backward, and a compiled forward + backward against a compiled graph of the
same inputs without routing.

    python benchmarks/host_overhead.py                  # on the GPU
    python benchmarks/host_overhead.py --stub-kernels   # any machine: the op layers alone, kernels stubbed
"""

import argparse
import os
import time

import torch
from mhar_lightning.kernels import depth_route, depth_route_lse, op, route_launch, rows

S, D, HEADS, TOKENS = 5, 1024, 8, 8


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timeit(name: str, fn, n: int = 1000) -> None:
    """Mean time per call over n calls after warm-up; the GPU work is negligible, so this is host time."""
    for _ in range(30):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    sync()
    print(f"{name:44s} {(t1 - t0) / n * 1e6:8.1f} us", flush=True)


def stub_kernels() -> None:
    """Replace both launchers by shaped empty outputs, so what is timed is the host cost of the layers above them;
    TRITON_INTERPRET=1 lets `backend="triton"` take CPU tensors (no kernel runs)."""
    os.environ["TRITON_INTERPRET"] = "1"

    def forward(sources, u, heads, eps, counts=(), out=None, lse=None, rms=None):
        lead = sources[0].shape[:-1]
        out = [torch.empty(*lead, u.shape[-1], dtype=route_launch.out_dtype(sources)) for _ in range(u.shape[0])]
        return out, torch.empty(u.shape[0], *lead, heads), torch.empty(lead.numel(), len(sources))

    def backward(grad_out, grad_lse, lse, rms, sources, u, heads, counts=(), grads=None):
        du = torch.empty(route_launch.du_blocks(sources[0].shape[:-1].numel(), len(sources)), *u.shape)
        return [torch.empty_like(v) for v in sources], du

    route_launch.route_forward, route_launch.route_backward = forward, backward


def time_shared_call(device: str) -> None:
    """Forward + grad of the model's two-query call (second query one source short), eager and compiled."""
    src = [torch.randn(1, TOKENS, D, device=device).requires_grad_() for _ in range(S)]
    q, w = torch.randn(2, D, device=device, requires_grad=True), torch.randn(2, D, device=device, requires_grad=True)
    leaves, go = [*src, q, w], [torch.randn(1, TOKENS, D, device=device) for _ in range(2)]

    def shared(*a):
        out, lse = depth_route_lse(list(a[:S]), a[S], a[S + 1], HEADS, counts=(S, S - 1), backend="triton")
        return [mix * 2 + z.sum() for mix, z in zip(out, lse, strict=True)]

    compiled = torch.compile(shared, fullgraph=True)
    timeit("two-query call fwd+grad eager", lambda: torch.autograd.grad(shared(*leaves), leaves, go))
    timeit("two-query call fwd+grad compiled", lambda: torch.autograd.grad(compiled(*leaves), leaves, go))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stub-kernels", action="store_true", help="time the op layers alone, on any machine")
    if parser.parse_args().stub_kernels:
        stub_kernels()
        time_shared_call("cpu")
        return
    dtypes = [torch.float32] + [torch.bfloat16] * (S - 1)
    src = [torch.randn(1, TOKENS, D, device="cuda").to(dt).requires_grad_() for dt in dtypes]
    q = torch.zeros(D, device="cuda", requires_grad=True)
    w = torch.ones(D, device="cuda", requires_grad=True)
    u, go = (q * w).detach()[None], torch.randn(1, TOKENS, D, device="cuda")
    lead = src[0].shape[:-1]
    out, lse, rms = route_launch.route_forward(src, u, HEADS, 1e-6)
    table, _, aligned, k0, kr = rows.pointer_table(src, lead)
    bh, bdh, warps = route_launch.kernel_launch("forward", D, HEADS)

    args = (table, S, S, S, u, out[0], out[0], lse, rms, TOKENS, TOKENS, D, HEADS, D // HEADS, 1e-6)
    constexprs = dict(BH=bh, BDH=bdh, K0=k0, KR=kr, ALIGN=aligned, Q=1, LAZY=route_launch.lazy_rescale(warps))

    def bare_launch():
        route_launch._forward_kernel[(TOKENS,)](*args, **constexprs, num_warps=warps)

    timeit("torch.empty", lambda: torch.empty(TOKENS, D, device="cuda"))
    timeit("pointer_table (cached)", lambda: rows.pointer_table(src, lead))
    timeit("bare _forward_kernel launch", bare_launch)
    timeit("route_forward (launcher)", lambda: route_launch.route_forward(src, u, HEADS, 1e-6))
    timeit("route_backward (launcher)", lambda: route_launch.route_backward([go], None, lse, rms, src, u, HEADS))
    timeit("op.route (library op)", lambda: op.route(src, u, HEADS, 1e-6, [S]))
    blocks = route_launch.du_blocks(TOKENS, S)
    timeit(
        "op.route_backward (library op)", lambda: op.route_backward([go], None, lse, rms, src, u, HEADS, [S], blocks)
    )
    leaves = [*src, q, w]
    timeit("depth_route fwd+grad eager", lambda: torch.autograd.grad(depth_route(src, q, w, HEADS), leaves, go))
    routed = torch.compile(lambda *a: depth_route(list(a[:S]), a[S], a[S + 1], HEADS) * 2)
    timeit("compiled fwd+grad", lambda: torch.autograd.grad(routed(*leaves), leaves, go), n=300)
    plain = torch.compile(lambda *a: sum(a[:S]) * 2)
    timeit("compiled sum-of-sources fwd+grad (baseline)", lambda: torch.autograd.grad(plain(*src), src, go), n=300)
    time_shared_call("cuda")


if __name__ == "__main__":
    main()
