"""A Llama causal LM's weights in transformers' module layout, without transformers' modeling code.

The CPU's packed step never runs transformers' modules: specdec.engine.llama.LlamaDecoder reads the layers'
weights and computes the forward itself, and the head is a product of its own. transformers' modeling code is
then only a container, and importing it costs a tier ~2 s and ~120 MiB of resident memory (it pulls in
torch's compiler stack, accelerate, scipy and sympy). This is the same container without it: the same
attribute names (model.layers[i].self_attn.q_proj, ...), the same parameter names (a checkpoint's state dict
loads as is), the same rotary frequencies (transformers' own rope functions). It has no forward of its own.

Only what LlamaDecoder runs exactly is built (`unsupported`); anything else loads through transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from specdec.engine.llama import unsupported_config


def unsupported(config) -> str | None:
    """Why this container cannot hold a model of `config` for LlamaDecoder, or None if it can."""
    if getattr(config, "quantization_config", None):
        return "a quantisation config"
    return unsupported_config(config, _rope(config).get("rope_type", "default"))


# LlamaConfig's defaults, for the fields a config.json may leave out (transformers' configuration_llama.py)
DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu", "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6, "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2, "pretraining_tp": 1,
            "tie_word_embeddings": False, "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False,
            "head_dim": None}


def read_config(directory: str | Path) -> SimpleNamespace | None:
    """A Llama checkpoint's config.json with LlamaConfig's defaults filled in, read without transformers (its
    configuration classes import its modeling stack: ~2 s and ~130 MiB); None where the container would not
    hold it (not llama, a rope scaling, a quantisation config: transformers reads those)."""
    path = Path(directory) / "config.json"
    if not path.exists():
        return None
    raw = json.loads(path.read_text())
    rope = raw.get("rope_parameters") or {}
    if raw.get("rope_scaling") or rope.get("rope_type", "default") != "default":  # (the rest: unsupported())
        return None
    c = SimpleNamespace(**{**DEFAULTS, **raw})
    c.num_key_value_heads = c.num_key_value_heads or c.num_attention_heads
    c.head_dim = c.head_dim or c.hidden_size // c.num_attention_heads
    c.rope_parameters = {"rope_type": "default", "rope_theta": float(rope.get("rope_theta", c.rope_theta))}
    return c if unsupported(c) is None else None


def _rope(config) -> dict:
    return getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": config.rope_theta}


def _linear(n_in: int, n_out: int, bias: bool = False, device=None) -> nn.Linear:
    """An nn.Linear with its parameters left unset (a loader fills them): initialising them, on the meta device
    too, runs PyTorch's reference ops, which import its compiler stack."""
    linear = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(linear)
    linear.in_features, linear.out_features = n_in, n_out
    linear.weight = nn.Parameter(torch.empty(n_out, n_in, device=device))
    linear.register_parameter("bias", nn.Parameter(torch.empty(n_out, device=device)) if bias else None)
    return linear


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device))
        self.variance_epsilon = eps


class RotaryEmbedding(nn.Module):
    """inv_freq and attention_scaling as transformers' LlamaRotaryEmbedding computes them."""

    def __init__(self, config) -> None:
        super().__init__()
        self.rope_type = _rope(config).get("rope_type", "default")
        if self.rope_type == "default":  # (transformers not imported: ~20 MiB of a tier's memory)
            dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            inv_freq = 1.0 / (_rope(config)["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.attention_scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # light: no modeling code

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)


class Attention(nn.Module):
    def __init__(self, config, device=None) -> None:
        super().__init__()
        h, kw = config.hidden_size, {"bias": bool(getattr(config, "attention_bias", False)), "device": device}
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj, self.k_proj = _linear(h, heads * self.head_dim, **kw), _linear(h, kv * self.head_dim, **kw)
        self.v_proj, self.o_proj = _linear(h, kv * self.head_dim, **kw), _linear(heads * self.head_dim, h, **kw)


class MLP(nn.Module):
    def __init__(self, config, device=None) -> None:
        super().__init__()
        h, i, kw = config.hidden_size, config.intermediate_size, {"bias": bool(getattr(config, "mlp_bias", False)), "device": device}
        self.gate_proj, self.up_proj, self.down_proj = _linear(h, i, **kw), _linear(h, i, **kw), _linear(i, h, **kw)


class DecoderLayer(nn.Module):
    def __init__(self, config, device=None) -> None:
        super().__init__()
        self.self_attn, self.mlp = Attention(config, device), MLP(config, device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)


class LlamaModel(nn.Module):
    def __init__(self, config, device=None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, getattr(config, "pad_token_id", None),
                                         _weight=torch.empty(config.vocab_size, config.hidden_size, device=device))
        self.layers = nn.ModuleList(DecoderLayer(config, device) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.rotary_emb = RotaryEmbedding(config)  # on the CPU: its buffer is computed, not loaded


class LlamaForCausalLM(nn.Module):
    """model (LlamaModel) and lm_head, with transformers' accessors; the head tied to the embedding where the
    config says so."""

    def __init__(self, config, generation_config=None, device=None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, device)
        self.lm_head = _linear(config.hidden_size, config.vocab_size, device=device)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.generation_config = generation_config or SimpleNamespace(eos_token_id=getattr(config, "eos_token_id", None))

    @property
    def base_model(self) -> LlamaModel:
        return self.model

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, module: nn.Module) -> None:
        self.lm_head = module


def build(config, device: str | torch.device = "cpu", generation_config=None) -> LlamaForCausalLM:
    """The container for `config`, float32, its parameters on `device` ("meta": none allocated; passed to each
    module, not as a default-device mode, under which their initialisers import torch's compiler)."""
    return LlamaForCausalLM(config, generation_config, device)


def load(directory: str | Path) -> LlamaForCausalLM:
    """A Llama checkpoint directory (config.json, *.safetensors) in float32 on the CPU, eval mode: the same
    parameters transformers' from_pretrained gives (ValueError if one is missing or left over)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config = read_config(directory)
    if config is None:
        raise ValueError(f"{directory}: not a plain Llama checkpoint (specdec.engine.llama_weights.read_config)")
    generation = directory / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.exists() else None
    model = build(config, "meta", SimpleNamespace(eos_token_id=config.eos_token_id if eos is None else eos))
    state: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update(load_file(file))
    tied = config.tie_word_embeddings
    if tied:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False, assign=True)
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{directory}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if tied:  # the embedding's parameter was replaced by the loaded one
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
