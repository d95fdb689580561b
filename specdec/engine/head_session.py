"""One session of a feature draft (specdec.engine.head_engine): its committed tokens, the target's rows for its
positions, and the head layer's keys and values, of which the first `exact` entries were computed from those rows.

Entry i pairs token x_{i+1} with fc(row i); entries past `exact` (a proposal's drafts) pair a draft with the head's
own output and are dropped once the proposal is answered. Rows are facts about committed positions: new ones may
only extend them (a gap is the caller's to fill), and rows written again from a position invalidate the entries
from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.core.prefix import PrefixHashes
from specdec.engine.eagle3 import HeadCache

FEATURE_DTYPE = torch.bfloat16  # the rows as the wire carries them


@dataclass(eq=False)
class HeadSession:
    session_id: str
    tokens: list[int] = field(default_factory=list)
    hashes: PrefixHashes = field(default_factory=PrefixHashes)
    features: torch.Tensor | None = None  # [capacity, W]: rows 0 .. num_features - 1 are the target's
    num_features: int = 0
    cache: HeadCache = field(default_factory=HeadCache)
    exact: int = 0  # leading cache entries computed from the target's features
    last_used: float = 0.0

    def __len__(self) -> int:
        return len(self.tokens)

    def crop(self, length: int) -> None:
        del self.tokens[length:]
        self.hashes.crop(length)
        self.exact = min(self.exact, max(0, length - 1))
        self.cache.truncate(self.exact)

    def append(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        self.hashes.extend(tokens)

    def put_features(self, start: int, rows: torch.Tensor) -> None:
        """Rows for positions start .. start + len(rows) - 1 (start <= num_features: no gap)."""
        end = start + rows.shape[0]
        if self.features is None or self.features.shape[0] < end:
            grown = torch.empty(max(end, 2 * (0 if self.features is None else self.features.shape[0]), 64),
                                rows.shape[1], dtype=FEATURE_DTYPE)
            if self.features is not None:
                grown[: self.num_features] = self.features[: self.num_features]
            self.features = grown
        self.features[start:end] = rows
        self.num_features = end
        self.exact = min(self.exact, start)  # entries past start read rows that may be new
        self.cache.truncate(self.exact)

    @property
    def cached_bytes(self) -> int:
        c = self.cache
        kv = 0 if c.k is None else 2 * c.k.numel() * c.k.element_size()
        rows = 0 if self.features is None else self.num_features * self.features.shape[1] * 2
        return kv + rows
