"""A draft's float32 matrices quantised into Q8_0 blocks at load, served by the block kernel (specdec.engine.quant_gemm).

A draft's proposals are exact whatever its weights: the tier reports the q it drew from, and the target's
rejection sampling keeps the target's distribution for any q (docs/DESIGN.md, Verification). So the draft may
run a cheaper model than its checkpoint. Q8_0 (ggml's block of 32 weights: a float16 scale d and 32 int8 q,
value q d) keeps the draft's argmax on ~98% of positions and quarters its bytes; the default draft is mostly
its tied 49152 x 256 embedding / LM head, which the step streams every time, so the step takes ~0.5x the
float32 one on an AVX-512 or AVX2 CPU (docs/performance.md, "A quantised draft"). The blocks are what gguf-py's
quantiser writes (a GGUF of the draft in Q8_0 would hold the same), packed for the kernel as a GGUF's are.

A target never runs this: its output must be the reference model's (the target service refuses --quantize).
"""

from __future__ import annotations

import logging

import torch

from specdec.engine import skinny_gemm
from specdec.engine.gguf_weights import set_module
from specdec.engine.quant_gemm import BLOCK, FORMATS, QuantEmbedding, QuantLinear, pack

log = logging.getLogger(__name__)

QUANTIZE = ("none", "auto", "q8_0")  # StepConfig.quantize's choices (auto: q8_0 where the block kernel runs it)


def quantize(model, choice: str, cfg, on_kernel: bool):
    """`model` (loaded from ModelConfig `cfg`) with its matrices quantised as StepConfig.quantize `choice` asks,
    where its step runs them on the block kernel (on_kernel: packed on the skinny GEMM); else as it is, with a
    warning that says why (for auto, silently: a GPU or bfloat16 draft keeps its weights)."""
    if choice == "none":
        return model
    why = "" if on_kernel else "the step does not run on the skinny GEMM (--step-mode packed on an AVX-512 or AVX2 CPU)"
    if not why and (torch.device(cfg.device).type != "cpu" or cfg.dtype != "float32"):
        why = f"{cfg.dtype} on {cfg.device} (the block kernel is float32 on a CPU)"
    why = why or skinny_gemm.unavailable() or ""
    if why:
        (log.info if choice == "auto" else log.warning)("--quantize %s not applied, the weights stay as loaded: %s",
                                                        choice, why)
        return model
    fmt = "Q8_0" if choice == "auto" else choice.upper()
    log.info("--quantize %s: %d matrices quantised into %s blocks at load", choice, quantize_model(model, fmt), fmt)
    return model


def quantize_blocks(weight: torch.Tensor, fmt: str = "Q8_0") -> torch.Tensor:
    """A float32 matrix [N, K] (K a multiple of 32) as a GGUF would store it in `fmt`: uint8 [N, K / 32 * block bytes]."""
    from gguf import GGMLQuantizationType, quantize

    return torch.from_numpy(quantize(weight.detach().contiguous().numpy(), GGMLQuantizationType[fmt]))


def quantized(linear: torch.nn.Module, fmt: str = "Q8_0") -> QuantLinear | None:
    """A float32 linear without bias whose in_features is a multiple of 32 as a QuantLinear over its `fmt` blocks;
    None for any other module."""
    if type(linear) is not torch.nn.Linear or linear.bias is not None or linear.in_features % BLOCK \
            or linear.weight.dtype != torch.float32:
        return None
    block = FORMATS[fmt]
    return QuantLinear(pack(quantize_blocks(linear.weight, fmt), block), block, linear.out_features, linear.in_features)


def quantize_model(model, fmt: str = "Q8_0") -> int:
    """Every linear of `model` that quantized() takes replaced by its QuantLinear; a tied input embedding becomes a
    QuantEmbedding over the head's blocks, as a GGUF's tied table is served. Returns the matrices quantised."""
    names = {module: name for name, module in model.named_modules()}
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    weight = getattr(head, "weight", None)  # None: no head, or one already in blocks (a GGUF's)
    tied = weight is not None and weight is getattr(embedding, "weight", None)
    count = 0
    for module, name in list(names.items()):
        linear = quantized(module, fmt)
        if linear is None:
            continue
        set_module(model, name, linear)
        if module is head and tied:
            set_module(model, names[embedding], QuantEmbedding(linear, embedding.padding_idx))
        count += 1
    if count:  # the float tensors left (norms): copied, or their few bytes keep the checkpoint's whole memory map
        for p in model.parameters():  # resident (safetensors loads zero-copy; unquantised weights stay shared)
            p.data = p.data.clone()
    return count
