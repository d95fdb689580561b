"""A feature draft's weights: recognising an EAGLE-3 head's checkpoint, the target's input embedding it shares
(without keeping the rest of the target), and its linears on specdec's skinny GEMM kernel."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdec.engine.eagle3_checks import ARCHITECTURES

if TYPE_CHECKING:  # (its module imports transformers' Llama modules: a draft model's tier never needs them)
    from specdec.engine.eagle3 import Eagle3Head


def is_head(path: str) -> bool:
    """Whether `path` is an EAGLE-3 head checkpoint (a directory whose config.json names its architecture)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return any(a in ARCHITECTURES for a in json.loads(config.read_text()).get("architectures") or [])
    except (ValueError, AttributeError):
        return False


def pack_linears(head: Eagle3Head, quantize: str = "none") -> bool:
    """Every linear of a float32 head on a CPU onto specdec's skinny GEMM kernel (specdec.engine.skinny_gemm), in
    place: a few rows at a time it is several times faster than the library's product, and batch-invariant, so
    the head's logits for a session are bitwise the same whichever sessions share its step (seeded sampling stays
    reproducible under load). quantize (StepConfig.quantize; auto = q8_0 here): the linears in Q8_0 blocks on the
    same kernel instead (specdec.engine.quantize: a draft's weights may change, its q is reported as drawn).
    False (nothing changed) where the kernel is unavailable or the head is not float32."""
    from specdec.engine import skinny_gemm
    from specdec.engine.quantize import quantized

    if head.dtype != torch.float32 or head.norm.weight.device.type != "cpu" or skinny_gemm.unavailable() is not None:
        return False
    swaps = [(parent, name, child) for parent in head.modules() for name, child in parent.named_children()
             if type(child) is torch.nn.Linear]
    for parent, name, child in swaps:
        blocks = quantized(child) if quantize != "none" else None
        setattr(parent, name, blocks if blocks is not None else skinny_gemm.SkinnyLinear([child]))
    return True


def _config_dir(target_path: str) -> str:
    from specdec.models import ModelConfig, local_source

    return local_source(ModelConfig(target_path))


def target_embedding(target_path: str) -> tuple[torch.nn.Embedding, object]:
    """The target's input embedding (float32) and config, without keeping the rest of its weights."""
    from safetensors import safe_open
    from transformers import AutoConfig

    directory = Path(_config_dir(target_path))
    config = AutoConfig.from_pretrained(directory)
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as weights:
            for name in ("model.embed_tokens.weight", "embed_tokens.weight"):
                if name in weights.keys():
                    return torch.nn.Embedding.from_pretrained(weights.get_tensor(name).float(), freeze=True), config
    from specdec.models import ModelConfig, load_model

    model = load_model(ModelConfig(target_path))  # weights in another form: load the model, keep its embedding
    return torch.nn.Embedding.from_pretrained(model.get_input_embeddings().weight.detach().float(), freeze=True), config
