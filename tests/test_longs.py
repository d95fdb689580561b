"""specdec.engine.longs: the same tensors torch.tensor builds from Python ints (values, dtype, shape, device)."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.longs import longs


@pytest.mark.parametrize("values", [
    [], [0], [5, -3, 2**62, -(2**63)], list(range(1000)),
    [[1, 2, 3], [4, 5, 6]], [[], []], [[7], [8], [9], [10]],
])
def test_longs_is_torch_tensor_of_the_ints(values):
    got, want = longs(values), torch.tensor(values, dtype=torch.long)
    assert got.dtype == torch.long and got.device.type == "cpu"
    assert got.shape == want.shape and torch.equal(got, want)


def test_longs_takes_ranges_and_a_cpu_device():
    assert torch.equal(longs(range(3, 9), "cpu"), torch.arange(3, 9))


def test_longs_refuses_what_int64_cannot_hold():
    with pytest.raises(OverflowError):
        longs([2**63])


def test_longs_owns_its_memory():
    values = [1, 2, 3]
    t = longs(values)
    values[0] = 99
    t.add_(1)  # writable, and not a view of anything the caller holds
    assert t.tolist() == [2, 3, 4]
