"""The model as a tier serves it (specdec.engine.engine loads it through here; the EAGLE-3 trainer's data and the
benches too): a GGUF's matrices in their blocks for the packed step, a draft's quantised at load
(specdec.engine.quantize) and its LM head over a draft vocabulary (specdec.engine.draft_vocab_head) where asked."""

from __future__ import annotations

import torch

from specdec.engine import gguf_weights
from specdec.engine.config import TierConfig
from specdec.engine.draft_vocab_head import restrict_head, vocabulary_ids
from specdec.engine.quantize import quantize
from specdec.engine.step import resolve_mode
from specdec.models import eos_token_ids, load_model

# Compiled steps: engines of one process that serve the same model share its weights, and so its compiled graphs
# (frozen weights make every model object a compile of its own): a self-draft, or a test's many clusters, compile once.
_compiled_models: dict = {}


def load_tier_model(config: TierConfig):
    """The model as a tier of `config` serves it: a GGUF's matrices in their blocks for the packed step, a draft's
    quantised and its head over a draft vocabulary where asked, the compiled mode's shared per model and vocabulary."""
    mode = resolve_mode(config.step.mode, torch.device(config.model.device))
    packed = mode == "packed" and config.step.skinny_gemm  # float32 on the skinny GEMM: a GGUF served from its blocks
    key = (config.model, config.step.draft_vocab)  # (a self-draft's restricted head is not its target's)
    if mode == "compile" and key in _compiled_models:
        return _compiled_models[key]
    model = load_model(config.model) if mode == "compile" else \
        gguf_weights.load_model(config.model, blocks=packed and config.step.gguf_blocks, light=packed)
    ids = vocabulary_ids(config.step.draft_vocab, int(model.config.vocab_size), eos_token_ids(model, None))
    model = quantize(model, config.step.quantize, config.model, packed)  # a draft's matrices into blocks, if asked
    model = restrict_head(model, ids)  # a draft's LM head over its draft vocabulary, if asked
    if mode == "compile":
        _compiled_models[key] = model
    return model
