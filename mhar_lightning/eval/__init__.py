"""Inference on trained checkpoints: generation, evaluation over prepared data, and the lm-evaluation-harness model.

With lm-evaluation-harness installed (`pip install "mhar-lightning[eval]"`), importing this package registers the
lm-eval model `mhar` (`MharLM`).
"""

import importlib.util

if importlib.util.find_spec("lm_eval") is not None:
    from mhar_lightning.eval.harness import MharLM

    __all__ = ["MharLM"]
