"""The row ops (csrc/row_ops.cpp): a Llama layer's small operators as three row-wise calls. Each against
PyTorch's operators as transformers writes them, batch invariance (a row's result is bitwise the same
alone or among others), the residual updated in place, and the plain Llama decoder with them against
without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.engine import cpu_kernels
from tests.helpers import needs_cpu_kernels

pytestmark = needs_cpu_kernels("the row ops kernel")


@pytest.fixture(scope="module")
def ops():
    module, why = cpu_kernels.load("row_ops")
    assert module is not None, why
    return module


def rms(x, w, eps):  # transformers' LlamaRMSNorm
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x, cos, sin):  # x [T, heads, D], cos / sin [T, D]
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None]


@pytest.mark.parametrize("n", [576, 64, 50])
def test_add_rms_norm(ops, n):
    g = torch.Generator().manual_seed(0)
    x, delta, w = torch.randn(7, n, generator=g), torch.randn(7, n, generator=g), torch.randn(n, generator=g)
    want_x = x + delta
    want = rms(want_x, w, 1e-5)
    h = ops.add_rms_norm(x, delta, w, 1e-5)
    torch.testing.assert_close(x, want_x, rtol=0, atol=0)  # the residual, in place, exactly
    torch.testing.assert_close(h, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ops.add_rms_norm(x.clone(), None, w, 1e-5), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 16, 10])
def test_rotary_in_place_on_a_view(ops, head_dim):
    g = torch.Generator().manual_seed(1)
    heads, t = 3, 5
    y = torch.randn(t, 2 * heads * head_dim, generator=g)  # a fused product's output: q is its left part
    q = y[:, : heads * head_dim]
    angles = torch.randn(t, head_dim // 2, generator=g)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    want = rotate(q.reshape(t, heads, head_dim), cos, sin).reshape(t, -1)
    right = y[:, heads * head_dim :].clone()
    ops.rotary_(q, cos, sin, head_dim)
    torch.testing.assert_close(q, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(y[:, heads * head_dim :], right)  # the rest of the row untouched


def test_silu_mul(ops):
    g = torch.Generator().manual_seed(2)
    gu = torch.randn(6, 2 * 1536, generator=g) * 4
    gate, up = gu.split(1536, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate, up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    extreme = torch.tensor([[-200.0, -90.0, 0.0, 90.0, 200.0]])
    torch.testing.assert_close(ops.silu_mul(extreme, torch.ones_like(extreme)), F.silu(extreme))


def test_batch_invariant_bitwise(ops):
    g = torch.Generator().manual_seed(3)
    x, delta, w = torch.randn(33, 576, generator=g), torch.randn(33, 576, generator=g), torch.randn(576, generator=g)
    batch = ops.add_rms_norm(x.clone(), delta, w, 1e-5)
    gate, up = torch.randn(33, 1536, generator=g), torch.randn(33, 1536, generator=g)
    act = ops.silu_mul(gate, up)
    for i in (0, 17, 32):
        assert torch.equal(ops.add_rms_norm(x[i : i + 1].clone(), delta[i : i + 1], w, 1e-5), batch[i : i + 1])
        assert torch.equal(ops.silu_mul(gate[i : i + 1], up[i : i + 1]), act[i : i + 1])


def test_bad_shapes_are_refused(ops):
    with pytest.raises(RuntimeError, match="add_rms_norm: weight"):
        ops.add_rms_norm(torch.randn(2, 8), None, torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="rotary_"):
        ops.rotary_(torch.randn(2, 9), torch.randn(2, 3), torch.randn(2, 3), 3)
    with pytest.raises(RuntimeError, match="silu_mul"):
        ops.silu_mul(torch.randn(2, 8), torch.randn(2, 6))


def test_the_decoder_with_row_ops_is_the_decoder_without(tiny_target, ops):
    from specdec.engine.attention import active, build_layout
    from specdec.engine.kv_cache import KVGeometry, SlotKVCache
    from specdec.engine.llama import LlamaDecoder
    from specdec.models import ModelConfig, load_model

    model = load_model(ModelConfig(tiny_target, device="cpu", dtype="float32"))
    ids = torch.tensor([5, 17, 42, 9, 33, 2, 71])
    out = {}
    for name, decoder in (("plain", LlamaDecoder(model)), ("row ops", LlamaDecoder(model, ops=ops))):
        cache = SlotKVCache(KVGeometry.of(model), 1, 64)
        layout = build_layout(cache, [(0, 0, len(ids))], torch.device("cpu"))
        with torch.inference_mode(), active(layout):
            out[name] = decoder(ids, layout.positions)
    torch.testing.assert_close(out["row ops"], out["plain"], rtol=1e-5, atol=1e-5)
