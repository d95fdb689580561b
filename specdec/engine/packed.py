"""Linears on weights packed once for the CPU's matrix library (oneDNN): the LM head always, the decoder
layers' too when the weights are bfloat16 or float16.

The vocabulary projection is a step's one large product (49152 x 576 for the default target, 28% of
its weights) and the one the library's own path handles worst with a few rows: it repacks the whole
weight on every call, so a 5-row product of the default target's head costs 2.4x a 1-row one (6.1 vs
2.5 ms on this project's 2-core CPU). Packed once at start in oneDNN's blocked layout, 5 rows cost 1.4x
(3.3 ms) and 9 rows 1.6x. The decoder layers' linears stay on the library's own product: at the 1-3
rows of a decode or a short verify it beats the packed one by 10-40 us a product (~8 ms a step over
the target's 210 of them), and in batched steps of 4-64 rows the two are within 5% (measured with
OpenMP spin-waiting as it does by default; specdec.engine.threads). Works for float32 and bfloat16.

In bfloat16 it is the other way round for the layers too: the library's own bfloat16 product takes a
slow path, while a packed one runs on the CPU's bfloat16 matrix units (AMX / AVX-512 BF16), 1.4-2.6x
faster at one row and flat from 1 to 17 rows (bench/step_cost.py records the step). So a bfloat16 or
float16 model gets every linear packed.
"""

from __future__ import annotations

import torch

from specdec.engine.draft_vocab_head import head_product, set_head_product


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


LOW_PRECISION = (torch.bfloat16, torch.float16)


def pack_layers(model) -> int:
    """Replace every plain nn.Linear inside the decoder (not the head) by a PackedLinear, in place, if the
    weights are bfloat16 or float16; returns how many were packed (0: float32, or a weight oneDNN cannot
    pack on this CPU, which keeps the same function at eager speed)."""
    if next(model.parameters()).dtype not in LOW_PRECISION:
        return 0
    try:
        return replace_linears(model, PackedLinear)
    except RuntimeError:
        return 0


def replace_linears(model, make) -> int:
    """Replace every plain nn.Linear inside the decoder (not the head) by make(linear), in place; returns
    how many. All are made before any is replaced, so an error leaves the model as it was."""
    head = model.get_output_embeddings()
    swaps = [(parent, name, child) for parent in model.base_model.modules() for name, child in parent.named_children()
             if type(child) is torch.nn.Linear and child is not head]
    made = [make(child) for _, _, child in swaps]
    for (parent, name, _), new in zip(swaps, made):
        setattr(parent, name, new)
    return len(made)


def pack_head(model) -> bool:
    """Replace the model's LM head (a plain nn.Linear, or a DraftVocabHead's) by a PackedLinear, in place; False
    if it stays as it was: not a plain linear, or a weight oneDNN cannot pack on this CPU (float16 without
    AVX-512 FP16, say), which keeps the same function at eager speed."""
    linear = head_product(model)  # (a draft vocabulary's head: its linear over the kept rows)
    if type(linear) is not torch.nn.Linear:
        return False
    try:
        packed = PackedLinear(linear)
    except RuntimeError:
        return False
    set_head_product(model, packed)
    return True
