"""The model runner: one forward over a flat, ragged batch of many sessions' new tokens.

The runner knows nothing of sessions or sampling: it takes feeds (a slot, how many tokens it already
caches, the new tokens, how many trailing logits rows are wanted), runs the decoder once over all of
them through the ragged attention of specdec.engine.attention, and applies the LM head only to the
rows someone needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.engine.attention import ATTENTION, build_layout
from specdec.engine.kv_cache import SlotKVCache


@dataclass
class Feed:
    slot: int
    cached: int  # tokens already in the slot (the position of the first new token)
    tokens: list[int]  # new tokens, in order
    num_logits: int  # logits wanted for the last num_logits new tokens (0..len(tokens))


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
    def __init__(self, model, cache: SlotKVCache) -> None:
        check_supported(model)
        model.set_attn_implementation(ATTENTION)
        self.model = model
        self.cache = cache
        self.device = cache.geometry.device
        self.decoder = model.base_model  # embeddings + layers + final norm
        self.head = model.get_output_embeddings()
        self.plain_head = isinstance(self.head, torch.nn.Linear)  # False for e.g. a quantized head
        self.vocab_size = int(model.config.vocab_size if not self.plain_head else self.head.weight.shape[0])
        if self.device.type == "cuda":
            use_exact_float32_matmuls()

    def forward(self, feeds: list[Feed]) -> list[torch.Tensor]:
        """One forward over every feed; returns each feed's logits [num_logits, V] in float32. On a GPU
        this returns before the kernels have run; forward_checked synchronises."""
        return list(torch.split(self._forward(feeds), [f.num_logits for f in feeds]))

    def forward_checked(self, feeds: list[Feed]) -> tuple[list[torch.Tensor], list[bool]]:
        """forward(), and for each feed whether all its logits are finite: one check for the whole step,
        which is also the step's one host synchronisation on a GPU (kernels run asynchronously there),
        so the step's wall time is its real compute time and no later check needs a sync of its own."""
        logits = self._forward(feeds)
        sizes = [f.num_logits for f in feeds]
        finite_rows = torch.isfinite(logits).all(dim=-1).tolist()
        finite, start = [], 0
        for n in sizes:
            finite.append(all(finite_rows[start : start + n]))
            start += n
        return list(torch.split(logits, sizes)), finite

    @torch.inference_mode()
    def _forward(self, feeds: list[Feed]) -> torch.Tensor:
        """The logits of every feed's wanted rows, in feed order: [sum of num_logits, V], float32."""
        ids: list[int] = []
        rows: list[int] = []
        for f in feeds:
            start, n = len(ids), len(f.tokens)
            ids.extend(f.tokens)
            rows.extend(range(start + n - f.num_logits, start + n))
        dev = self.device
        layout = build_layout(self.cache, [(f.slot, f.cached, len(f.tokens)) for f in feeds], dev, extra=(ids, rows))
        input_ids, row_index = layout.extra
        try:
            hidden = self.decoder(input_ids=input_ids[None], position_ids=layout.positions[None], use_cache=False,
                                  specdec_step=layout).last_hidden_state[0]  # [T, H]
        except BaseException:
            for f in feeds:  # what this step wrote may be incomplete: never read it unmasked
                self.cache.initialized[f.slot] = min(self.cache.initialized[f.slot], f.cached)
            raise
        return self._head(hidden[row_index]).float()  # [R, V]

    def _head(self, x: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, V]
        # On a CPU, x @ W.T for a few rows makes the BLAS pack all of W (a 49152 x 576 head: 24 ms for 2
        # rows on one core) while W @ x.T costs 6 ms: same product, same weights.
        if self.plain_head and self.device.type == "cpu" and self.head.bias is None and 1 < x.shape[0] <= 16:
            return (self.head.weight @ x.T).T
        return self.head(x)
