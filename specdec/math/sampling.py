"""Logits processing and sampling shared by the draft and target engines.

process_logits turns logits into the distributions p (target) and q (draft) under temperature, top-k
and top-p; truncate_top_n is how q is cut for the wire (DESIGN.md, "What q is on the wire").
"""

from __future__ import annotations

import math

import torch

from specdec.math.params import SamplingParams

def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits -> probabilities under temperature, then top-k, then top-p (Hugging Face's order and
    tie rules). Greedy gives one-hot rows on the argmax (first index on ties, like torch.argmax).

    logits: [N, V] -> returns float32 [N, V], each row summing to 1.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    x = logits / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # [N, 1]
        x = x.masked_fill(x < kth, -math.inf)
    if params.top_p < 1.0:
        x = x.masked_fill(_top_p_remove(x, params.top_p), -math.inf)
    return x.softmax(dim=-1)


TOP_P_CANDIDATES = 1024  # the nucleus is searched among this many most likely tokens first


def _top_p_remove(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask [N, V] of tokens outside the nucleus: a token is kept iff the probability of the tokens
    ranked strictly above it is < top_p (Hugging Face's rule: drop it if the cumulative mass up to and
    including it, in ascending order, is <= 1 - top_p). The most likely token is always kept.

    Sorting all V logits per row costs ~1 ms on a CPU; the nucleus almost always lies within the top
    TOP_P_CANDIDATES, so those are sorted first and the full sort is the fallback."""
    probs = x.softmax(dim=-1)
    vocab = x.shape[-1]
    m = min(TOP_P_CANDIDATES, vocab)
    while True:
        top_probs, top_idx = torch.topk(probs, m, dim=-1)  # [N, m], descending
        if m == vocab or bool((top_probs.sum(dim=-1) >= top_p).all()):
            break
        m = vocab  # some row's nucleus is wider than the candidates: sort everything
    above = top_probs.cumsum(dim=-1) - top_probs  # mass ranked strictly above each candidate
    remove = torch.ones_like(x, dtype=torch.bool)
    return remove.scatter(-1, top_idx, above >= top_p)


def truncate_top_n(probs: torch.Tensor, top_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the top_n most likely tokens of one distribution, drop zeros, renormalise.

    probs: [V] -> (token_ids [n] int64, probs [n] float32 summing to 1), most likely first.
    This truncated q is what the draft samples from and what it sends to the target.
    """
    n = min(top_n, probs.shape[-1])
    vals, ids = torch.topk(probs, n)
    return renormalise_top(vals, ids)


def renormalise_top(
    vals: torch.Tensor,  # [n] the n largest probabilities of a distribution, descending
    ids: torch.Tensor,  # [n] int64: their token ids
) -> tuple[torch.Tensor, torch.Tensor]:
    """truncate_top_n's second half, for a caller that ran the top-n of many rows at once (the draft
    engine: one topk for its whole batch): drop zeros, renormalise. -> (token_ids [n'], probs [n'] float32)."""
    keep = vals > 0
    vals, ids = vals[keep], ids[keep]
    vals = vals.float()
    return ids, vals / vals.sum()


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One draw from a distribution probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator)[0])


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def process_logits_rows(logits: torch.Tensor, row_params: list[SamplingParams]) -> torch.Tensor:
    """process_logits with each row's own parameters (a batch of sessions): rows that share
    parameters are processed together. logits: [N, V] -> float32 [N, V]."""
    groups: dict[SamplingParams, list[int]] = {}
    for i, params in enumerate(row_params):
        groups.setdefault(params, []).append(i)
    if len(groups) == 1:
        return process_logits(logits, row_params[0])
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for params, rows in groups.items():
        index = torch.tensor(rows, device=logits.device)
        out[index] = process_logits(logits[index], params)
    return out
