"""The step program: the one forward a tier runs every step, compiled where the device allows it.

A step is (input_ids [T], positions [T], row_index [R]) -> logits [R, V] over the active layout
(specdec.engine.attention.active): the decoder over every scheduled session's new tokens, then the LM
head on the rows someone needs. One program per tier, in one of four modes:

  eager        transformers' modules as they are: the reference, and the debugging path;
  packed       the Llama decoder as plain tensor code (specdec.engine.llama; other models: transformers'
               modules), with the LM head on a weight packed once for oneDNN (specdec.engine.packed): no
               compile time, a verify's small-row head product at ~1.0-1.6x one row instead of 2.4-4x,
               and in float32 the layers' linears on the library's own product, the fastest at 1-3 rows
               (in bfloat16 / float16 they are packed too: the CPU's bfloat16 matrix units, flat to 17 rows);
  compile      the same forward through torch.compile (inductor, frozen weights): norms, rotary and
               the MLP fuse, and every linear runs on weights packed once at start for the CPU's
               matrix library (oneDNN), which keeps a 2-17 row product near the cost of one row, where
               an eager float32 product with 2-3 rows takes 1.8-2.6x one row. The attention stays one
               opaque op (specdec::ragged_attention), so the step's layout never enters the graph and
               one dynamic-shape graph serves every T (plus one for T = 1, which the compiler
               specialises);
  cuda-graphs  decode and verify steps replayed from CUDA graphs captured per shape bucket
               (specdec.engine.cuda_graphs); other steps (prefill chunks) run eager.

`auto` picks AUTO_CPU on a CPU (measured by bench/step_cost.py) and cuda-graphs on CUDA. Every mode computes the same function; the
tests compare each against eager and against transformers' own forward, and bench/exactness.py counts
argmax flips between them per device and dtype.
"""

from __future__ import annotations

import logging
import time

import torch
import torch._dynamo.config
import torch._inductor.config

from specdec.engine.llama import LlamaDecoder
from specdec.engine.packed import can_pack, pack_head, pack_layers

log = logging.getLogger(__name__)

MODES = ("auto", "eager", "packed", "compile", "cuda-graphs")
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
    (tests, a self-draft beside its target) needs more than dynamo's default of 8 graphs per code object."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 512)


class TransformersDecoder:
    """transformers' own decoder modules (embeddings + layers + final norm), as a step's decoder."""

    def __init__(self, base_model) -> None:
        self.base_model = base_model

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T], [T] -> [T, H]
        return self.base_model(input_ids=input_ids[None], position_ids=positions[None],
                               use_cache=False).last_hidden_state[0]


def decoder_for(model, plain: bool = False):
    """The step's decoder: the plain-tensor Llama decoder where it runs this model exactly
    (specdec.engine.llama), else (or with plain=True, the eager mode's reference) transformers' modules."""
    if not plain and LlamaDecoder.unsupported(model) is None:
        return LlamaDecoder(model)
    return TransformersDecoder(model.base_model)


class StepProgram:
    """The decoder + LM head as one callable, eager or compiled."""

    def __init__(self, model, kind: str = "eager") -> None:
        """kind: eager | packed | compile | cuda-graphs (the steps a CUDA-graph tier does not replay run
        uncompiled, through the same decoder its graphs captured)."""
        if kind == "packed":
            pack_head(model)
            pack_layers(model)  # bfloat16 / float16 weights only
        compiled = kind == "compile"
        self.kind = kind
        self.decoder = decoder_for(model, plain=kind == "eager")  # (input_ids [T], positions [T]) -> [T, H]
        self.head = model.get_output_embeddings()
        self.device = next(model.parameters()).device
        self.plain_head = isinstance(self.head, torch.nn.Linear)  # False for e.g. a quantized head
        self.compiled = compiled
        self.compile_s = 0.0  # time spent compiling (the first call of each graph)
        if compiled:
            # Frozen weights are constants of the graph, so inductor packs each linear's weight once for
            # oneDNN. (Set process-wide: passed as a torch.compile option it does not reach the passes
            # that pack; a tier process compiles nothing else.)
            torch._inductor.config.freezing = True
            _raise_recompile_limits()
        self._fn = torch.compile(self._decode, dynamic=True, fullgraph=True) if compiled else self._decode_eager
        self._seen: set[bool] = set()  # which graphs (T == 1, T >= 2) have been compiled

    def _decode(self, input_ids: torch.Tensor, positions: torch.Tensor, row_index: torch.Tensor) -> torch.Tensor:
        return self.head(self.decoder(input_ids, positions)[row_index])  # [R, V]

    def _decode_eager(self, input_ids, positions, row_index) -> torch.Tensor:
        x = self.decoder(input_ids, positions)[row_index]
        # On a CPU, x @ W.T for a few rows makes the BLAS pack all of W (a 49152 x 576 head: 24 ms for 2
        # rows on one core) while W @ x.T costs 6 ms: same product, same weights.
        if self.plain_head and self.device.type == "cpu" and self.head.bias is None and 1 < x.shape[0] <= 16:
            return (self.head.weight @ x.T).T
        return self.head(x)

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
