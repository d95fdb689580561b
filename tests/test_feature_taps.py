"""Feature taps (EAGLE-3 features from the step's own forward): the decoders' taps are the outputs transformers'
decoder layers return (what specdec.engine.eagle3_features' forward hooks record), and the runner hands each
tapping feed its rows, its layers in its order, in bfloat16, in every step mode, without changing any logits.

Layer id i is the residual stream after decoder layer i; the plain Llama decoder updates that stream lazily
and in place, so these cases pin both of its taps (a layer followed by another, the last layer)."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.attention import active, build_layout, use_step_attention
from specdec.engine.eagle3_features import captured, target_features
from specdec.engine.kv_cache import KVGeometry, SlotKVCache
from specdec.engine.llama import LlamaDecoder
from specdec.engine.runner import Feed
from specdec.engine.step import StepProgram, TransformersDecoder
from specdec.models import ModelConfig, load_model
from tests.helpers import TEST_DEVICE
from tests.step_modes import EXACT, MODES, assert_close, make_runner

LAYERS = (1, 0)  # the tiny target's two layers, out of order: the last layer's tap and an inner one's


def tokens(n: int, seed: int = 5) -> list[int]:
    return torch.randint(3, 5000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hooked(model, ids: list[int], layers=LAYERS) -> dict[int, torch.Tensor]:
    """transformers' own forward over ids, one sequence: each layer's output [T, H] from the forward hooks."""
    with torch.inference_mode(), captured(model, layers) as states:
        model(input_ids=torch.tensor([ids], device=model.device))
    return {i: states[i][-1][0] for i in layers}


def tapped(decoder, model, ids: list[int], split: int, layers=LAYERS) -> dict[int, torch.Tensor]:
    """The decoder's taps over ids fed as two steps of one session (a prefill chunk, then the rest)."""
    cache = SlotKVCache(KVGeometry.of(model), 1, 128)
    out: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    for cached, part in ((0, ids[:split]), (split, ids[split:])):
        layout = build_layout(cache, [(0, cached, len(part))], torch.device("cpu"))
        taps = dict.fromkeys(layers)
        with torch.inference_mode(), active(layout):
            decoder(torch.tensor(part), layout.positions, taps)
        for i in layers:
            out[i].append(taps[i])
    return {i: torch.cat(out[i]) for i in layers}


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="float32 exactness is a CPU property here")
@pytest.mark.parametrize("kind", ["eager", "packed"])
def test_llama_decoder_taps_are_the_layer_outputs(tiny_target, kind):
    """In float32 the plain decoder's taps are the layer outputs transformers' modules return over the same steps
    (their forward hooks): bitwise with PyTorch's operators, to float32 rounding on the packed mode's kernels
    (other summation orders); and to float32 rounding those of one plain forward over the whole sequence (its
    attention sums in another order than the ragged steps')."""
    reference = load_model(ModelConfig(tiny_target))
    modules, model = load_model(ModelConfig(tiny_target)), load_model(ModelConfig(tiny_target))
    for m in (modules, model):
        use_step_attention(m)  # as the runner does: transformers' layers attend over the slots
    decoder = LlamaDecoder(model) if kind == "eager" else StepProgram(model, "packed").decoder
    assert isinstance(decoder, LlamaDecoder)
    ids = tokens(40)
    got = tapped(decoder, model, ids, split=23)
    same_steps = tapped(TransformersDecoder(modules.base_model), modules, ids, split=23)
    plain = hooked(reference, ids)
    for i in LAYERS:
        assert got[i].shape == plain[i].shape == (40, model.config.hidden_size)
        if kind == "eager":
            assert torch.equal(got[i], same_steps[i]), (i, float((got[i] - same_steps[i]).abs().max()))
        for want in (same_steps[i], plain[i]):
            torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert not torch.equal(got[0], got[1])  # two different layers, not one tap twice


@pytest.mark.parametrize("mode", MODES)
def test_runner_hands_each_tapping_feed_its_rows(tiny_target, tiny_target_model, mode):
    """A batch of three sessions, one tapping (1, 0), one tapping (0,), one not, over a prefill chunk and then a
    verify-sized feed: each tapping feed's features are its rows of one plain forward's layer outputs, its layers
    concatenated in its order, in bfloat16 (to one bfloat16 rounding: float32 sums in another order may round a
    value to the neighbouring bfloat16); the logits are the untapped step's, bitwise (a CUDA-graph tier's tapping
    step replays a graph of its own, the same kernels; a compiled tier's runs its decoder uncompiled: to float32
    rounding)."""
    a, b, c = tokens(37, 1), tokens(9, 2), tokens(12, 3)
    runs = []
    for taps in ((LAYERS, (0,), None), (None, None, None)):
        runner = make_runner(tiny_target, mode, slots=4)
        slots = [runner.cache.allocate() for _ in range(3)]
        first = [Feed(s, 0, t[:-4], 0, taps=tp) for s, t, tp in zip(slots, (a, b, c), taps)]
        runner.forward(first)
        second = [Feed(s, len(t) - 4, t[-4:], 4, taps=tp) for s, t, tp in zip(slots, (a, b, c), taps)]
        logits = runner.forward(second)
        runs.append((first, second, logits))
    (first, second, logits), (_, _, plain_logits) = runs
    for got, want in zip(logits, plain_logits):
        if not runner.program.compiled:
            assert torch.equal(got, want)  # tapping changes no logits
        else:  # a tapping step runs uncompiled: the same function, to float32 rounding
            assert_close(got, want, mode)
    assert first[2].features is None and second[2].features is None
    hidden = tiny_target_model.config.hidden_size
    for k, (ids, layers) in enumerate(((a, LAYERS), (b, (0,)))):
        got = torch.cat([first[k].features, second[k].features])
        assert got.dtype == torch.bfloat16 and got.shape == (len(ids), len(layers) * hidden)
        with torch.inference_mode():
            want, _ = target_features(tiny_target_model, torch.tensor([ids], device=tiny_target_model.device), layers)
        assert_bf16_close(got, want[0])


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """got and want (bfloat16 features of the same positions) are equal but for values one rounding apart: float32
    sums in another order (another attention layout, other kernels) differ by float32 rounding of the row's scale,
    and a value that lands on the other side of a bfloat16 boundary moves by one bfloat16 unit in the last place."""
    got, want = got.float().cpu(), want.float().cpu()
    scale = float(want.abs().max())
    if not EXACT:  # a bfloat16 / float16 model (SPECDEC_TEST_DTYPE): two forwards round differently all along
        assert float((got - want).abs().max()) <= 0.05 * scale
        return
    assert torch.allclose(got, want, rtol=2**-7, atol=1e-6 * scale), float((got - want).abs().max())
