"""The draft's autoregressive steps as one chain on the device: a Propose costs one host round trip.

Proposing K tokens takes K forwards, each feeding the token the last one drew. Step by step, every
forward goes back through the engine's loop (plan, feeds built on the host, logits copied back, the
draw, the next feed): K host round trips and, on a GPU, K synchronisations. Once a batch of proposals
has drawn d_1 (the step that fed their new committed tokens), the draft chain runs their remaining
steps back to back: the token drawn on the device is the next step's input on the device, the draw is
specdec.engine.draft_sampler's (keyed by seed and position, the same numbers as the step-by-step
path), and the tokens and q rows come back in one copy at the end. With CUDA graphs the whole chain
(decoder, LM head and draw, for every step) is one captured graph per bucket
(specdec.engine.cuda_graphs.CudaGraphStep.chain); otherwise each step's layout is built on the host
without waiting for the device (it depends only on lengths, not on the tokens).

Sessions in a chain all take the same number of steps (the engine groups them) and step together: a
request that arrives meanwhile waits at most one chain, as in vLLM's draft proposer. Requests whose
logits the penalties or a logit bias adjust (the counts change with every draw) run step by step.

The target runs on the same way (specdec.engine.verify: a lone greedy session's run-on tokens): there each
draw is the target's own greedy token, so its sampler (CheckedArgmax) is the argmax the step-by-step verdict
takes, and it also checks every row it draws from is finite, as a step does, where a draft's need not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.engine.attention import active, build_layout
from specdec.engine.draft_sampler import DraftSampler
from specdec.engine.longs import longs
from specdec.math.argmax import argmax


@dataclass
class ChainFeed:
    slot: int
    cached: int  # tokens in the slot before the chain (the first token's position)
    first: int  # the token the chain feeds first (d_1)


@dataclass
class ChainOutput:
    tokens: list[list[int]]  # per session: the `steps` tokens drawn (d_2..d_{steps+1})
    q_ids: list[list[torch.Tensor]]  # per sampled session (sampler order), per step: q's token ids [n] (host)
    q_probs: list[list[torch.Tensor]]  # ...and their probabilities [n], 0 past the row's truncation


@torch.inference_mode()
def run_chain(runner, feeds: list[ChainFeed], steps: int, sampler: DraftSampler) -> ChainOutput:
    """`steps` forwards of every feed, each feeding the token the last drew; the slots then hold
    cached + steps tokens (first and the first steps - 1 draws)."""
    graphs = runner.graphs
    try:
        if graphs is not None and sampler.capturable and graphs.chain_bucket(feeds, steps) is not None:
            tokens, q_ids, q_probs = graphs.chain(feeds, steps, sampler, runner.head)
        else:
            tokens, q_ids, q_probs = _device_loop(runner, feeds, steps, sampler)
    except BaseException:
        for f in feeds:  # what the chain wrote may be incomplete: never read it unmasked
            runner.cache.initialized[f.slot] = min(runner.cache.initialized[f.slot], f.cached)
        raise
    tokens = tokens.cpu().tolist()  # [B, steps]: the chain's one copy back (with q's, below)
    if q_ids is None:
        return ChainOutput(tokens, [], [])
    ids, probs = q_ids.cpu(), q_probs.cpu()  # [steps, S, n]
    return ChainOutput(tokens, [list(ids[:, s]) for s in range(ids.shape[1])],
                       [list(probs[:, s]) for s in range(probs.shape[1])])


def _device_loop(runner, feeds: list[ChainFeed], steps: int, sampler: DraftSampler):
    """The chain through the step program, one forward per step, nothing waiting on the device."""
    device = runner.device
    token = longs([f.first for f in feeds], device)  # [B]
    rows = torch.arange(len(feeds), device=device)
    drawn, q_ids, q_probs = [], [], []
    for j in range(steps):
        layout = build_layout(runner.cache, [(f.slot, f.cached + j, 1) for f in feeds], device,
                              row_attention=runner.row_attention)
        with active(layout):
            logits = runner.program(token, layout.positions, rows).float()  # [B, V]
        token, ids, probs = sampler(logits, layout.positions + 1)  # each draw lands one past its input
        drawn.append(token)
        if ids is not None:
            q_ids.append(ids)
            q_probs.append(probs)
    tokens = torch.stack(drawn, dim=1)  # [B, steps]
    if not q_ids:
        return tokens, None, None
    return tokens, torch.stack(q_ids), torch.stack(q_probs)  # [steps, S, n]


class CheckedArgmax:
    """A chain's sampler for the target's greedy rows: each draw the argmax of its row (specdec.math.argmax, as
    the greedy verdict takes it), and `finite` (per row) whether every row it drew from was finite. Captured
    into a chain's graph like a greedy DraftSampler; the graph's copy shares its flags with the caller's."""

    capturable = True

    def __init__(self, rows: int, device) -> None:
        self.signature = ("checked-argmax", rows)
        self._cpu = torch.device(device).type == "cpu"
        self.finite = np.ones(rows, dtype=bool) if self._cpu else torch.ones(rows, dtype=torch.bool, device=device)

    def load(self, other: "CheckedArgmax") -> None:
        """A captured graph's sampler taking a new chain: its flags reset, and the caller reads them."""
        self.finite.fill(True) if self._cpu else self.finite.fill_(True)
        other.finite = self.finite

    def __call__(self, logits: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if self._cpu and logits.dtype == torch.float32:  # numpy's check: ~14 us a 49,152-wide row, torch's ~170
            self.finite &= np.isfinite(logits.numpy()).all(axis=-1)
        else:
            self.finite.logical_and_(torch.isfinite(logits).all(dim=-1))
        return argmax(logits), None, None

    def all_finite(self) -> list[bool]:
        return self.finite.tolist()
