"""The captured step's attention kernel (specdec.engine.triton_attention) against the StaticLayout's PyTorch path
(gather, mask, SDPA) on one layout holding a chain, a token tree, a one-token decode and a padding session.
It needs a CUDA device: run with SPECDEC_TEST_DEVICE=cuda."""

from __future__ import annotations

import pytest
import torch

from specdec.engine import triton_attention
from specdec.engine.kv_cache import KVGeometry, SlotKVCache
from specdec.engine.static_attention import StaticBuffers, StaticLayout
from tests.helpers import TEST_DEVICE

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cuda" or triton_attention.available(torch.device(TEST_DEVICE), 64) is not None,
                                reason="the Triton attention kernel runs on CUDA devices")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_len", [128, 256])
def test_kernel_attends_as_the_masked_sdpa_path(dtype, kv_len):
    device = torch.device("cuda")
    torch.manual_seed(0)
    cache = SlotKVCache(KVGeometry(1, 2, 64, dtype, device), 4, 256, scratch=True)
    for t in cache.keys + cache.values:
        t.normal_()
    s_b, n, heads = 4, 4, 6
    buffers = StaticBuffers.allocate(s_b, n, device)
    sessions, cached, new = [2, 0, 1, cache.scratch_slot], [37, 100, 5, 0], [3, 4, 1, 0]  # chain, tree, decode, padding
    hidden = [0] * (s_b * n * n)
    for i, j in [(2, 1), (3, 2)]:  # the tree (parents -1, 0, 0, 1): node 2 does not see 1, node 3 not 2
        hidden[(1 * n + i) * n + j] = 1
    slots, kv_positions = [cache.scratch_slot] * (s_b * n), [i % n for i in range(s_b * n)]
    for s in range(s_b):
        for i in range(new[s]):
            slots[s * n + i], kv_positions[s * n + i] = sessions[s], cached[s] + i
    buffers.fill([[0] * (s_b * n), [i % n for i in range(s_b * n)], slots, sessions, cached, new, kv_positions, hidden])
    query = torch.randn(s_b * n, heads, 64, device=device, dtype=dtype).transpose(0, 1)[None]  # strided, as the decoder's
    key, value = (torch.randn(1, 2, s_b * n, 64, device=device, dtype=dtype) for _ in range(2))
    outs = []
    for kernel in (False, True):
        layout = StaticLayout(cache, buffers, s_b, n, kv_len, kernel)
        layout.prepare()
        outs.append(layout.attend(0, query, key, value, 0.125).float())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert float((outs[0] - outs[1]).abs().max()) <= tolerance
