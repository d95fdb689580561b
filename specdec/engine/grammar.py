"""Structured output in the draft tier: the grammar masks the draft's q, so it proposes only tokens the
grammar allows and the target accepts more of them.

The coordinator holds each session's grammar and masks the target's p (coordinator.constraint); it sends
the grammar's text (llguidance's) with every Propose. Here a grammar is compiled once per text (an LRU of
GrammarCache.size) and each proposal gets a copy advanced through the session's output so far (its
tokens after the prompt: ~0.1 ms for a hundred tokens), then through each token it draws. Nothing is
kept between requests, so eviction, rollback and replicas need nothing. The draft's q is the draft's to
choose: a masked q changes which drafts are proposed, never the output's law (the target verifies).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import llguidance
import numpy as np
import torch


class GrammarCache:
    def __init__(self, tokenizer: Callable[[], object], vocab_size: int, eos_token_ids: list[int], size: int = 64) -> None:
        """tokenizer: loads the model's (Hugging Face) tokenizer, called at the first grammar only and let go
        once llguidance has its own (a tier that never sees a grammar holds none: ~45 MiB)."""
        self._load, self.vocab_size, self._eos, self.size = tokenizer, vocab_size, eos_token_ids, size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def _fresh(self, grammar: str) -> llguidance.LLMatcher:
        with self._lock:
            if self._tokenizer is None:  # ~0.5 s, once per tier
                from llguidance.hf import from_tokenizer  # imports transformers (~20 MiB): only where a grammar arrives

                self._tokenizer = from_tokenizer(self._load(), n_vocab=self.vocab_size,
                                                               eos_token=self._eos[0] if self._eos else None)
            matcher = self._compiled.get(grammar)
            if matcher is None:
                matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
                self._compiled[grammar] = matcher
                if len(self._compiled) > self.size:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(grammar)
            return matcher

    def check(self, grammar: str) -> str:
        """'' if the grammar compiles, else the engine's message."""
        matcher = self._fresh(grammar)
        return matcher.get_error() if matcher.is_error() else ""

    def matcher(self, grammar: str, output: list[int]) -> llguidance.LLMatcher | None:
        """A matcher of `grammar` that has read `output`; None if the grammar or the output is refused
        (then the draft proposes unmasked, which is still exact)."""
        fresh = self._fresh(grammar)
        if fresh.is_error():
            return None
        m = fresh.deep_copy()
        return m if m.consume_tokens(output) else None


def allowed_row(matcher: llguidance.LLMatcher, vocab_size: int) -> torch.Tensor | None:
    """[V] bool: the tokens the grammar allows next (None if it allows none, e.g. after an error)."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    bits = bits[:vocab_size].view(np.bool_)
    if not bits.any():
        return None
    row = np.zeros(vocab_size, dtype=np.bool_)
    row[: bits.shape[0]] = bits
    return torch.from_numpy(row)
