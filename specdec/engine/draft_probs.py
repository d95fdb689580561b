"""DraftProbs: the draft distributions q of one proposal, the one form q has from the draft engine that
samples from it to the target's sampler that verifies against it.

A proposal's q rows are sparse (each is the truncated q the draft sampled from: DESIGN.md, "What q is on
the wire"), so they are kept flat with row offsets, as CSR: row r puts probability probs[j] on token_ids[j]
for j in row_offsets[r]:row_offsets[r + 1]. A chain of K drafts has K rows (q_1..q_K); nothing here
assumes a chain, so a token tree can carry one row per node. specdec.serving.draft_probs converts it to and
from the wire (validating what arrives); specdec.math.rejection.dense_q_rows makes it dense for the sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.math.rejection import dense_q_rows


@dataclass(frozen=True)
class DraftProbs:
    token_ids: torch.Tensor  # [E] int64, on the host: every row's token ids, row after row
    probs: torch.Tensor  # [E] float32, on the host: their probabilities; each row sums to 1
    row_offsets: torch.Tensor  # [R + 1] int64, on the host: 0, then each row's end

    @property
    def num_rows(self) -> int:
        return self.row_offsets.shape[0] - 1

    def row(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row r as (token_ids [n], probs [n])."""
        a, b = int(self.row_offsets[r]), int(self.row_offsets[r + 1])
        return self.token_ids[a:b], self.probs[a:b]

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> "DraftProbs":
        """From per-row (token_ids [n_r], probs [n_r]) pairs, in row order."""
        counts = [len(ids) for ids, _ in rows]
        if not rows:
            return cls.empty()
        return cls(torch.cat([ids.long() for ids, _ in rows]), torch.cat([p.float() for _, p in rows]),
                   torch.tensor([0] + counts, dtype=torch.long).cumsum(0))

    @classmethod
    def one_hot(cls, tokens: Sequence[int]) -> "DraftProbs":
        """q one-hot on each token: a deterministic proposal (prompt lookup, suffix) or a greedy draft."""
        n = len(tokens)
        return cls(torch.tensor(list(tokens), dtype=torch.long), torch.ones(n), torch.arange(n + 1, dtype=torch.long))

    @classmethod
    def empty(cls) -> "DraftProbs":
        return cls(torch.zeros(0, dtype=torch.long), torch.zeros(0), torch.zeros(1, dtype=torch.long))

    @classmethod
    def cat(cls, parts: Sequence["DraftProbs"]) -> "DraftProbs":
        """The rows of every part, in order (a verify batch's q, session after session)."""
        if not parts:
            return cls.empty()
        ends = [p.row_offsets[1:] for p in parts]
        shift = 0
        shifted = []
        for p, e in zip(parts, ends):
            shifted.append(e + shift)
            shift += int(p.row_offsets[-1])
        return cls(torch.cat([p.token_ids for p in parts]), torch.cat([p.probs for p in parts]),
                   torch.cat([torch.zeros(1, dtype=torch.long), *shifted]))

    def dense(self, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """q as [R, V] on `device`."""
        return dense_q_rows(self.token_ids, self.probs, self.row_offsets, vocab_size, device)
