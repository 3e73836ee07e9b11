"""Host (Python) time per routing call, layer by layer, on a problem small enough that the GPU never binds.

At 350m a training step makes about 50 routing calls; when each costs more host time than GPU time the GPU
waits. This times, per call: an allocation, the cached pointer table, a bare Triton launch, the launchers,
the custom ops, eager forward + backward, and a compiled forward + backward against a compiled graph of the
same inputs without routing.

    python benchmarks/host_overhead.py
"""

import time

import torch
from mhar_lightning.kernels import depth_route, op, triton_route

S, D, HEADS, TOKENS = 5, 1024, 8, 8


def timeit(name: str, fn, n: int = 1000) -> None:
    """Mean time per call over n calls after warm-up; the GPU work is negligible, so this is host time."""
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    print(f"{name:44s} {(t1 - t0) / n * 1e6:8.1f} us", flush=True)


def main() -> None:
    dtypes = [torch.float32] + [torch.bfloat16] * (S - 1)
    src = [torch.randn(1, TOKENS, D, device="cuda").to(dt).requires_grad_() for dt in dtypes]
    q = torch.zeros(D, device="cuda", requires_grad=True)
    w = torch.ones(D, device="cuda", requires_grad=True)
    u, go = (q * w).detach()[None], torch.randn(1, TOKENS, D, device="cuda")
    lead = src[0].shape[:-1]
    out, lse = triton_route.route_forward(src, u, HEADS, 1e-6)
    table, _, aligned, k0, kr = triton_route._table(src, lead)
    bh, bdh, warps = triton_route._launch_shape(D, HEADS, triton_route.ROW_ELEMS_PER_THREAD, False)

    args = (table, S, S, S, u, out, lse, TOKENS, TOKENS, D, HEADS, D // HEADS, 1e-6)
    constexprs = dict(BH=bh, BDH=bdh, K0=k0, KR=kr, ALIGN=aligned, Q=1)

    def bare_launch():
        triton_route._forward_kernel[(TOKENS,)](*args, **constexprs, num_warps=warps)

    timeit("torch.empty", lambda: torch.empty(TOKENS, D, device="cuda"))
    timeit("_table (cached)", lambda: triton_route._table(src, lead))
    timeit("bare _forward_kernel launch", bare_launch)
    timeit("route_forward (launcher)", lambda: triton_route.route_forward(src, u, HEADS, 1e-6))
    timeit("route_backward (launcher)", lambda: triton_route.route_backward(go[None], None, lse, src, u, HEADS, 1e-6))
    timeit("op.route (custom op)", lambda: op.route(src, u, HEADS, 1e-6, [S]))
    timeit("op.route_backward (custom op)", lambda: op.route_backward(go[None], None, lse, src, u, HEADS, 1e-6, [S]))
    leaves = [*src, q, w]
    timeit("depth_route fwd+grad eager", lambda: torch.autograd.grad(depth_route(src, q, w, HEADS), leaves, go))
    routed = torch.compile(lambda *a: depth_route(list(a[:S]), a[S], a[S + 1], HEADS) * 2)
    timeit("compiled fwd+grad", lambda: torch.autograd.grad(routed(*leaves), leaves, go), n=300)
    plain = torch.compile(lambda *a: sum(a[:S]) * 2)
    timeit("compiled sum-of-sources fwd+grad (baseline)", lambda: torch.autograd.grad(plain(*src), src, go), n=300)


if __name__ == "__main__":
    main()
