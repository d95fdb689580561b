"""The step program: the one forward a tier runs every step, compiled where the device allows it.

A step is (input_ids [T], positions [T], row_index [R]) -> logits [R, V] over the active layout
(specdec.engine.attention.active): the decoder over every scheduled session's new tokens, then the LM
head on the rows someone needs. One program per tier, in one of four modes:

  eager        transformers' modules as they are: the reference, and the debugging path;
  packed       the Llama decoder as plain tensor code (specdec.engine.llama; other models: transformers'
               modules) over weights packed once at start, no compile time. In float32 on an AVX-512
               or AVX2 CPU every linear, LM head included, runs on specdec's skinny GEMM kernel
               (specdec.engine.skinny_gemm: q, k, v as one product, gate and up as another;
               batch-invariant; 0.1-0.5x the libraries' time at 1-3 rows); elsewhere the LM head runs
               on oneDNN-packed weights (specdec.engine.packed), and in bfloat16 / float16 the layers
               too (the CPU's bfloat16 matrix units, flat to 17 rows);
  compile      the same forward through torch.compile (inductor, frozen weights): norms, rotary and
               the MLP fuse, and every linear runs on weights packed once at start for the CPU's
               matrix library (oneDNN), which keeps a 2-17 row product near the cost of one row, where
               an eager float32 product with 2-3 rows takes 1.8-2.6x one row. The attention stays one
               opaque op (specdec::ragged_attention), so the step's layout never enters the graph and
               one dynamic-shape graph serves every T (plus one for T = 1, which the compiler
               specialises);
  cuda-graphs  decode and verify steps replayed from CUDA graphs captured per shape bucket
               (specdec.engine.cuda_graphs); other steps (prefill chunks) run uncaptured. The graphs
               capture the Llama decoder with fused ops (`fused_ops`): each layer's norms, rotary and
               SiLU on three Triton kernels (specdec.engine.triton_row_ops), its attention on one
               (specdec.engine.triton_attention), and q, k, v and gate, up as one product each
               (specdec.engine.llama.concatenated_product), so a layer launches ~12 kernels instead
               of ~50. On a GPU a small model's step is bound by kernel count, not by its weights'
               bytes.

`auto` picks AUTO_CPU on a CPU (measured by bench/step_cost.py) and cuda-graphs on CUDA. Every mode computes the same function; the
tests compare each against eager and against transformers' own forward, and bench/exactness.py counts
argmax flips between them per device and dtype.
"""

from __future__ import annotations

import logging
import time

import torch

from specdec.engine import cpu_kernels, skinny_gemm, triton_row_ops
from specdec.engine.config import STEP_MODES
from specdec.engine.draft_vocab_head import head_product, set_head_product
from specdec.engine.eagle3_features import captured
from specdec.engine.llama import LlamaDecoder, concatenated_product
from specdec.engine.packed import can_pack, pack_head, pack_layers, replace_linears
from specdec.engine.quant_gemm import QuantLinear

log = logging.getLogger(__name__)

MODES = STEP_MODES
AUTO_CPU = "packed"  # what `auto` runs on a CPU


def resolve_mode(mode: str, device: torch.device) -> str:
    if mode not in MODES:
        raise ValueError(f"step mode must be one of {MODES}, got {mode!r}")
    if mode == "cuda-graphs" and device.type != "cuda":
        raise ValueError(f"step mode cuda-graphs needs a CUDA device, not {device}")
    if mode == "packed" and not can_pack(device):
        raise ValueError(f"step mode packed needs a CPU with oneDNN, not {device}")
    if mode != "auto":
        return mode
    return {"cpu": AUTO_CPU, "cuda": "cuda-graphs"}.get(device.type, "eager")


def _raise_recompile_limits() -> None:
    """Frozen constants make each model its own graph of the same code: a process holding several models
    (tests, a self-draft beside its target) needs more than dynamo's default of 8 graphs per code object.
    (torch's compiler stack is imported here, by the compile mode alone: ~1 s and ~60 MiB a process.)"""
    from torch._dynamo import config

    config.recompile_limit = max(config.recompile_limit, 64)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 512)


