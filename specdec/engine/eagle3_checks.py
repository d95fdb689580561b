"""Checks of an EAGLE-3 head checkpoint against the target it is to draft for, before anything loads.

A head that does not fit its target would draft garbage or crash mid-session; it is refused at start,
with a message that names the field (config.json key or weight) and both values. Checked:

  architectures          an EAGLE-3 Llama draft (LlamaForCausalLMEagle3; vLLM's Eagle3LlamaForCausalLM)
  num_hidden_layers      1 (the midlayer)
  hidden_size            the target's (or target_hidden_size, where the head is narrower, with its own
                         embedding); fc.weight's input is 3 x that
  vocab_size             the target's
  eagle_aux_hidden_state_layer_ids   three target layer outputs, each in [0, the target's depth)
  draft_vocab_size       d2t's length and lm_head.weight's rows; below vocab_size a d2t is required
  d2t, t2d               a one-to-one map into the target's vocabulary, t2d its mask
  every weight           present, with its shape
"""

from __future__ import annotations

import torch

from specdec.math.draft_vocab import mapping_error, t2d_mask

ARCHITECTURE = "LlamaForCausalLMEagle3"  # what the writer puts in config.json (SpecForge's, the EAGLE authors')
ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")  # what the loader accepts (vLLM / speculators name)


class CheckpointError(ValueError):
    """A head checkpoint that cannot draft for this target; the message names the field."""


def default_aux_layers(num_layers: int) -> list[int]:
    """Low, middle, high: the layer outputs EAGLE-3 reads when the checkpoint names none (SGLang's default)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def aux_layer_ids(config: dict, target_layers: int) -> list[int]:
    """The target layer outputs the head reads: eagle_config's list, a top-level one, or the default."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = config.get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids is not None else default_aux_layers(target_layers)


def check_checkpoint(config: dict, state: dict[str, torch.Tensor], target, has_target_embedding: bool = True) -> None:
    """Raise CheckpointError naming the first field that does not fit `target` (a transformers config)."""
    arch = config.get("architectures") or []
    if not any(a in ARCHITECTURES for a in arch):
        _fail(f"architectures {arch} is not an EAGLE-3 Llama draft ({' or '.join(ARCHITECTURES)})")
    if config.get("num_hidden_layers", 1) != 1:
        _fail(f"num_hidden_layers {config['num_hidden_layers']}: an EAGLE-3 head has one decoder layer")
    hidden = _int(config, "hidden_size")
    target_hidden = int(config.get("target_hidden_size") or hidden)
    field = "target_hidden_size" if config.get("target_hidden_size") else "hidden_size"
    if target_hidden != target.hidden_size:
        _fail(f"{field} {target_hidden} does not match the target's hidden_size {target.hidden_size}")
    own_embedding = "embed_tokens.weight" in state
    if hidden != target.hidden_size and not own_embedding:
        _fail(f"hidden_size {hidden} differs from the target's {target.hidden_size} and the checkpoint has no "
              "embed_tokens.weight to replace the target's embedding")
    if not own_embedding and not has_target_embedding:
        _fail("embed_tokens.weight is absent and no target embedding was given")
    vocab = _int(config, "vocab_size")
    if vocab != target.vocab_size:
        _fail(f"vocab_size {vocab} does not match the target's vocab_size {target.vocab_size}")

    depth = target.num_hidden_layers
    ids = aux_layer_ids(config, depth)
    if len(ids) != 3:
        _fail(f"eagle_aux_hidden_state_layer_ids {ids}: EAGLE-3 fuses three target layers, got {len(ids)}")
    for i in ids:
        if not isinstance(i, int) or not 0 <= i < depth:
            _fail(f"eagle_aux_hidden_state_layer_ids {ids}: layer {i} is past the target's depth "
                  f"({depth} layers: ids 0..{depth - 1})")

    draft_vocab = int(config.get("draft_vocab_size") or vocab)
    if not 0 < draft_vocab <= vocab:
        _fail(f"draft_vocab_size {draft_vocab} is not in [1, vocab_size {vocab}]")
    d2t = state.get("d2t")
    if d2t is None and draft_vocab < vocab:
        _fail(f"d2t is missing: draft_vocab_size {draft_vocab} < vocab_size {vocab} needs the draft-to-target map")
    if d2t is not None:
        if d2t.dim() == 1 and d2t.shape[0] != draft_vocab:
            _fail(f"draft_vocab_size {draft_vocab} is inconsistent with d2t, which has {d2t.shape[0]} entries")
        error = mapping_error(d2t, vocab)
        if error:
            _fail(f"d2t: {error}")
        t2d = state.get("t2d")
        if t2d is not None and (t2d.shape != (vocab,) or not torch.equal(t2d.bool(), t2d_mask(d2t, vocab))):
            _fail("t2d is not the mask of the target ids d2t maps to")

    heads, kv = _int(config, "num_attention_heads"), int(config.get("num_key_value_heads") or config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = _int(config, "intermediate_size")
    shapes = {
        "fc.weight": (hidden, 3 * target_hidden),
        "midlayer.input_layernorm.weight": (hidden,), "midlayer.hidden_norm.weight": (hidden,),
        "midlayer.self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": (kv * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": (kv * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": (hidden, heads * head_dim),
        "midlayer.post_attention_layernorm.weight": (hidden,),
        "midlayer.mlp.gate_proj.weight": (inter, hidden), "midlayer.mlp.up_proj.weight": (inter, hidden),
        "midlayer.mlp.down_proj.weight": (hidden, inter),
        "norm.weight": (hidden,), "lm_head.weight": (draft_vocab, hidden),
    }
    if own_embedding:
        shapes["embed_tokens.weight"] = (vocab, hidden)
    for name, shape in shapes.items():
        if name not in state:
            _fail(f"{name} is missing")
        if tuple(state[name].shape) != shape:
            what = "draft_vocab_size" if name == "lm_head.weight" else "the config"
            _fail(f"{name} has shape {tuple(state[name].shape)}, {what} says {shape}")


def _int(config: dict, key: str) -> int:
    if not isinstance(config.get(key), int):
        _fail(f"{key} is missing or not an integer: {config.get(key)!r}")
    return config[key]


def _fail(message: str) -> None:
    raise CheckpointError(f"EAGLE-3 head checkpoint refused: {message}")
