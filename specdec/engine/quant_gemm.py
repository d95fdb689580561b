"""Quantised linears: a GGUF's blocks kept as loaded and dequantised inside the skinny GEMM (csrc/skinny_gemm.cpp).

A GGUF stores each weight row in blocks of 32 values: Q4_0 a float16 scale d and 4-bit q (value d (q - 8)),
Q4_1 d and a float16 minimum m (value (d q) + m), Q8_0 d and 8-bit q (value q d). The reference model
(transformers' float32 load of the file) holds exactly those values computed in float32 by gguf-py's numpy:
float16 -> float32 is exact, the integers are exact, each product and sum rounded once. Every product d q
is exact in float32 (an 11-bit significand times at most 8 bits), so Q4_1's (d q) + m has one rounding
whether it is computed as two operations or one multiply-add, and the kernel uses the one; a dequantised
weight is bitwise the reference's, and the product then runs the float32 skinny GEMM's sums term for term:
quant_linear gives bitwise what skinny_linear gives over the dequantised weights. The batch invariance and the contract against
transformers' forward are the skinny GEMM's (specdec.engine.skinny_gemm).

The blocks are repacked once at load into the skinny GEMM's panels of 16 output columns (same bytes, same
values; `pack`): per panel and block one tile of the 16 columns' scales then their quants, a 4-bit format's
as one 32-bit word of 8 nibbles per column and 8 k, so one vector load holds 8 weight vectors. A step reads
each tile once and dequantises each weight vector in registers as the k loop reaches it, multiplying it
into every row of the step (a verify of K + 1 rows dequantises once); a product of more than 9 rows
dequantises each group of panels once into a buffer that all its row blocks read. A step streams the
quantised bytes (the default target: 92 MiB for 513 MiB of float32). Dequantising 16 weights of a 4-bit
format takes 2-3 vector instructions (a shift, a 16-entry table lookup that reads the nibble as its index
and gives the float, the scale's multiply-add) against one multiply-add per row (docs/performance.md has
the figures).

Formats whose values cannot be computed like this (the K-quants' nested scales are products of two rounded
float32 factors in gguf-py; not measured worth it yet) are refused at load: FORMATS lists what is served.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.engine import cpu_kernels

PANEL, BLOCK = 16, 32  # output columns per packed panel; weights per GGUF block (along in_features)


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: int  # ggml's type id (gguf.GGMLQuantizationType)
    scales: int  # float16 scales per block: d (and m for Q4_1)
    bits: int  # bits per quant

    @property
    def block_bytes(self) -> int:  # one block as a GGUF stores it
        return 2 * self.scales + BLOCK * self.bits // 8

    @property
    def tile_bytes(self) -> int:  # one block of 16 columns, packed
        return PANEL * self.block_bytes


FORMATS = {f.name: f for f in (BlockFormat("Q4_0", 2, 1, 4), BlockFormat("Q4_1", 3, 2, 4), BlockFormat("Q8_0", 8, 1, 8))}


def pack(raw: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """A GGUF matrix's bytes [N, K / 32 * block_bytes] (uint8, row n = out feature n) -> the kernel's tiles
    [ceil(N / 16), K / 32, tile_bytes] (rows past N zero)."""
    n, nb = raw.shape[0], raw.shape[1] // fmt.block_bytes
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != nb * fmt.block_bytes:
        raise ValueError(f"{fmt.name}: expected uint8 rows of whole blocks, got {raw.dtype} {tuple(raw.shape)}")
    count = -(-n // PANEL)
    blocks = raw.view(n, nb, fmt.block_bytes)
    if n % PANEL:  # pad to whole panels with zero rows (zero scales: columns past N compute zeros, never stored)
        blocks = torch.cat([blocks, blocks.new_zeros(count * PANEL - n, nb, fmt.block_bytes)])
    blocks = blocks.view(count, PANEL, nb, fmt.block_bytes)
    s = 2 * fmt.scales
    out = torch.empty(count, nb, fmt.tile_bytes, dtype=torch.uint8)
    out[..., :s * PANEL].view(count, nb, fmt.scales, PANEL, 2).copy_(
        blocks[..., :s].view(count, PANEL, nb, fmt.scales, 2).permute(0, 2, 3, 1, 4))  # [P, nb, S, 16, 2]
    quants = blocks[..., s:]
    if fmt.bits == 8:
        out[..., s * PANEL:].view(count, nb, -1, PANEL).copy_(quants.permute(0, 2, 3, 1))  # [P, nb, k, 16]
        return out
    q = torch.cat([quants & 15, quants >> 4], dim=-1)  # [P, 16, nb, 32]: GGUF's byte j holds k = j and j + 16
    words = q.view(count, PANEL, nb, 4, 4, 2)  # k = 8 g + 2 b + h: group g, byte b of the word, nibble h
    words = words[..., 0] | (words[..., 1] << 4)  # [P, 16, nb, g, b]
    out[..., s * PANEL:].view(count, nb, 4, PANEL, 4).copy_(words.permute(0, 2, 3, 1, 4))  # [P, nb, g, 16, b]
    return out


def dequantize_rows(packed: torch.Tensor, fmt: BlockFormat, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` [T] (int64) of the packed matrix, dequantised as gguf-py does: [T, K] float32 (the
    embedding lookup; PyTorch's eager operators round each product and sum once, as numpy's)."""
    tiles = packed[rows // PANEL]  # [T, nb, tile]
    t, nb, lane, at = rows.shape[0], packed.shape[1], rows % PANEL, torch.arange(rows.shape[0])
    s = 2 * fmt.scales
    scales = tiles[..., :s * PANEL].contiguous().view(torch.float16).view(t, nb, fmt.scales, PANEL)[at, :, :, lane].float()
    d = scales[..., :1]
    if fmt.bits == 8:
        quants = tiles[..., s * PANEL:].reshape(t, nb, -1, PANEL)[at, :, :, lane]  # [T, nb, 32]
        return (quants.view(torch.int8).float() * d).reshape(t, -1)
    words = tiles[..., s * PANEL:].reshape(t, nb, 4, PANEL, 4)[at, :, :, lane]  # [T, nb, g, b]
    q = torch.stack([words & 15, words >> 4], dim=-1).reshape(t, nb, 32).float()  # k = 8 g + 2 b + h
    if fmt.name == "Q4_0":
        return (d * (q - 8)).reshape(t, -1)
    return ((d * q) + scales[..., 1:2]).reshape(t, -1)


class QuantLinear(torch.nn.Module):
    """y = x W^T, W [out, in] in GGUF blocks (packed once) dequantised inside the kernel. float32 on a CPU."""

    def __init__(self, packed: torch.Tensor, fmt: BlockFormat, out_features: int, in_features: int) -> None:
        super().__init__()
        ops, why = cpu_kernels.load("skinny_gemm")  # the skinny GEMM's module (specdec.engine.skinny_gemm)
        if ops is None:
            raise RuntimeError(f"skinny GEMM kernel unavailable: {why}")
        if packed.shape != (-(-out_features // PANEL), in_features // BLOCK, fmt.tile_bytes) or in_features % BLOCK:
            raise ValueError(f"QuantLinear: packed {tuple(packed.shape)} is not {fmt.name} [{out_features}, {in_features}]")
        self.packed, self.fmt = packed, fmt
        self.in_features, self.out_features = in_features, out_features
        self.bias = None
        self._linear = ops.quant_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # the decoder's rows: as they come
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = self._linear(rows, self.packed, self.fmt.ggml_type, self.out_features, None)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """W [out, in] float32: the reference model's weight, bitwise (tests, and a fallback's copy)."""
        return dequantize_rows(self.packed, self.fmt, torch.arange(self.out_features))

    def nbytes(self) -> int:
        return self.packed.numel()


class QuantEmbedding(torch.nn.Module):
    """An embedding table in GGUF blocks (a tied LM head's packed tiles, shared): ids [T] -> rows [T, H] float32."""

    def __init__(self, table: QuantLinear, padding_idx: int | None = None) -> None:
        super().__init__()
        self.table, self.padding_idx = table, padding_idx
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        self._rows = cpu_kernels.load("skinny_gemm")[0].quant_rows  # QuantLinear's kernel: there is one

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The kernel's lookup (one call; dequantize_rows's values bitwise, ~20 tensor operators fewer)."""
        flat = ids.reshape(-1).contiguous()
        rows = self._rows(self.table.packed, self.table.fmt.ggml_type, flat, self.num_embeddings)
        return rows.view(*ids.shape, self.embedding_dim)


def fused(linears: Sequence[QuantLinear]) -> QuantLinear | None:
    """Quantised linears sharing an input as one QuantLinear where they can be (one format, every one but the
    last a whole number of panels): their tiles concatenated once, each linear's tiles then a view of them
    (nothing held twice); the linear itself if it is one; None where they cannot."""
    first = linears[0]
    if len(linears) == 1:
        return first
    if any(lin.fmt != first.fmt or lin.in_features != first.in_features for lin in linears) \
            or any(lin.out_features % PANEL for lin in linears[:-1]):
        return None
    packed = torch.cat([lin.packed for lin in linears])
    start = 0
    for lin in linears:
        count = lin.packed.shape[0]
        lin.packed, start = packed[start:start + count], start + count
    return QuantLinear(packed, first.fmt, sum(lin.out_features for lin in linears), first.in_features)