class TransformersDecoder:
    """transformers' own decoder modules (embeddings + layers + final norm), as a step's decoder."""

    def __init__(self, base_model) -> None:
        self.base_model = base_model

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 taps: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:  # [T], [T] -> [T, H]
        """taps: layer ids -> filled with each one's output [T, H], read by forward hooks on the layers."""
        if not taps:
            return self._forward(input_ids, positions)
        with captured(self.base_model, list(taps)) as states:
            hidden = self._forward(input_ids, positions)
        taps.update((i, states[i][-1][0]) for i in taps)
        return hidden

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.base_model(input_ids=input_ids[None], position_ids=positions[None],
                               use_cache=False).last_hidden_state[0]


def decoder_for(model, plain: bool = False):
    """The step's decoder: the plain-tensor Llama decoder where it runs this model exactly
    (specdec.engine.llama), else (or with plain=True, the eager mode's reference) transformers' modules."""
    if not plain and LlamaDecoder.unsupported(model) is None:
        return LlamaDecoder(model)
    return TransformersDecoder(model.base_model)


def graph_decoder(model):
    """The decoder CUDA graphs capture: the plain Llama decoder with q, k, v and gate, up as one product
    each, and its small operators on the Triton row ops where they run (a CUDA device with Triton;
    elsewhere PyTorch's). Other models: transformers' modules. (torch.compile of the whole decoder would
    fuse as much, but compiling the default target's 30 layers had not finished after 4.5 minutes on a
    GPU machine, nor after 10 on a CPU.)"""
    if LlamaDecoder.unsupported(model) is not None:
        return decoder_for(model)
    device = next(model.parameters()).device
    ops = triton_row_ops.TritonRowOps if triton_row_ops.available(device) is None else None
    return LlamaDecoder(model, product=concatenated_product, ops=ops)


class MovedLinear(torch.nn.Module):
    """Left where a linear was whose weights moved into the step's packed products: calling it is a bug."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this linear's weights moved into the step program's skinny GEMM products")


SKINNY_DECODER = "specdec_skinny_decoder"  # a model packed for the skinny GEMM keeps its decoder here


def skinny_applies(model, enabled: bool = True) -> str | None:
    """Why the packed mode cannot run this model's linears on the skinny GEMM kernel, or None if it can."""
    if getattr(model, SKINNY_DECODER, None) is not None:
        if not enabled:
            raise ValueError("this model's linears were packed for the skinny GEMM by another engine: load it "
                             "again to run it without")
        return None
    weight = next(model.parameters())
    if not enabled:
        return "turned off (--no-skinny-gemm)"
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return f"{weight.dtype} on {weight.device.type} (the kernel is float32 on a CPU)"
    if type(head_product(model)) not in (torch.nn.Linear, QuantLinear):
        return "the LM head is not a plain linear"
    return skinny_gemm.unavailable()


def packed_decoder(model, skinny: bool):
    """The packed mode's decoder and head, in place. skinny: every float32 linear on specdec's skinny GEMM
    kernel (q, k, v fused into one product and gate, up into another, where the plain Llama decoder
    runs the model, with its small operators on the row ops kernel; the originals' weights are dropped,
    and engines sharing the model share the decoder; a GGUF's quantised linears, specdec.engine.gguf_weights,
    stay in their blocks on the same kernel); else the LM head packed for oneDNN, and the layers too in bfloat16 / float16
    (specdec.engine.packed)."""
    if not skinny:
        pack_head(model)
        pack_layers(model)  # bfloat16 / float16 weights only
        return decoder_for(model)
    decoder = getattr(model, SKINNY_DECODER, None)
    if decoder is not None:
        return decoder
    head = head_product(model)  # (a draft vocabulary's head: its linear over the kept rows)
    if type(head) is torch.nn.Linear:  # a QuantLinear head is on the kernel already
        set_head_product(model, skinny_gemm.SkinnyLinear([head]))
    if LlamaDecoder.unsupported(model) is None:
        decoder = LlamaDecoder(model, product=skinny_gemm.fused_product, ops=cpu_kernels.load("row_ops")[0],
                               native=cpu_kernels.load("decoder")[0])
        replace_linears(model, MovedLinear)
    else:
        replace_linears(model, lambda linear: skinny_gemm.SkinnyLinear([linear]))
        decoder = TransformersDecoder(model.base_model)
    setattr(model, SKINNY_DECODER, decoder)
    return decoder


