"""The target's features for an EAGLE-3 head: its low / middle / high layer outputs at each position, 16-bit.

Layer id i is the residual stream after decoder layer i (0-based), as the head's checkpoint names it
(specdec.engine.eagle3); the features at a position are the three concatenated, [3 H], the fc's input.
They are read with forward hooks on the decoder layers, so any transformers decoder-only model (the
tiers' own weights) gives them from its ordinary forward: nothing in the model changes and the logits
are the forward's own. Stored 16-bit (bfloat16 by default, float16 where asked): 2 bytes a number, what
a later session puts on the wire with the verdict (docs/DESIGN.md, "Feature drafts").
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch

FEATURE_DTYPES = (torch.bfloat16, torch.float16)


def decoder_layers(model) -> Sequence[torch.nn.Module]:
    """The decoder layers of a transformers causal LM (LlamaForCausalLM and its kind: model.model.layers)."""
    return model.base_model.layers


@contextmanager
def captured(model, layer_ids: Sequence[int]):
    """While active, every forward of `model` appends each named layer's output [B, T, H] to the yielded
    dict's lists (by layer id)."""
    layers = decoder_layers(model)
    for i in layer_ids:
        if not 0 <= i < len(layers):
            raise ValueError(f"layer id {i} is past the model's depth ({len(layers)} layers)")
    out: dict[int, list[torch.Tensor]] = {i: [] for i in layer_ids}

    def hook(i):
        def record(_module, _args, output):
            out[i].append(output[0] if isinstance(output, tuple) else output)
        return record

    handles = [layers[i].register_forward_hook(hook(i)) for i in sorted(set(layer_ids))]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


def target_features(model, input_ids: torch.Tensor, layer_ids: Sequence[int], rows: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.bfloat16, **forward_kwargs):
    """One forward of `model` over input_ids [B, T] -> (features [B, T or R, 3 H] in dtype, the forward's output).

    rows [R]: only these positions' features (e.g. the newly committed ones); forward_kwargs go to the
    model (past_key_values, position_ids, attention_mask, ...)."""
    if dtype not in FEATURE_DTYPES:
        raise ValueError(f"feature dtype must be 16-bit ({FEATURE_DTYPES}), got {dtype}")
    with captured(model, layer_ids) as states:
        output = model(input_ids=input_ids, **forward_kwargs)
    parts = [states[i][-1] for i in layer_ids]  # [B, T, H] each, in the order the head's fc expects
    features = torch.cat(parts, dim=-1)
    if rows is not None:
        features = features[:, rows]
    return features.to(dtype), output


def to_bytes(features: torch.Tensor) -> bytes:
    """[N, W] 16-bit features -> N x W x 2 bytes, row-major, little-endian: what a proto bytes field would carry."""
    if features.dtype not in FEATURE_DTYPES or features.dim() != 2:
        raise ValueError(f"features must be [N, W] and 16-bit, got {tuple(features.shape)} {features.dtype}")
    return features.detach().cpu().contiguous().view(torch.int16).numpy().astype("<i2", copy=False).tobytes()


def from_bytes(data: bytes, width: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """to_bytes' inverse: [N, width] in dtype; a length that is not whole rows is refused."""
    if dtype not in FEATURE_DTYPES or width < 1 or len(data) % (2 * width):
        raise ValueError(f"{len(data)} bytes are not whole rows of {width} 16-bit numbers ({dtype})")
    import numpy as np

    return torch.from_numpy(np.frombuffer(data, dtype="<i2").astype(np.int16)).view(dtype).view(-1, width)


def wire_bytes(hidden_size: int, layers: int = 3, bytes_per_number: int = 2) -> int:
    """Bytes of one position's features on the wire: raw (layers x hidden) or fused through fc (layers = 1)."""
    return layers * hidden_size * bytes_per_number
