"""Linear layers on weights packed once for the CPU's matrix library (oneDNN).

An eager float32 product on a CPU with a few rows (a verify of K + 1 = 2-9 tokens) takes a slow path:
the library repacks the whole weight on every call, so 2-3 rows cost 1.8-2.6x one row and the LM head
(49152 x 576) costs 10 ms for one row. Packing each weight once at start, in oneDNN's blocked layout,
and calling oneDNN's linear on it keeps a 2-17 row product near the cost of one row (the same packing
inductor's weight freezing does, without compiling). Works for float32 and bfloat16 weights.
"""

from __future__ import annotations

import torch


def can_pack(device: torch.device) -> bool:
    return device.type == "cpu" and torch.backends.mkldnn.is_available()


class PackedLinear(torch.nn.Module):
    """y = x W^T + b, W packed once (the original weight stays with its module, e.g. a tied embedding)."""

    def __init__(self, linear: torch.nn.Linear, rows_hint: int = 4) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every plain nn.Linear of `model` (the LM head included) by a PackedLinear, in place;
    returns how many were packed. A weight oneDNN cannot pack on this CPU (float16 without AVX-512
    FP16, say) stays a plain linear: same function, eager speed."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                try:
                    packed = PackedLinear(child)
                except RuntimeError:
                    continue
                setattr(module, name, packed)
                count += 1
    return count
