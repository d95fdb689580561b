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

The K-quants Q2_K to Q6_K (Q4_K_M and Q5_K_M, the GGUFs most often published, are Q4_K, Q5_K and Q6_K) are
served the same way (`pack_k`): a super-block of 256 weights holds float16 factors and 4- to 8-bit integer
scales per sub-block, and every product of them is exact in float32 (Q4_K, Q5_K: d sc is 11 bits times 6,
d sc q and dmin m exact, so gguf-py's (d sc) q - dmin m rounds once, as the kernel's D q + M does; Q2_K the same
with 4-bit scales per 16; Q6_K: (d sc) q is 18 bits times 6, Q3_K 17 times 3, no rounding at all). The packer
multiplies the factors out once into float32 scales per block of 32 (per 16 for Q6_K, Q3_K, Q2_K), the tile's
only difference from Q4_1's (Q4_K, Q3_K, Q2_K, 4-bit quants; Q3_K's q + 8 read through Q4_0's table) or Q8_0's
(Q5_K, Q6_K, a byte a quant): 0.75 / 1.25 / 1.25 / 0.75 / 1.0 bytes a weight for Q4_K / Q5_K / Q6_K / Q3_K /
Q2_K against the file's 0.56 / 0.69 / 0.82 / 0.43 / 0.33, a fifth to a third of float32's. Other formats (Q5_0,
Q5_1, the IQ quants, ...) are refused here and held in float32 by the loader: FORMATS lists what is served.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.engine import cpu_kernels

PANEL, BLOCK = 16, 32  # output columns per packed panel; weights per GGUF block (along in_features)


