"""Inference on trained checkpoints: generation, evaluation over prepared data, and the lm-evaluation-harness model."""
