"""The Llama decoder as plain tensor code over the model's own weights: the step's fast path.

transformers' LlamaModel wraps every layer, norm and projection in modules, decorators and output
bookkeeping. On a CPU that costs more than the arithmetic it wraps at decode sizes: of the default
target's one-token step, ~20 ms are matrix products and ~10 ms are the Python and the small operators
around them. This decoder is the same computation, operator for operator, with nothing around it:

    x = embed(ids)
    for each layer:  h = rms(x);  q, k, v = h Wq, h Wk, h Wv;  rotate q, k;  o = attention(q, k, v)
                     x = x + o Wo;  h = rms(x);  x = x + (silu(h Wg) * h Wu) Wd
    return rms(x)

Each step is written as transformers writes it (RMSNorm in float32, cos / sin cast to the model's dtype,
rotate_half), so in float32 its hidden states are bitwise those of transformers' forward (a test checks
it against the module forward) and no greedy token can change. The weights are the model's own tensors,
not copies; the attention is the step's (specdec.engine.attention.step_attention), so the ragged,
static (CUDA-graph) and compiled forms all work through it. Measured on this project's 2-core CPU
(float32, one session, 100 cached tokens): the default target's step 27.5 ms against 32.9 through
transformers' modules at T = 1, 30.1 against 36.3 at T = 3, 46.8 against 52.4 at T = 9; the draft 1.8
against 2.3 ms.

The products are a strategy (`product`): by default each linear on its own (transformers' arithmetic);
the packed step mode in float32 passes specdec.engine.skinny_gemm.fused_product, which runs q, k and v as
one product and gate and up as another, on specdec's batch-invariant kernel. It also passes the row ops
(`ops`, csrc/row_ops.cpp): each layer's ~30 small operators become three calls (the residual add with
RMSNorm, rotary in place on q and k, SiLU times up), row by row and batch-invariant, the same function to
float32 rounding (measured on a 2-core CPU: ~3.7 ms of a one-token step's 23 and ~7 ms of a 16-session
step's were those small operators).

Only plain Llama models take it (LlamaForCausalLM: SiLU MLP, rotary position embeddings whose
frequencies do not depend on the sequence length); anything else runs transformers' own modules,
the same function at their speed (`LlamaDecoder.unsupported` says why).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from specdec.engine.attention import StepLayout, current_layout, step_attention

DYNAMIC_ROPE = ("dynamic", "longrope")  # frequencies recomputed from the sequence length: not supported

# A product strategy: linears sharing an input -> a function of that input returning each one's output.
Product = Callable[[Sequence[torch.nn.Module]], Callable[[torch.Tensor], Sequence[torch.Tensor]]]


def separate_product(linears: Sequence[torch.nn.Module]) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """Each linear's own product, as transformers computes it."""
    return lambda x: [_linear(x, layer) for layer in linears]


def concatenated_product(linears: Sequence[torch.nn.Module]) -> Callable[[torch.Tensor], Sequence[torch.Tensor]]:
    """Linears sharing an input as one product (q, k, v; gate, up): their weights concatenated once, and each
    linear's weight then a view of its rows, so the model's own modules still hold it and nothing is copied
    twice. One wide product instead of two or three narrow ones: on a GPU, fewer launches per layer (the
    same function; the rounding of a product may differ with its shape, as between any two shapes)."""
    if len(linears) == 1 or any(type(layer) is not torch.nn.Linear or layer.bias is not None for layer in linears):
        return separate_product(linears)
    with torch.no_grad():
        weight = torch.cat([layer.weight for layer in linears])  # [sum of outputs, in]
        start = 0
        for layer in linears:
            rows = layer.weight.shape[0]
            layer.weight.data = weight[start : start + rows]
            start += rows
    sizes = [layer.weight.shape[0] for layer in linears]
    return lambda x: F.linear(x, weight).split(sizes, dim=-1)


def unsupported_config(config, rope_type: str | None) -> str | None:
    """Why LlamaDecoder cannot run a model of `config` whose rotary embedding is of `rope_type` (None: it has
    none), or None if it can."""
    if getattr(config, "model_type", None) != "llama":
        return f"model type {getattr(config, 'model_type', None)!r} is not llama"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if rope_type is None or rope_type in DYNAMIC_ROPE:
        return f"rotary embedding {rope_type!r}"
    if getattr(config, "pretraining_tp", 1) > 1:
        return "pretraining_tp > 1"
    return None