class StepProgram:
    """The decoder + LM head as one callable, eager or compiled."""

    def __init__(self, model, kind: str = "eager", use_skinny_gemm: bool = True, fused_ops: bool = True) -> None:
        """kind: eager | packed | compile | cuda-graphs (the steps a CUDA-graph tier does not replay run
        uncaptured, through the same decoder its graphs captured). use_skinny_gemm: in packed mode, run
        float32 linears on specdec's kernel where it applies (skinny_applies). fused_ops: in cuda-graphs mode,
        the decoder the graphs capture runs fused kernels (graph_decoder)."""
        compiled = kind == "compile"
        self.kind = kind
        self.skinny = kind == "packed" and skinny_applies(model, use_skinny_gemm) is None  # linears on the kernel
        if kind == "packed":
            self.decoder = packed_decoder(model, self.skinny)  # (input_ids [T], positions [T]) -> [T, H]
        elif kind == "cuda-graphs" and fused_ops:
            self.decoder = graph_decoder(model)
        else:
            self.decoder = decoder_for(model, plain=kind == "eager")
        self.head = model.get_output_embeddings()
        self.device = next(model.parameters()).device
        self.plain_head = isinstance(self.head, torch.nn.Linear)  # False for e.g. a quantized head
        self.compiled = compiled
        self.compile_s = 0.0  # time spent compiling (the first call of each graph)
        if compiled:
            # Frozen weights are constants of the graph, so inductor packs each linear's weight once for
            # oneDNN. (Set process-wide: passed as a torch.compile option it does not reach the passes
            # that pack; a tier process compiles nothing else.)
            from torch._inductor import config as inductor_config

            inductor_config.freezing = True
            _raise_recompile_limits()
        self._fn = torch.compile(self._decode, dynamic=True, fullgraph=True) if compiled else self._decode_eager
        self._seen: set[bool] = set()  # which graphs (T == 1, T >= 2) have been compiled

    def _decode(self, input_ids: torch.Tensor, positions: torch.Tensor, row_index: torch.Tensor) -> torch.Tensor:
        return self.head(self.decoder(input_ids, positions)[row_index])  # [R, V]

    def _decode_eager(self, input_ids, positions, row_index, taps=None) -> torch.Tensor:
        x = self.decoder(input_ids, positions, taps)[row_index]
        # On a CPU, x @ W.T for a few rows makes the BLAS pack all of W (a 49152 x 576 head: 24 ms for 2
        # rows on one core) while W @ x.T costs 6 ms: same product, same weights.
        if self.plain_head and self.device.type == "cpu" and self.head.bias is None and 1 < x.shape[0] <= 16:
            return (self.head.weight @ x.T).T
        return self.head(x)

    @torch.inference_mode()
    def tapped(self, input_ids: torch.Tensor, positions: torch.Tensor, row_index: torch.Tensor,
               layers: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The step with taps: (logits [R, V], layer id -> that layer's output [T, H] at every token), run
        eagerly through the mode's own decoder (compile: the uncompiled one; cuda-graphs: uncaptured), so it
        computes the same function as __call__. A step that taps nothing goes through __call__."""
        taps: dict[int, torch.Tensor | None] = dict.fromkeys(layers)
        return self._decode_eager(input_ids, positions, row_index, taps), taps

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, row_index: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] int64; row_index [R] int64 -> logits [R, V] in the model's dtype."""
        if not self.compiled:
            return self._fn(input_ids, positions, row_index)
        # Two graphs only: T = 1 (R = 1), and T >= 2 with R >= 2 (sizes 0 and 1 would each get a graph
        # of their own): pad R with copies of a row and drop them after.
        rows = row_index.shape[0]
        want = 1 if input_ids.shape[0] == 1 else 2
        if rows < want:
            pad = torch.zeros(want - rows, dtype=row_index.dtype, device=row_index.device)
            row_index = torch.cat([row_index, pad])
        key = input_ids.shape[0] == 1
        t0 = time.perf_counter() if key not in self._seen else None
        _raise_recompile_limits()  # each call: torch's disable_cache_limit() in another thread may have restored 8
        out = self._fn(input_ids, positions, row_index)
        if t0 is not None:
            self._seen.add(key)
            self.compile_s += time.perf_counter() - t0
        return out[:rows]
