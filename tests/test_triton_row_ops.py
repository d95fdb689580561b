"""The Triton row ops (specdec.engine.triton_row_ops), the GPU's fused norm, rotary and SiLU: each against
PyTorch's operators as transformers writes them (TorchRowOps), on strided views as the concatenated products
hand them over, and the decoder the CUDA graphs capture against transformers' forward. They need a CUDA
device: run with SPECDEC_TEST_DEVICE=cuda."""

from __future__ import annotations

import pytest
import torch

from specdec.engine import triton_row_ops
from specdec.engine.llama import TorchRowOps
from specdec.engine.triton_row_ops import TritonRowOps
from tests.helpers import TEST_DEVICE

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cuda" or triton_row_ops.available(torch.device(TEST_DEVICE)) is not None,
                                reason="the Triton row ops run on CUDA devices")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}  # relative to the values' scale


def close(got, want, dtype):
    scale = float(want.float().abs().max())
    assert float((got.float() - want.float()).abs().max()) <= TOL[dtype] * scale, float((got.float() - want.float()).abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [576, 4096, 50])
def test_add_rms_norm(dtype, n):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(7, n, generator=g, device="cuda", dtype=dtype)
    delta, w = torch.randn(7, n, generator=g, device="cuda", dtype=dtype), torch.randn(n, generator=g, device="cuda", dtype=dtype)
    x1, x2 = x.clone(), x.clone()
    close(TritonRowOps.add_rms_norm(x1, delta, w, 1e-5), TorchRowOps.add_rms_norm(x2, delta, w, 1e-5), dtype)
    assert torch.equal(x1, x2)  # the residual, updated in place: one rounded add, as PyTorch's
    close(TritonRowOps.add_rms_norm(x1, None, w, 1e-5), TorchRowOps.add_rms_norm(x2, None, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_in_place_on_a_strided_view(dtype, head_dim):
    g = torch.Generator(device="cuda").manual_seed(1)
    heads, kv_heads, t = 9, 3, 5
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g, device="cuda", dtype=dtype)
    cos, sin = (torch.randn(t, head_dim, generator=g, device="cuda", dtype=dtype) for _ in range(2))
    mine, theirs = qkv.clone(), qkv.clone()
    for x in (mine, theirs):
        q, k, _ = x.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        ops = TritonRowOps if x is mine else TorchRowOps
        ops.rotary_(q, cos, sin, head_dim)
        ops.rotary_(k, cos, sin, head_dim)
    close(mine, theirs, dtype)
    v = slice((heads + kv_heads) * head_dim, None)
    assert torch.equal(mine[:, v], qkv[:, v])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1536, 14336, 100])
def test_silu_mul(dtype, n):
    g = torch.Generator(device="cuda").manual_seed(2)
    gate_up = torch.randn(6, 2 * n, generator=g, device="cuda", dtype=dtype)
    gate, up = gate_up.split([n, n], dim=-1)
    close(TritonRowOps.silu_mul(gate, up), TorchRowOps.silu_mul(gate, up), dtype)


def test_graph_decoder_is_transformers_forward(tiny_target):
    """The decoder a CUDA graph captures (Triton row ops, concatenated products) against transformers' forward
    of the same tokens, in float32: the same logits to 1e-4, the same argmax."""
    from specdec.engine.attention import active, build_layout
    from specdec.engine.kv_cache import KVGeometry, SlotKVCache
    from specdec.engine.step import graph_decoder
    from specdec.models import ModelConfig, load_model

    model = load_model(ModelConfig(tiny_target, device="cuda"))
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.inference_mode():
        want = model(input_ids=ids).logits[0]
        decoder = graph_decoder(model)
        assert decoder.ops is TritonRowOps
        cache = SlotKVCache(KVGeometry.of(model), 1, 64)
        layout = build_layout(cache, [(0, 0, 40)], torch.device("cuda"))
        with active(layout):
            got = model.get_output_embeddings()(decoder(ids[0], layout.positions))
    assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
