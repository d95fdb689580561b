"""The decoder kernel (csrc/decoder.cpp): the Llama decoder's layers in one call. It runs the kernels the Python
decoder runs, in the same order, so over the same step its hidden states and the cache it leaves are bitwise the
Python decoder's: float32 weights and a GGUF's blocks, prefill, decode beside a verify, a token tree. Steps it does
not cover whole (a tree too long for row attention, tapped layers) go to the Python decoder."""

from __future__ import annotations

import pytest
import torch

from specdec.engine import cpu_kernels, gguf_weights, skinny_gemm
from specdec.engine.attention import active, build_layout
from specdec.engine.kv_cache import KVGeometry, SlotKVCache
from specdec.engine.llama import LlamaDecoder
from specdec.models import ModelConfig, load_model
from bench.gguf_models import tokenizer_fields, write_tiny_gguf
from tests.helpers import needs_cpu_kernels

pytestmark = needs_cpu_kernels("the decoder kernel")


class Counted:
    """The native Decoder with its calls counted (the test must know the kernel ran, not the fallback)."""

    def __init__(self, native) -> None:
        self.native, self.calls = native, 0

    def forward(self, *args):
        self.calls += 1
        return self.native.forward(*args)

    def forward_tapped(self, *args):
        self.calls += 1
        return self.native.forward_tapped(*args)


def decoders(model) -> tuple[LlamaDecoder, LlamaDecoder]:
    ops, native = cpu_kernels.load("row_ops")[0], cpu_kernels.load("decoder")[0]
    assert native is not None, cpu_kernels.load("decoder")[1]
    python = LlamaDecoder(model, product=skinny_gemm.fused_product, ops=ops)
    kernel = LlamaDecoder(model, product=skinny_gemm.fused_product, ops=ops, native=native)
    assert python.native is None and kernel.native is not None and kernel.native.num_layers() == len(kernel.layers)
    kernel.native = Counted(kernel.native)
    return python, kernel


def run(decoder, cache: SlotKVCache, steps, taps=None) -> list[torch.Tensor]:
    """`steps` (each a list of (slot, cached, tokens, tree parents or None)) through `decoder`, attending by rows."""
    out = []
    for feeds in steps:
        ids = torch.tensor([t for _, _, tokens, _ in feeds for t in tokens])
        layout = build_layout(cache, [(s, c, len(t)) for s, c, t, _ in feeds], torch.device("cpu"),
                              trees=[tree for *_, tree in feeds], row_attention=True)
        with torch.inference_mode(), active(layout):
            out.append(decoder(ids, layout.positions, taps).clone())
    return out


def steps_for(vocab: int) -> list:
    g = torch.Generator().manual_seed(5)
    a, b, c = (torch.randint(3, vocab, (n,), generator=g).tolist() for n in (40, 7, 60))
    return [
        [(0, 0, a, None), (1, 0, b, None)],  # prefills
        [(0, 40, [11], None), (1, 7, [12, 13, 14, 15, 16], None), (2, 0, c, None)],  # decode + verify + prefill
        [(0, 41, [17, 18, 19, 20], [-1, 0, -1, 2]), (1, 12, [21], None)],  # a token tree beside a decode
    ]


def assert_same(model, steps, kernel_calls: int, taps=None) -> None:
    python, kernel = decoders(model)
    caches = [SlotKVCache(KVGeometry.of(model), 3, 128) for _ in range(2)]
    for tensor in caches[0].keys + caches[0].values + caches[1].keys + caches[1].values:
        tensor.zero_()  # allocated uninitialised: only what the steps store is compared
    want, got = run(python, caches[0], steps, taps), run(kernel, caches[1], steps, taps)
    assert kernel.native.calls == kernel_calls
    for w, g in zip(want, got, strict=True):
        assert torch.equal(g, w), float((g - w).abs().max())
    for layer in range(len(python.layers)):  # the step's keys and values stored where the Python decoder stores them
        assert torch.equal(caches[0].keys[layer], caches[1].keys[layer]) and torch.equal(caches[0].values[layer], caches[1].values[layer])


