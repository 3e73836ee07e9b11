"""The finiteness check (one `aminmax` per tensor) against `torch.isfinite(t).all()`, in every floating dtype."""

import pytest
import torch

from mhar_lightning.checkpoint.finite import finite, nonfinite_tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e5m2])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
def test_finite_agrees_with_isfinite(dtype: torch.dtype, bad: float | None) -> None:
    values = torch.randn(3, 257, generator=torch.Generator().manual_seed(0)).to(dtype)
    if bad is not None:
        values[2, 100] = bad
    assert finite(values) == bool(torch.isfinite(values.float()).all()) == (bad is None)
    assert finite(values.t()) == (bad is None)  # a non-contiguous view


def test_nonfinite_tensors_name_each_bad_tensor_in_nested_state() -> None:
    state = {"state": {0: {"exp_avg": torch.zeros(2), "exp_avg_sq": torch.tensor([1.0, float("inf")])}},
             "steps": [torch.tensor(3), torch.tensor([float("nan")])], "ids": torch.tensor([1, 2])}  # fmt: skip
    assert list(nonfinite_tensors(state, "optimizer")) == ["optimizer.state.0.exp_avg_sq", "optimizer.steps.1"]