class LlamaDecoder:
    """decoder(input_ids [T], positions [T]) -> hidden states [T, hidden] (after the final norm), over
    the active step layout."""

    @staticmethod
    def unsupported(model) -> str | None:
        """Why this decoder cannot run `model` exactly, or None if it can."""
        rope = getattr(model.base_model, "rotary_emb", None)
        return unsupported_config(model.config, None if rope is None else getattr(rope, "rope_type", "default"))

    def __init__(self, model, product: Product = separate_product, ops=None, native=None) -> None:
        """ops: the row ops kernel's module (float32 CPU models), or None for PyTorch's (TorchRowOps). native: the
        decoder kernel's module (csrc/decoder.cpp), which runs the layers in one call where every product is one
        kernel product (specdec.engine.skinny_gemm.FusedProduct) and the step attends by row attention alone."""
        reason = self.unsupported(model)
        if reason is not None:
            raise ValueError(f"LlamaDecoder cannot run this model: {reason}")
        base, config = model.base_model, model.config
        first = base.layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, first.head_dim
        self.scaling = first.scaling
        self.embed = base.embed_tokens
        self._embed = self.embed.forward  # called directly: nn.Module's call path (hooks, ~8 us) once a step for nothing
        self.layers = [(layer.input_layernorm,
                        product([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                        product([layer.self_attn.o_proj]),
                        layer.post_attention_layernorm,
                        product([layer.mlp.gate_proj, layer.mlp.up_proj]),
                        product([layer.mlp.down_proj]))
                       for layer in base.layers]
        self.norm = base.norm
        self.rotary = base.rotary_emb
        self.ops = ops or TorchRowOps
        self.native = self._native(native, config.hidden_size) if native is not None else None
        # with the CPU kernels' decoder, cos / sin of positions 0 .. n - 1 [n, D] each, computed once and looked up
        # (on a GPU the lookup would sit in captured graphs); without it, computed every step
        self._rotary_table: tuple[torch.Tensor, torch.Tensor] | None = None

    def _native(self, module, hidden: int):
        """The decoder kernel's Decoder over this model's weights (the same tensors), or None where a product is
        not one kernel product of the expected shape."""
        h, kv, d = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.head_dim

        def parts(product) -> list | None:  # q / k / v: one kernel product, or several (formats that differ)
            found = [product] if hasattr(product, "linear") else getattr(product, "parts", None)
            return found if found and all(hasattr(p, "linear") for p in found) else None

        for _, qkv, o, _, gate_up, down in self.layers:
            if parts(qkv) is None or not all(hasattr(p, "linear") for p in (o, gate_up, down)) \
                    or qkv.sizes != [h, kv, kv] or len(gate_up.sizes) != 2 or gate_up.sizes[0] != gate_up.sizes[1] \
                    or gate_up.linear.bias is not None or down.linear.bias is not None:
                return None
        scaling = self.scaling if self.scaling is not None else d ** -0.5
        decoder = module.Decoder(self.heads, self.kv_heads, d, scaling, self.norm.weight, self.norm.variance_epsilon)
        none = torch.empty(0)
        for norm1, qkv, o, norm2, gate_up, down in self.layers:
            qkv_parts = parts(qkv)
            decoder.add_layer(norm1.weight, norm1.variance_epsilon, [p.linear.packed for p in qkv_parts],
                              [p.format for p in qkv_parts], [sum(p.sizes) for p in qkv_parts],
                              [none if p.linear.bias is None else p.linear.bias for p in qkv_parts],
                              o.linear.packed, o.format, o.linear.bias, norm2.weight, norm2.variance_epsilon,
                              gate_up.linear.packed, gate_up.format, gate_up.sizes[0], down.linear.packed, down.format,
                              hidden)
        return decoder

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 taps: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:
        """taps: layer ids -> filled with each one's output [T, hidden] (the residual stream after that decoder
        layer, what transformers' LlamaDecoderLayer returns). The residual is updated lazily (layer i's last
        product is added into x by the next add_rms_norm), so layer i - 1's output is x right after
        iteration i's first add, and the last layer's is x after the final one: copies, as x changes on."""
        ops, t, d = self.ops, input_ids.shape[0], self.head_dim
        x = self._embed(input_ids)  # [T, hidden], a fresh tensor: the residual stream, updated in place
        cos, sin = self._rotary(positions, x.dtype)  # [T, D]
        if self.native is not None:
            step = current_layout()
            if isinstance(step, StepLayout) and step.rows is not None and step.rows.token_index.shape[0] == t:
                r, cache = step.rows, step.cache  # every token a row-attention row: the layers in one call
                stored = step.positions if step.kv_positions is None else step.kv_positions
                args = (x, cos, sin, cache.keys, cache.values, step.slots, stored, r.token_index, r.slot, r.base, r.bits)
                if taps is None:
                    return self.native.forward(*args)
                layers = list(taps)
                tapped = x.new_empty(len(layers), t, x.shape[1])  # the kernel copies each layer's output here
                out = self.native.forward_tapped(*args, layers, tapped)
                taps.update(zip(layers, tapped.unbind(0)))
                return out
        down = None
        for i, (norm1, qkv_proj, o_proj, norm2, gate_up_proj, down_proj) in enumerate(self.layers):
            h = ops.add_rms_norm(x, down, norm1.weight, norm1.variance_epsilon)
            if taps is not None and i - 1 in taps:
                taps[i - 1] = x.clone()
            q, k, v = qkv_proj(h)
            ops.rotary_(q, cos, sin, d)
            ops.rotary_(k, cos, sin, d)
            o = step_attention(i, q.view(t, self.heads, d).transpose(0, 1)[None], k.view(t, self.kv_heads, d).transpose(0, 1)[None],
                               v.view(t, self.kv_heads, d).transpose(0, 1)[None], self.scaling)  # [T, H, D]
            (o,) = o_proj(o.reshape(t, self.heads * d))
            h = ops.add_rms_norm(x, o, norm2.weight, norm2.variance_epsilon)
            gate, up = gate_up_proj(h)
            (down,) = down_proj(ops.silu_mul(gate, up))
        h = ops.add_rms_norm(x, down, self.norm.weight, self.norm.variance_epsilon)
        if taps is not None and len(self.layers) - 1 in taps:
            taps[len(self.layers) - 1] = x  # x changes no more
        return h

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] of each token's position, as transformers' LlamaRotaryEmbedding computes them. Every
        operator is elementwise, so a table of every position's rows holds those very bits: where the decoder keeps
        one, a step looks its rows up (two operators for nine), growing the table when a position passes its end."""
        if self.native is None:
            return self._rotary_rows(positions, dtype)
        table = self._rotary_table
        if table is not None:
            try:
                return table[0].index_select(0, positions), table[1].index_select(0, positions)
            except IndexError:  # a position past the table
                pass
        n = max(1024, int(positions.max()) + 1, 2 * (table[0].shape[0] if table is not None else 0))
        self._rotary_table = self._rotary_rows(torch.arange(n, device=positions.device), dtype)
        return self._rotary_table[0].index_select(0, positions), self._rotary_table[1].index_select(0, positions)

    def _rotary_rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.rotary.inv_freq.float()[None, :]  # [T, D / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.rotary.attention_scaling
        if scale == 1.0:  # x * 1.0 is x, bitwise: two operators fewer a step
            return emb.cos().to(dtype), emb.sin().to(dtype)
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def _linear(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """A plain linear's product without the module call; a packed one (specdec.engine.packed) as it is."""
    if type(layer) is torch.nn.Linear:
        return F.linear(x, layer.weight, layer.bias)
    return layer.forward(x)


class TorchRowOps:
    """The row ops (csrc/row_ops.cpp's three calls) in PyTorch's operators, as transformers writes them, so that
    the decoder's hidden states are bitwise transformers' forward's: any device and dtype."""

    @staticmethod
    def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x += delta (the residual, in place), then LlamaRMSNorm(x)."""
        if delta is not None:
            x.add_(delta)
        return _rms(x, weight, eps)

    @staticmethod
    def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> None:
        """Rotary embedding in place on each head of x [T, heads * D] (cos, sin [T, D])."""
        t = x.shape[0]
        x.copy_(_rotate(x.view(t, -1, head_dim), cos[:, None], sin[:, None]).view(t, -1))

    @staticmethod
    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalised in float32, scaled in the input's dtype."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [T, heads, D]: x cos + rotate_half(x) sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
