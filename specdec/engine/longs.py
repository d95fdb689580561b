"""int64 tensors from Python ints, through numpy.

torch.tensor(list) reads its argument through Python's sequence protocol, one element at a time: ~8 us for a
handful of ints on this project's CPU, and a decode step builds several such tensors (the step's layout, the
draws' positions, a chain's first tokens). numpy builds the same array in ~1 us and torch.from_numpy takes it
without a copy: ~2 us in all, the same values and dtype (tests/test_longs.py)."""

from __future__ import annotations

import numpy as np
import torch


def longs(values, device: torch.device | str | None = None) -> torch.Tensor:
    """torch.tensor(values, dtype=torch.long, device=device) for a list of ints, or a list of equal-length lists of
    ints (a 2-D tensor)."""
    host = torch.from_numpy(np.array(values, dtype=np.int64))
    return host if device is None or torch.device(device).type == "cpu" else host.to(device)