SUPER = 256  # weights per K-quant super-block


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: int  # ggml's type id (gguf.GGMLQuantizationType)
    scales: int  # float16 scales per block: d (and m for Q4_1); a K-quant's tile: float32 ones per column (2; Q2_K 4)
    bits: int  # bits per quant as the tile holds it (Q6_K's 6-bit quants: a byte each)
    super_bytes: int = 0  # a K-quant's super-block of 256 weights as a GGUF stores it (0: a format of 32-blocks)

    @property
    def block_bytes(self) -> int:  # one block of 32 as a GGUF stores it (a K-quant: per super-block, super_bytes)
        return 2 * self.scales + BLOCK * self.bits // 8

    @property
    def tile_bytes(self) -> int:  # one block of 32 k of 16 columns, packed
        if self.super_bytes:
            return PANEL * (4 * self.scales + BLOCK * self.bits // 8)
        return PANEL * self.block_bytes


FORMATS = {f.name: f for f in (BlockFormat("Q4_0", 2, 1, 4), BlockFormat("Q4_1", 3, 2, 4), BlockFormat("Q8_0", 8, 1, 8),
                               BlockFormat("Q2_K", 10, 4, 4, super_bytes=84), BlockFormat("Q3_K", 11, 2, 4, super_bytes=110),
                               BlockFormat("Q4_K", 12, 2, 4, super_bytes=144), BlockFormat("Q5_K", 13, 2, 8, super_bytes=176),
                               BlockFormat("Q6_K", 14, 2, 8, super_bytes=210))}


def pack(raw: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """A GGUF matrix's bytes [N, K / 32 * block_bytes] (uint8, row n = out feature n; a K-quant's [N, K / 256 *
    super_bytes]) -> the kernel's tiles [ceil(N / 16), K / 32, tile_bytes] (rows past N zero)."""
    if fmt.super_bytes:
        return pack_k(raw, fmt)
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
    out[..., s * PANEL:].view(count, nb, 4, PANEL, 4).copy_(_q4_words(q))
    return out


def _q4_words(q: torch.Tensor) -> torch.Tensor:
    """4-bit quants [P, 16, nb, 32] (column, block, k) -> the tile's words [P, nb, 4, 16, 4] as bytes: group g one
    32-bit word per column, its nibble i for k = 8 g + i (byte b of the word: k = 8 g + 2 b and 8 g + 2 b + 1)."""
    count, _, nb, _ = q.shape
    words = q.reshape(count, PANEL, nb, 4, 4, 2)  # k = 8 g + 2 b + h: group g, byte b of the word, nibble h
    return (words[..., 0] | (words[..., 1] << 4)).permute(0, 2, 3, 1, 4)  # [P, nb, g, 16, b]


def _bits(b: torch.Tensor, shifts: Sequence[int], mask: int) -> torch.Tensor:
    """b [..., W] -> [..., len(shifts), W]: each byte's fields (b >> shift) & mask, as gguf-py takes them."""
    return (b.unsqueeze(-2) >> torch.tensor(shifts, dtype=torch.uint8).view(-1, 1)) & mask


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of each super-block b [N, ns, bytes], as float32 [N, ns, 1]."""
    return b[..., at : at + 2].contiguous().view(torch.float16).float()


def k_quant_values(raw: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A K-quant matrix's bytes [N, K / 256 * super_bytes] -> (quants [N, K] as the tile holds them: Q4_K's and Q2_K's
    0..15 (Q2_K's 0..3), Q3_K's q + 8, Q5_K's 0..31 and Q6_K's q6 - 32 as bytes; the float32 scale of each: D = d sc,
    per 32 (Q4_K, Q5_K) or per 16 (Q6_K, Q3_K, Q2_K); the offset M = -(dmin m) where the format has one (Q4_K, Q5_K
    per 32, Q2_K per 16), else None). The bit layout and the order of the factors are gguf-py's (gguf.quants)."""
    n, ns = raw.shape[0], raw.shape[1] // fmt.super_bytes
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] != ns * fmt.super_bytes:
        raise ValueError(f"{fmt.name}: expected uint8 rows of whole super-blocks, got {raw.dtype} {tuple(raw.shape)}")
    b = raw.reshape(n, ns, fmt.super_bytes)
    if fmt.name == "Q2_K":  # 16 bytes of 4-bit scales and minima, 64 of 2-bit quants, d, dmin (float16)
        d, dmin = _f16(b, 80), _f16(b, 82)
        q = _bits(b[..., 16:80].reshape(n, ns, 2, 32), (0, 2, 4, 6), 3).reshape(n, ns * SUPER)
        sc = b[..., :16]
        return q, (d * (sc & 0xF).float()).reshape(n, -1), (-(dmin * (sc >> 4).float())).reshape(n, -1)
    if fmt.name == "Q3_K":  # 32 bytes of high-bit masks, 64 of 2-bit quants, 12 of 6-bit scales, d (float16)
        d = _f16(b, 108)
        low = _bits(b[..., 96:104].reshape(n, ns, 1, 8), (0, 4), 0xF).reshape(n, ns, 16)
        high = _bits(b[..., 104:108].reshape(n, ns, 1, 4), (0, 2, 4, 6), 3).reshape(n, ns, 16)
        sc = ((low | (high << 4)).to(torch.int8) - 32).float()  # [N, ns, 16]
        ql = _bits(b[..., 32:96].reshape(n, ns, 2, 32), (0, 2, 4, 6), 3).reshape(n, ns * SUPER)
        qh = _bits(b[..., :32].reshape(n, ns, 1, 32), range(8), 1).reshape(n, ns * SUPER) ^ 1  # the offset where 0
        return ql + 8 - (qh << 2), (d * sc).reshape(n, -1), None
    if fmt.name in ("Q4_K", "Q5_K"):  # d, dmin (float16), 12 bytes of 6-bit scales and minima, (Q5_K: 32 bytes of
        d, dmin = _f16(b, 0), _f16(b, 2)  # [N, ns, 1]                                   fifth bits,) 128 of nibbles
        sc6 = b[..., 4:16].reshape(n, ns, 3, 4).int()
        lo, hi, mix = sc6[..., 0, :], sc6[..., 1, :], sc6[..., 2, :]
        sc = torch.cat([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], dim=-1).float()  # [N, ns, 8]
        mn = torch.cat([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], dim=-1).float()
        q = _bits(b[..., -128:].reshape(n, ns, 4, 32), (0, 4), 15).reshape(n, ns, 8, 32)
        if fmt.name == "Q5_K":  # bit j of byte i: sub-block j's weight i, times 16
            q = q | (_bits(b[..., 16:48].reshape(n, ns, 32), range(8), 1) << 4)
        return q.reshape(n, ns * SUPER), (d * sc).reshape(n, -1), (-(dmin * mn)).reshape(n, -1)
    # Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d (float16)
    ql = _bits(b[..., :128].reshape(n, ns, 2, 64), (0, 4), 15).reshape(n, ns, 8, 32)
    qh = _bits(b[..., 128:192].reshape(n, ns, 2, 32), (0, 2, 4, 6), 3).reshape(n, ns, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, ns * SUPER)
    scales = b[..., 192:208].contiguous().view(torch.int8).float()  # [N, ns, 16]
    return q, (_f16(b, 208) * scales).reshape(n, -1), None


def pack_k(raw: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """A K-quant matrix -> tiles of 32 k (quant_gemm's docstring): float32 scales, then Q4's words or Q8's bytes."""
    q, scale, offset = k_quant_values(raw, fmt)
    n, k = q.shape
    count, nb = -(-n // PANEL), k // BLOCK
    per = scale.shape[1] // nb  # scales per block of 32: 1, or 2 (one per 16)
    table = torch.cat([scale.reshape(n, nb, per)] + ([offset.reshape(n, nb, per)] if offset is not None else []), -1)
    if n % PANEL:  # zero rows to whole panels: zero scales, columns past N compute zeros, never stored
        pad = count * PANEL - n
        q, table = torch.cat([q, q.new_zeros(pad, k)]), torch.cat([table, table.new_zeros(pad, nb, fmt.scales)])
    out = torch.empty(count, nb, fmt.tile_bytes, dtype=torch.uint8)
    at = 64 * fmt.scales  # the quants' first byte: D (per half), then M (per half) where the format has one
    out[..., :at].view(count, nb, fmt.scales, PANEL, 4).copy_(  # [P, nb, S, 16] float32 as bytes
        table.reshape(count, PANEL, nb, fmt.scales).permute(0, 2, 3, 1).contiguous().view(torch.uint8)
        .view(count, nb, fmt.scales, PANEL, 4))
    if fmt.bits == 8:
        q8 = q.view(torch.uint8) if q.dtype == torch.int8 else q.to(torch.uint8)  # Q6_K's signed bytes as they are
        out[..., at:].view(count, nb, BLOCK, PANEL).copy_(q8.reshape(count, PANEL, nb, BLOCK).permute(0, 2, 3, 1))
    else:
        out[..., at:].view(count, nb, 4, PANEL, 4).copy_(_q4_words(q.to(torch.uint8).reshape(count, PANEL, nb, BLOCK)))
    return out


def dequantize_rows(packed: torch.Tensor, fmt: BlockFormat, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` [T] (int64) of the packed matrix, dequantised as gguf-py does: [T, K] float32 (the
    embedding lookup; PyTorch's eager operators round each product and sum once, as numpy's)."""
    tiles = packed[rows // PANEL]  # [T, nb, tile]
    t, nb, lane, at = rows.shape[0], packed.shape[1], rows % PANEL, torch.arange(rows.shape[0])
    if fmt.super_bytes:  # float32 scales: D q (+ M), per block or per half (k_quant_values)
        s = 64 * fmt.scales
        table = tiles[..., :s].contiguous().view(torch.float32).view(t, nb, fmt.scales, PANEL)[at, :, :, lane]
        if fmt.bits == 8:  # a byte a quant: Q6_K signed, Q5_K 0..31
            q = tiles[..., s:].reshape(t, nb, BLOCK, PANEL)[at, :, :, lane]
            q = (q.view(torch.int8) if fmt.name == "Q6_K" else q).float()  # [T, nb, 32]
        else:
            words = tiles[..., s:].reshape(t, nb, 4, PANEL, 4)[at, :, :, lane]
            q = torch.stack([words & 15, words >> 4], dim=-1).reshape(t, nb, 32).float() - (8 if fmt.name == "Q3_K" else 0)
        if fmt.name in ("Q4_K", "Q5_K"):  # D, M per block
            return ((table[..., :1] * q) + table[..., 1:2]).reshape(t, -1)
        d = table[..., :2].repeat_interleave(16, dim=-1)  # per half: Q6_K, Q3_K, Q2_K
        if fmt.name == "Q2_K":
            return ((d * q) + table[..., 2:4].repeat_interleave(16, dim=-1)).reshape(t, -1)
        return (d * q).reshape(t, -1)
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