def test_bitwise_the_python_decoder_over_float32_weights(tiny_target):
    model = load_model(ModelConfig(tiny_target))
    assert_same(model, steps_for(model.config.vocab_size), kernel_calls=3)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q4_K", "Q4_K_M"])  # Q4_K_M: q / k in Q4_K, v in Q6_K, two parts
def test_bitwise_the_python_decoder_over_gguf_blocks(tmp_path, fmt):
    path = write_tiny_gguf(tmp_path / f"tiny-{fmt}.gguf", fmt, tokenizer_fields(), seed=3)
    model = gguf_weights.load_blocks(gguf_weights.gguf_file(path))
    assert_same(model, steps_for(2048), kernel_calls=3)


def test_steps_it_does_not_cover_run_the_python_decoder(tiny_target):
    model = load_model(ModelConfig(tiny_target))
    long_tree = [(0, 0, list(range(3, 73)), [-1] + list(range(69)))]  # 70 nodes: past row attention's 64-bit span
    assert_same(model, [long_tree], kernel_calls=0)


def test_taps_are_bitwise_the_python_decoders(tiny_target):
    """A feature draft's taps (each asked layer's output at every token) from the kernel's one call: bitwise the
    Python decoder's, in any order asked, the step's output too, over prefills, a decode beside a verify, a tree."""
    model = load_model(ModelConfig(tiny_target))
    python, kernel = decoders(model)
    last = len(python.layers) - 1
    caches = [SlotKVCache(KVGeometry.of(model), 3, 128) for _ in range(2)]
    steps = steps_for(model.config.vocab_size)
    for feeds in steps:
        want, got = dict.fromkeys((last, 0)), dict.fromkeys((last, 0))
        (w,), (g,) = run(python, caches[0], [feeds], want), run(kernel, caches[1], [feeds], got)
        assert torch.equal(g, w)
        for layer in want:
            assert got[layer].shape == (sum(len(t) for _, _, t, _ in feeds), model.config.hidden_size)
            assert torch.equal(got[layer], want[layer]), layer
    assert kernel.native.calls == len(steps)


def test_bad_inputs_are_refused(tiny_target):
    model = load_model(ModelConfig(tiny_target))
    _, kernel = decoders(model)
    cache = SlotKVCache(KVGeometry.of(model), 1, 16)
    x, cs = torch.zeros(2, model.config.hidden_size), torch.zeros(2, kernel.head_dim)
    rows = [torch.arange(2), torch.zeros(2, dtype=torch.long), torch.tensor([1, 2]), torch.zeros(2, dtype=torch.long)]
    with pytest.raises(RuntimeError, match="one cache layer per layer"):
        kernel.native.forward(x, cs, cs, cache.keys[:1], cache.values[:1], rows[1], torch.arange(2), *rows)
    with pytest.raises(RuntimeError, match="every token one row"):
        kernel.native.forward(x, cs, cs, cache.keys, cache.values, rows[1], torch.arange(2), *(r[:1] for r in rows))
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.native.forward(x, cs, cs, cache.keys, cache.values, rows[1], torch.tensor([0, 99]), *rows)
    args = (x, cs, cs, cache.keys, cache.values, rows[1], torch.arange(2), *rows)
    with pytest.raises(RuntimeError, match="is not a layer"):
        kernel.native.forward_tapped(*args, [len(kernel.layers)], torch.zeros(1, 2, model.config.hidden_size))
    with pytest.raises(RuntimeError, match="tapped"):
        kernel.native.forward_tapped(*args, [0, 1], torch.zeros(1, 2, model.config.hidden_size))


def test_the_rotary_table_holds_the_bits_computed_per_step(tiny_target):
    """The kernels' decoder looks cos / sin up in a table of every position (grown past its end on demand): the
    same bits as computing them for the step's positions, which the Python decoder does."""
    model = load_model(ModelConfig(tiny_target))
    python, kernel = decoders(model)
    for positions in ([5], [0, 1, 2, 3, 4], [1023, 1024, 3000, 7], [40, 41, 41, 42]):
        at = torch.tensor(positions)
        for want, got in zip(python._rotary(at, torch.float32), kernel._rotary(at, torch.float32), strict=True):
            assert torch.equal(got, want), positions
    assert kernel._rotary_table[0].shape[0] == 3001 and python._rotary_table is None
