"""The plain-tensor Llama decoder (specdec.engine.llama) computes what transformers' modules compute.

In float32 its hidden states are bitwise those of transformers' LlamaModel over the same ragged step
(same cache contents, same layout), decode, verify, prefill and token-tree feeds alike; a model it
cannot run exactly goes to transformers' modules.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from specdec.engine.attention import active, build_layout, use_step_attention
from specdec.engine.kv_cache import KVGeometry, SlotKVCache
from specdec.engine.llama import LlamaDecoder
from specdec.engine.step import TransformersDecoder, decoder_for
from specdec.models import ModelConfig, load_model
from tests.helpers import TEST_DEVICE

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="bitwise equality is a float32 CPU property")


def hidden_states(decoder, cache: SlotKVCache, steps) -> list[torch.Tensor]:
    """Run `steps` (each a list of (slot, cached, tokens, tree parents or None)) through `decoder`."""
    out = []
    for feeds in steps:
        ids = torch.tensor([t for _, _, tokens, _ in feeds for t in tokens])
        layout = build_layout(cache, [(s, c, len(t)) for s, c, t, _ in feeds], torch.device("cpu"),
                              trees=[tree for *_, tree in feeds])
        with torch.inference_mode(), active(layout):
            out.append(decoder(ids, layout.positions).clone())
    return out


def test_bitwise_equal_to_transformers_modules(tiny_target):
    model = load_model(ModelConfig(tiny_target))
    use_step_attention(model)  # as the runner does: transformers' layers attend over the slots
    assert LlamaDecoder.unsupported(model) is None
    g = torch.Generator().manual_seed(3)
    a, b, c = (torch.randint(3, 5000, (n,), generator=g).tolist() for n in (40, 7, 60))
    steps = [
        [(0, 0, a, None), (1, 0, b, None)],  # prefills: a long feed alone, a short one
        [(0, 40, [11], None), (1, 7, [12, 13, 14], None), (2, 0, c, None)],  # decode + verify (group) + prefill
        [(0, 41, [15, 16, 17, 18], [-1, 0, -1, 2]), (1, 10, [19], None)],  # a token tree beside a decode
    ]
    results = []
    for decoder in (TransformersDecoder(model.base_model), LlamaDecoder(model)):
        cache = SlotKVCache(KVGeometry.of(model), 3, 128)
        results.append(hidden_states(decoder, cache, steps))
    for want, got in zip(*results):
        assert torch.equal(got, want), float((got - want).abs().max())


def test_other_models_run_transformers_modules(tmp_path):
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = Qwen2ForCausalLM(config)
    assert "qwen2" in LlamaDecoder.unsupported(model)
    assert isinstance(decoder_for(model), TransformersDecoder)
    with pytest.raises(ValueError, match="cannot run this model"):
        LlamaDecoder(model)


def test_eager_mode_keeps_transformers_modules(tiny_target):
    model = load_model(ModelConfig(tiny_target))
    assert isinstance(decoder_for(model, plain=True), TransformersDecoder)
    assert isinstance(decoder_for(model), LlamaDecoder)


def test_bfloat16_with_packed_linears_stays_close_to_transformers_modules(tiny_target):
    """The packed step mode in bfloat16 runs the decoder's linears on oneDNN-packed weights (the CPU's
    bfloat16 matrix units): a different summation order, so close rather than bitwise, over the same steps."""
    from specdec.engine.packed import pack_layers

    reference = load_model(ModelConfig(tiny_target, dtype="bfloat16"))
    model = load_model(ModelConfig(tiny_target, dtype="bfloat16"))
    for m in (reference, model):
        use_step_attention(m)
    packed = pack_layers(model)
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():  # AVX-512 BF16 / AMX (else: plain linears, compared all the same)
        assert packed == 7 * len(model.model.layers)
    g = torch.Generator().manual_seed(4)
    a, b = (torch.randint(3, 5000, (n,), generator=g).tolist() for n in (30, 9))
    steps = [[(0, 0, a, None), (1, 0, b, None)], [(0, 30, [11], None), (1, 9, [12, 13, 14, 15, 16], None)]]
    results = []
    for decoder in (TransformersDecoder(reference.base_model), LlamaDecoder(model)):
        cache = SlotKVCache(KVGeometry.of(reference), 2, 64)
        results.append(hidden_states(decoder, cache, steps))
    for want, got in zip(*results):
        scale = float(want.float().abs().max())
        assert float((got.float() - want.float()).abs().max()) <= 0.05 * scale
