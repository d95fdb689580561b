"""specdec.math.argmax is torch.argmax(dim=-1), index for index: ties (the first maximum), -inf rows, NaN (counted
as the maximum), strided views, 1-D and 3-D inputs, float32 and float64 through numpy, other dtypes through
PyTorch."""

from __future__ import annotations

import pytest
import torch

from specdec.math.argmax import argmax


def cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(9, 49152, generator=g)
    rows[1, 10] = rows[1, 20] = rows[1, 30000] = 1e4  # a tie: the first wins
    rows[2] = float("-inf")
    rows[2, 7] = -1e30
    rows[3] = float("-inf")  # all -inf: index 0
    rows[4, 5] = rows[4, 9] = float("nan")  # NaN is the maximum: the first NaN
    rows[5] = 0.0  # all equal
    rows[6] = torch.round(rows[6])  # many ties among integers
    return [rows, rows[:, ::3], rows[0], torch.randn(2, 3, 17, generator=g), rows.double(), rows.half(),
            rows.bfloat16(), torch.randint(0, 5, (4, 50), generator=g)]


@pytest.mark.parametrize("i", range(8))
def test_argmax_is_torchs(i):
    x = cases()[i]
    with torch.inference_mode():
        got = argmax(x)
    assert got.dtype == torch.int64 and got.shape == x.argmax(dim=-1).shape
    assert torch.equal(got, x.argmax(dim=-1))
