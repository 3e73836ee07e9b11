"""Depth routing: one dispatch point in front of the pure-PyTorch reference and the fused Triton kernels.

What a routing call computes, per token (DESIGN.md's notation): sources v_0 .. v_{S-1} ([..., d] each), a
pseudo-query w and a key RMSNorm gain g ([d] each, a `RouteQuery`) folded into u = w * g, H heads of d / H:

    r_n     = (mean_d(v_n^2) + eps)^(-1/2)           one RMS over the full width, in fp32
    z_{n,h} = r_n <u[h], v_n[h]>                     logits, no 1/sqrt(d) scale
    out[h]  = sum_n softmax_n(z_{.,h}) v_n[h]        each head mixes its own slice of the raw sources
    lse_h   = logsumexp_n z_{n,h}

[Q, d] queries route Q queries over the same sources, query k reading the first counts[k]. One more source joins a
finished route exactly through its log-sum-exp (`merge_source`): out' = out + sigmoid(z_new - lse) (v_new - out).

`backend="auto"` picks the fused Triton op for CUDA tensors and the reference otherwise; the environment variable
`MHAR_ROUTE_BACKEND` (`triton` or `reference`) overrides `auto`, and an explicit `backend=` argument overrides both.
The Triton path runs on CPU tensors only under `TRITON_INTERPRET=1` (the test setup).
"""

import sys

if __name__ != "mhar_lightning.kernels":
    # Python started in the repository root (`python -c`, a script or a notebook beside the README) finds this folder
    # as a top-level `kernels` before an installed package of that name (Hugging Face's, which `transformers`
    # imports): load the installed one in its place, as Python started anywhere else would.
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec
    from pathlib import Path

    _root = Path(__file__).resolve().parents[1]
    _spec = PathFinder.find_spec(__name__, [entry for entry in sys.path if Path(entry or ".").resolve() != _root])
    if _spec is None:
        raise ModuleNotFoundError(
            f"No module named {__name__!r} (the folder {__name__}/ of this repository is mhar_lightning.{__name__})",
            name=__name__,
        )
    sys.modules[__name__] = module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[__name__])
else:
    from mhar_lightning.kernels.dispatch import *  # noqa: F403 (the public API: dispatch.__all__)
    from mhar_lightning.kernels.dispatch import __all__  # noqa: F401
