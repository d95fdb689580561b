"""Runners in every step mode, and how closely two forwards must agree (shared by the runner tests)."""

from __future__ import annotations

import torch

from specdec.engine.config import StepConfig
from specdec.engine.cuda_graphs import CudaGraphStep
from specdec.engine.draft_vocab_head import restrict_head
from specdec.engine.kv_cache import KVGeometry, SlotKVCache
from specdec.engine.runner import ModelRunner
from specdec.engine.step import decoder_for, graph_decoder
from specdec.models import load_model
from tests.helpers import TEST_DEVICE, TEST_DTYPE, device_model

# Every mode the tests compare: "static" is the CUDA-graph step's fixed-shape attention run uncaptured, and
# "static-fused" the same with the decoder the graphs capture by default (fused ops: products concatenated).
MODES = (["eager", "packed", "compile", "static", "static-fused"] if TEST_DEVICE == "cpu"
         else ["eager", "cuda-graphs"])

# float32 (CI's dtype): the ragged forward equals transformers' to 1e-4 and picks the same argmax. In
# bfloat16 / float16 (SPECDEC_TEST_DTYPE on a GPU) two attention implementations round differently:
# the logits must agree to a few percent of their scale, and near-tie argmaxes may differ
# (bench/exactness.py counts how often).
EXACT = TEST_DTYPE == "float32"


def assert_close(got: torch.Tensor, want: torch.Tensor, what) -> None:
    got, want = got.float(), want.float()
    if EXACT:
        assert torch.allclose(got, want, atol=1e-4), (what, float((got - want).abs().max()))
        assert torch.equal(got.argmax(-1), want.argmax(-1)), what
    else:
        assert float((got - want).abs().max()) <= 0.05 * float(want.abs().max()), (what, float((got - want).abs().max()))


def make_runner(model_dir: str, mode: str, slots: int = 8, slot_tokens: int = 256,
                draft_vocab: torch.Tensor | None = None) -> ModelRunner:
    """A runner in `mode` over a NaN-filled pool ("static": the CUDA-graph step without capture); draft_vocab: the
    model's LM head restricted to these ids (specdec.engine.draft_vocab_head.restrict_head)."""
    model = restrict_head(load_model(device_model(model_dir)), draft_vocab)
    graphs = mode in ("static", "static-fused", "cuda-graphs")
    cache = SlotKVCache(KVGeometry.of(model), slots, slot_tokens, scratch=graphs)
    for t in cache.keys + cache.values:
        t.fill_(float("nan"))  # garbage: only what the runner writes may ever be read unmasked
    runner = ModelRunner(model, cache, StepConfig(mode="eager" if mode.startswith("static") else mode,
                                                  capture_sessions=(1, 2, 4, 8), capture_tokens=(1, 2, 4, 8, 16)))
    if mode.startswith("static"):  # the CUDA-graph step's arithmetic, uncaptured: plain, or the compiled decoder
        decoder = graph_decoder(model) if mode == "static-fused" else decoder_for(model)
        runner.graphs = CudaGraphStep(decoder, cache, (1, 2, 4, 8), (1, 2, 4, 8, 16), max_graphs=32, capture=False)
    return runner
