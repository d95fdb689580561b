"""The quantised skinny GEMM (specdec.engine.quant_gemm): GGUF blocks made by gguf-py's own quantiser (the
K-quants, which it cannot write: random super-blocks, bench.gguf_models), dequantised inside the kernel to bitwise
gguf-py's values, and the product bitwise the float32 skinny GEMM's over them (so exact on small integers and
batch-invariant as that is); bad inputs refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from specdec.engine import skinny_gemm
from specdec.engine.quant_gemm import FORMATS, QuantEmbedding, QuantLinear, dequantize_rows, pack
from specdec.engine.skinny_gemm import SkinnyLinear, fused_product
from bench.gguf_models import K_QUANTS, k_quant_blocks
from tests.helpers import needs_cpu_kernels

pytestmark = needs_cpu_kernels("the skinny GEMM kernel")


def gguf_matrix(fmt: str, n: int, k: int, seed: int = 0, values: np.ndarray | None = None):
    """(raw GGUF bytes [n, k / 32 * block], gguf-py's dequantisation [n, k] float32) of a random matrix (a
    K-quant's: random super-blocks, k a multiple of 256)."""
    qtype = GGMLQuantizationType[fmt]
    if fmt in K_QUANTS:
        raw = k_quant_blocks(fmt, n, k, seed)
        return torch.from_numpy(raw.copy()), torch.from_numpy(quants.dequantize(raw, qtype).copy())
    w = values if values is not None else np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1
    raw = quants.quantize(w, qtype)
    return torch.from_numpy(raw.copy()), torch.from_numpy(quants.dequantize(raw, qtype).copy())


def reference(weight: torch.Tensor) -> SkinnyLinear:
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(weight)
    return SkinnyLinear([lin])


def quant_linear(fmt: str, raw: torch.Tensor, n: int, k: int) -> QuantLinear:
    return QuantLinear(pack(raw, FORMATS[fmt]), FORMATS[fmt], n, k)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_dequantised_values_are_gguf_pys_bitwise(fmt):
    """Odd scales, minima and every quant value: the kernel's and the embedding's dequantisation equal
    gguf-py's numpy bit for bit (the reference model holds these)."""
    n, k = 70, 512 if fmt in K_QUANTS else 96  # 70 rows: a partial panel
    raw, want = gguf_matrix(fmt, n, k, seed=3)
    packed = pack(raw, FORMATS[fmt])
    panels = skinny_gemm.kernel().quant_dequant(packed, FORMATS[fmt].ggml_type)  # [P, K, 16]
    got = panels.transpose(1, 2).reshape(-1, k)[:n]
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    rows = torch.tensor([0, 5, 16, 69, 33, 5])
    assert torch.equal(dequantize_rows(packed, FORMATS[fmt], rows).view(torch.int32), want[rows].view(torch.int32))
    emb = QuantEmbedding(quant_linear(fmt, raw, n, k))  # the kernel's lookup
    assert torch.equal(emb(rows[None])[0].view(torch.int32), want[rows].view(torch.int32))
    with pytest.raises(RuntimeError, match="out of range"):
        emb(torch.tensor([n]))  # in the last panel's padding, still refused


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_bitwise_the_float32_skinny_gemm_over_the_dequantised_weights(fmt):
    shapes = [(16, 256), (70, 512), (192, 768), (300, 1536)] if fmt in K_QUANTS else [(16, 32), (70, 96), (192, 576),
                                                                                          (300, 1536)]
    for n, k in shapes:
        raw, weight = gguf_matrix(fmt, n, k, seed=n)
        fast, ref = quant_linear(fmt, raw, n, k), reference(weight)
        for m in (*range(1, 12), 17, 40, 129):  # one row block (fused in L1) and several (the group buffer)
            x = torch.randn(m, k)
            assert torch.equal(fast(x), ref(x)), (n, k, m)


# Integer ranges each format holds exactly (scale 1): Q4_0 d = max / -8 with the signed extreme -8; Q4_1
# d = (max - min) / 15, m = min; Q8_0 d = max |w| / 127. The K-quants' integer blocks: bench.gguf_models.
INTEGERS = {"Q4_0": (-8, 7), "Q4_1": (-7, 8), "Q8_0": (-127, 127), "Q2_K": (-2, 1), "Q3_K": (-4, 3), "Q4_K": (-8, 7),
            "Q5_K": (-16, 15), "Q6_K": (-32, 31)}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_exact_on_integers(fmt):
    """Integer weights the format holds exactly, integer inputs: the product is the true one."""
    g = np.random.default_rng(1)
    lo, hi = INTEGERS[fmt]
    n, k = 48, 256 if fmt in K_QUANTS else 64
    if fmt in K_QUANTS:
        raw = k_quant_blocks(fmt, n, k, seed=1, integers=True)
        w = quants.dequantize(raw, GGMLQuantizationType[fmt])
        raw = torch.from_numpy(raw.copy())
        assert np.array_equal(w, np.round(w)) and w.min() == lo and w.max() == hi, "every weight an integer in range"
    else:
        w = g.integers(lo, hi + 1, (n, k)).astype(np.float32)
        w[:, ::32], w[:, 1::32] = (lo, hi) if fmt == "Q4_0" else (hi, lo)  # each block spans the range
        raw, weight = gguf_matrix(fmt, n, k, values=w)
        assert torch.equal(weight, torch.from_numpy(w)), "the quantiser kept the integers"
    x = torch.from_numpy(g.integers(-8, 9, (5, k)).astype(np.float32))
    want = (x.long() @ torch.from_numpy(w).long().T).float()
    assert torch.equal(quant_linear(fmt, raw, n, k)(x), want)


def test_a_row_is_the_same_alone_and_among_others_and_fused_as_separate():
    raw_q, _ = gguf_matrix("Q4_1", 576, 576, seed=1)
    raw_k, _ = gguf_matrix("Q4_1", 192, 576, seed=2)
    q, k = quant_linear("Q4_1", raw_q, 576, 576), quant_linear("Q4_1", raw_k, 192, 576)
    x = torch.randn(23, 576)
    alone_q, alone_k = q(x), k(x)
    for i in range(23):
        assert torch.equal(q(x[i:i + 1]), alone_q[i:i + 1]), i
    fused = fused_product([q, k])  # q's and k's tiles now views of one tensor
    got_q, got_k = fused(x)
    assert torch.equal(got_q, alone_q) and torch.equal(got_k, alone_k)
    assert q.packed.data_ptr() != raw_q.data_ptr() and torch.equal(q(x), alone_q)


def test_bad_inputs_are_refused():
    raw, _ = gguf_matrix("Q4_1", 32, 64)
    lin = quant_linear("Q4_1", raw, 32, 64)
    ops = skinny_gemm.kernel()
    with pytest.raises(RuntimeError, match="format"):
        ops.quant_linear(torch.randn(1, 64), lin.packed, 6, 32, None)  # Q5_0: not served
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.quant_linear(torch.randn(1, 96), lin.packed, 3, 32, None)
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.quant_linear(torch.randn(1, 64), lin.packed, 2, 32, None)  # Q4_0's tiles are smaller
    with pytest.raises(RuntimeError, match="float32"):
        ops.quant_linear(torch.randn(1, 64, dtype=torch.float64), lin.packed, 3, 32, None)
    with pytest.raises(ValueError, match="whole blocks"):
        pack(raw[:, :-1], FORMATS["Q4_1"])
    raw_k, _ = gguf_matrix("Q4_K", 16, 256)
    with pytest.raises(ValueError, match="whole super-blocks"):
        pack(raw_k[:, :-1], FORMATS["Q4_K"])
    with pytest.raises(ValueError, match="is not Q4_1"):
        QuantLinear(lin.packed, FORMATS["Q4_1"], 33, 64)
