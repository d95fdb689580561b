"""How a batch of draft rows picks its next tokens, on the device.

Greedy rows take the argmax. Sampled rows are shaped by their own parameters (temperature, min_p,
top-k, top-p: specdec.math.sampling), truncated to their top_n most likely tokens (the q the wire
carries) and drawn with noise keyed by (the session's draft seed, the token's position, the token id)
(specdec.math.keyed_draws). Everything that depends on the batch (which rows are greedy, the groups of
rows that share parameters, the seeds) becomes a device tensor here, once, so a call is device work
only: the step-by-step path calls it once per step and copies its answer to the host, the draft chain
(specdec.engine.draft_chain) calls it K - 1 times on the device and copies once, and a CUDA graph can
capture it when no row uses top-p (whose nucleus search checks a bound on the host).
"""

from __future__ import annotations

import torch

from specdec.math.argmax import argmax
from specdec.math.keyed_draws import draw_top_n, split_seeds
from specdec.math.params import SamplingParams
from specdec.math.sampling import shape_rows


class DraftSampler:
    def __init__(self, params: list[SamplingParams], top_n: list[int], seeds: list[int], vocab_size: int,
                 device, columns: int | None = None) -> None:
        """One entry per row: its sampling parameters, q's truncation and the session's draft seed. columns: only
        the first this many columns of a row can have probability (a draft vocabulary of the lowest ids whose other
        logits are its floor: specdec.engine.draft_vocab_head), so the sampled rows are shaped and drawn over them
        alone, the same law at a third of the width; None: every column."""
        device = torch.device(device)
        self.columns = columns if columns is not None and columns < vocab_size else None
        vocab_size = self.columns or vocab_size
        self.num_rows = len(params)
        self.greedy = [i for i, p in enumerate(params) if p.greedy]
        self.sampled = [i for i, p in enumerate(params) if not p.greedy]
        self.all_greedy, self.all_sampled = not self.sampled, not self.greedy
        index = lambda rows: torch.tensor(rows, dtype=torch.long, device=device)
        groups: dict[SamplingParams, list[int]] = {}  # sampled rows sharing parameters, as positions in `sampled`
        for j, i in enumerate(self.sampled):
            groups.setdefault(params[i], []).append(j)
        # What a captured graph of this sampler depends on (the rest, seeds and truncations, it reads from tensors)
        self.signature = (self.num_rows, tuple(self.greedy), tuple((p, tuple(r)) for p, r in groups.items()))
        self.n_max = min(max((top_n[i] for i in self.sampled), default=1), vocab_size)
        self.signature += (self.n_max, self.columns)
        self.capturable = all(p.greedy or p.top_p >= 1.0 for p in params)
        if self.all_greedy:  # an argmax: no tensors to build (a draft step's chain builds one sampler a token)
            return
        self.sampled_index = index(self.sampled)
        self.groups = [(p, index(rows) if len(groups) > 1 else None) for p, rows in groups.items()]
        self.top_n = index([top_n[i] for i in self.sampled])
        self.seeds = split_seeds([seeds[i] for i in self.sampled], device)  # [S, 2]

    def load(self, other: "DraftSampler") -> None:
        """Take another sampler's seeds and truncations (same signature) into this one's tensors, which a
        captured graph reads."""
        if self.all_greedy:
            return
        self.seeds.copy_(other.seeds)
        self.top_n.copy_(other.top_n)

    def __call__(self, logits: torch.Tensor, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """logits [B, V] float32 (already biased / penalised where asked), positions [B] int64 (where each
        row's token goes) -> (tokens [B] int64, q ids [S, n], q probs [S, n]) for the S sampled rows in row
        order (None when every row is greedy; probs 0 past a row's truncation)."""
        if self.all_greedy:
            return argmax(logits), None, None
        if self.columns is not None:  # (the argmax of a greedy row among them is the same: the rest is the floor)
            logits = logits[:, : self.columns]
        x = logits.contiguous() if self.all_sampled else logits.index_select(0, self.sampled_index)  # [S, V]
        if len(self.groups) == 1:
            probs = shape_rows(x, [self.groups[0][0]] * x.shape[0])
        else:
            probs = torch.empty(x.shape, dtype=torch.float32, device=x.device)
            for params, rows in self.groups:
                probs[rows] = shape_rows(x.index_select(0, rows), [params] * rows.shape[0])
        where = positions if self.all_sampled else positions.index_select(0, self.sampled_index)
        drawn, q_ids, q_probs = draw_top_n(probs, self.top_n, self.n_max, self.seeds, where)
        if self.all_sampled:
            return drawn, q_ids, q_probs
        tokens = argmax(logits)  # the greedy rows' answer; the sampled rows' overwritten
        tokens.index_copy_(0, self.sampled_index, drawn)
        return tokens, q_ids, q_probs
