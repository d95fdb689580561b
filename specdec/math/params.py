"""Sampling parameters: how next-token distributions are shaped (no torch needed).

Semantics and order follow vLLM's sampler (specdec.math.sampling applies them): logit_bias, then the
penalties (repetition, frequency, presence), then (sampling only) temperature, min_p, top-k, top-p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Temperatures below this are greedy (as in vLLM): logits / T would overflow float32 to inf / NaN.
GREEDY_TEMPERATURE = 1e-5
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)
MAX_REPETITION_PENALTY = 2.0  # repetition_penalty lies in (0, MAX_REPETITION_PENALTY] (vLLM's range)
MAX_LOGIT_BIAS = 100.0  # logit_bias values lie in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range)
MAX_LOGIT_BIAS_ENTRIES = 1024  # tokens one request may bias


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (or < GREEDY_TEMPERATURE) = greedy: p and q one-hot on their argmax
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter
    # Penalties over the tokens before each position (vLLM / OpenAI semantics; see specdec.math.penalties).
    presence_penalty: float = 0.0  # 0 = off; subtracted from the logit of every token generated at least once
    frequency_penalty: float = 0.0  # 0 = off; subtracted once per time a token was generated
    repetition_penalty: float = 1.0  # 1 = off; a token of the prompt or the output: logit / it if > 0, else * it
    min_p: float = 0.0  # 0 = off; drop tokens whose probability is below min_p x the most likely one's (sampling only)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) sorted by id, added to the raw logits

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """The penalties need the tokens before each position."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0

    @property
    def adjusts_logits(self) -> bool:
        """Something changes the logits before the argmax (so even greedy rows need it)."""
        return self.penalized or bool(self.logit_bias)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the bad field; logit_bias ids are checked against vocab_size when given."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        if not (math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        if not (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(self.logit_bias)}")
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids):
            raise ValueError("logit_bias: a token id appears twice")
        for token, bias in self.logit_bias:
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                raise ValueError(f"logit_bias: token id {token} is outside the vocabulary {bound}")
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias: the bias of token {token} must be in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {bias}")

    @staticmethod
    def bias_items(bias: dict[int, float] | None) -> tuple[tuple[int, float], ...]:
        """A {token id: bias} mapping in the hashable form logit_bias takes."""
        return tuple(sorted((int(t), float(b)) for t, b in (bias or {}).items()))
