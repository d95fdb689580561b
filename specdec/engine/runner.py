"""The model runner: one forward over a flat, ragged batch of many sessions' new tokens.

The runner knows nothing of sessions or sampling: it takes feeds (a slot, how many tokens it already
caches, the new tokens, how many trailing logits rows are wanted), runs the decoder once over all of
them through the ragged attention of specdec.engine.attention (a feed may end in a token tree's nodes,
each attending to its prefix and its ancestors: Feed.tree), and applies the LM head only to the
rows someone needs. How the forward runs (eager, compiled, or replayed from a CUDA graph) is the step
program's business (specdec.engine.step); what it computes is the same in every mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.engine import triton_attention
from specdec.engine.attention import active, build_layout, row_attention_applies, split_flat, use_step_attention
from specdec.engine.config import StepConfig
from specdec.engine.kv_cache import SlotKVCache
from specdec.engine.longs import longs
from specdec.engine.step import StepProgram, resolve_mode


@dataclass
class Feed:
    slot: int
    cached: int  # tokens already in the slot (the position of the first new token)
    tokens: list[int]  # new tokens, in order
    num_logits: int  # logits wanted for the last num_logits new tokens (0..len(tokens))
    tree: list[int] | None = None  # token trees: parents (-1 = root) of the nodes the tokens end with; None = a chain
    taps: tuple[int, ...] | None = None  # decoder layers whose outputs this feed wants (ids, in the order wanted)
    # Set by the forward when taps are asked: [len(tokens), len(taps) * hidden] bfloat16, each token's row the
    # taps' outputs concatenated in taps' order (specdec.engine.eagle3_features: the head's fc input)
    features: torch.Tensor | None = None


class UnsupportedModel(ValueError):
    """A model whose forward the ragged batch cannot reproduce exactly."""


def check_supported(model) -> None:
    c = model.config
    for attr in ("final_logit_softcapping", "logit_scale", "attn_logit_softcapping"):
        if getattr(c, attr, None):
            raise UnsupportedModel(f"{type(model).__name__}: {attr} is not supported by the batching engine")
    if getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True):
        window = c.sliding_window
        if window < getattr(c, "max_position_embeddings", 0):
            raise UnsupportedModel(f"{type(model).__name__}: sliding-window attention ({window}) is not supported")


def use_exact_float32_matmuls() -> None:
    """float32 on a GPU means IEEE float32: no TF32 in matrix products (PyTorch's default today, set
    here so that nothing else in the process can change it). TF32 rounds the inputs of a product to a
    10-bit mantissa, enough to flip near-tie argmaxes between a (K + 1)-token verify forward and the
    1-token forward of plain decoding. bfloat16 / float16 models are unaffected."""
    torch.set_float32_matmul_precision("highest")


class ModelRunner:
    def __init__(self, model, cache: SlotKVCache, step: StepConfig = StepConfig()) -> None:
        check_supported(model)
        use_step_attention(model)
        self.model = model
        self.cache = cache
        self.device = cache.geometry.device
        self.mode = resolve_mode(step.mode, self.device)
        self.program = StepProgram(model, kind=self.mode, use_skinny_gemm=step.skinny_gemm,
                                   fused_ops=step.fused_ops)
        # Few-token feeds attend on the row kernel (not the eager mode: transformers' path as it comes).
        self.row_attention = self.mode in ("packed", "compile") and row_attention_applies(cache, step.row_attention) is None
        self.head = self.program.head
        self.vocab_size = int(model.config.vocab_size if not self.program.plain_head else self.head.weight.shape[0])
        if self.device.type == "cuda":
            use_exact_float32_matmuls()
        self.graphs = None
        if self.mode == "cuda-graphs":
            from specdec.engine.cuda_graphs import CudaGraphStep

            kernel = step.fused_ops and triton_attention.available(self.device, cache.geometry.head_dim) is None
            self.graphs = CudaGraphStep(self.program.decoder, cache, step.capture_sessions, step.capture_tokens,
                                        step.max_graphs, max_capture_tokens=step.max_capture_tokens, kernel=kernel)

    @property
    def compile_s(self) -> float:
        """Seconds spent compiling or capturing so far."""
        return self.program.compile_s + (self.graphs.capture_s if self.graphs is not None else 0.0)

    def forward(self, feeds: list[Feed]) -> list[torch.Tensor]:
        """One forward over every feed; returns each feed's logits [num_logits, V] in float32. On a GPU
        this returns before the kernels have run; forward_checked synchronises."""
        return split_flat(self._forward(feeds), [f.num_logits for f in feeds])

    def forward_checked(self, feeds: list[Feed]) -> tuple[list[torch.Tensor], list[bool]]:
        """forward(), and for each feed whether all its logits are finite: one check for the whole step,
        which is also the step's one host synchronisation on a GPU (kernels run asynchronously there),
        so the step's wall time is its real compute time and no later check needs a sync of its own."""
        logits = self._forward(feeds)
        sizes = [f.num_logits for f in feeds]
        finite_rows = _finite_rows(logits)
        finite, start = [], 0
        for n in sizes:
            finite.append(all(finite_rows[start : start + n]))
            start += n
        return split_flat(logits, sizes), finite

    @torch.inference_mode()
    def _forward(self, feeds: list[Feed]) -> torch.Tensor:
        """The logits of every feed's wanted rows, in feed order: [sum of num_logits, V], float32."""
        layers = sorted({i for f in feeds if f.taps for i in f.taps})  # the union of the feeds' taps
        try:
            bucket = self.graphs.bucket(feeds) if self.graphs is not None else None
            if bucket is not None:  # (a tapping step replays a graph that copies its taps out too)
                return self._captured(feeds, bucket, layers)
            ids: list[int] = []
            rows: list[int] = []
            for f in feeds:
                start, n = len(ids), len(f.tokens)
                ids.extend(f.tokens)
                rows.extend(range(start + n - f.num_logits, start + n))
            layout = build_layout(self.cache, [(f.slot, f.cached, len(f.tokens)) for f in feeds], self.device,
                                  extra=(ids, rows), trees=[f.tree for f in feeds], row_attention=self.row_attention)
            input_ids, row_index = layout.extra
            with active(layout):
                if not layers:
                    return self.program(input_ids, layout.positions, row_index).float()  # [R, V]
                logits, taps = self.program.tapped(input_ids, layout.positions, row_index, layers)
            _hand_features(feeds, taps)
            return logits.float()
        except BaseException:
            for f in feeds:  # what this step wrote may be incomplete: never read it unmasked
                self.cache.initialized[f.slot] = min(self.cache.initialized[f.slot], f.cached)
            raise

    def _captured(self, feeds: list[Feed], bucket, layers: list[int]) -> torch.Tensor:
        taps = dict.fromkeys(layers) if layers else None
        hidden = self.graphs.run(feeds, bucket, taps)  # [sum of new tokens, H]
        if taps:
            _hand_features(feeds, taps)
        rows, start = [], 0
        for f in feeds:
            rows.extend(range(start + len(f.tokens) - f.num_logits, start + len(f.tokens)))
            start += len(f.tokens)
        index = longs(rows).to(self.device, non_blocking=True)
        return self.head(hidden[index]).float()


def _finite_rows(logits: torch.Tensor) -> list[bool]:
    """Whether each row of logits is all finite. On a CPU through numpy: PyTorch's isfinite(x).all(dim=-1) takes
    ~170 us for one 49,152-wide row on this project's CPU and ~700 us for six, numpy ~14 and ~75 us."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return np.isfinite(logits.numpy()).all(axis=-1).tolist()
    return torch.isfinite(logits).all(dim=-1).tolist()


def _hand_features(feeds: list[Feed], taps: dict[int, torch.Tensor]) -> None:
    """Each tapping feed's rows of the step's taps [T, H], its layers concatenated in its order, in bfloat16."""
    start = 0
    for f in feeds:
        n = len(f.tokens)
        if f.taps:
            f.features = torch.cat([taps[i][start : start + n] for i in f.taps], dim=-1).to(torch.bfloat16)
        start += n
