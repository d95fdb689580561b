"""Logits processing and sampling shared by the draft and target engines.

process_logits turns logits into the distributions p (target) and q (draft) in vLLM's order: logit_bias,
the penalties (specdec.math.penalties; they need TokenCounts), then for sampling temperature, min_p,
top-k and top-p; greedy rows are one-hot on the argmax of the biased, penalised logits. The target and the
draft apply the same processing, each at its own positions. truncate_top_n is how q is cut for the wire
(DESIGN.md, "What q is on the wire").
"""

from __future__ import annotations

import math

import torch

from specdec.math.argmax import argmax
from specdec.math.params import SamplingParams
from specdec.math.penalties import TokenCounts, apply_penalties


def process_logits(logits: torch.Tensor, params: SamplingParams, counts: TokenCounts | None = None) -> torch.Tensor:
    """Logits -> probabilities: logit_bias and penalties (adjust_logits_rows), then temperature, min_p,
    top-k, top-p (Hugging Face's tie rules for top-k / top-p). Greedy gives one-hot rows on the argmax
    (first index on ties, like torch.argmax).

    logits: [N, V]; counts: the rows' token counts, needed when params.penalized
    -> returns float32 [N, V], each row summing to 1.
    """
    return _shape(adjust_logits_rows(logits, [params] * logits.shape[0], counts), params)


def adjust_logits_rows(logits: torch.Tensor, row_params: list[SamplingParams],
                       counts: TokenCounts | None = None) -> torch.Tensor:
    """The argmax-changing part, each row with its own parameters: logit_bias added, then the penalties
    (rows of `counts`; required for every penalised row). logits: [N, V] -> float32 [N, V] (a copy when
    anything changes; never modifies `logits`)."""
    x = logits.float()
    if not any(p.adjusts_logits for p in row_params):
        return x
    x = x.clone() if x is logits else x
    biased: dict[tuple, list[int]] = {}
    for i, p in enumerate(row_params):
        if p.logit_bias:
            biased.setdefault(p.logit_bias, []).append(i)
    for bias, rows in biased.items():
        ids = torch.tensor([t for t, _ in bias], device=x.device)
        vals = torch.tensor([b for _, b in bias], device=x.device)
        index = torch.tensor(rows, device=x.device)
        x[index[:, None], ids[None, :]] += vals
    penalized = [i for i, p in enumerate(row_params) if p.penalized]
    if penalized:
        if counts is None:
            raise ValueError("penalties need the token counts of their rows")
        have = set(counts.rows.tolist())
        missing = [i for i in penalized if i not in have]
        if missing:
            raise ValueError(f"penalised rows {missing[:4]} have no token counts")
        rows = counts.rows.tolist()
        params = [row_params[r] for r in rows]
        f = lambda name: torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=x.device)  # noqa: E731
        x[counts.rows] = apply_penalties(x[counts.rows], counts.output, counts.seen, f("presence_penalty"),
                                         f("frequency_penalty"), f("repetition_penalty"))
    return x


def _shape(x: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Adjusted logits [N, V] float32 -> probabilities: greedy one-hot, or temperature, min_p, top-k, top-p."""
    if params.greedy:
        return torch.nn.functional.one_hot(argmax(x), x.shape[-1]).float()
    x = x / params.temperature
    vocab = x.shape[-1]
    if params.min_p > 0:  # vLLM: after temperature, before top-k / top-p
        probs = x.softmax(dim=-1)
        x = x.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), -math.inf)
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


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def process_logits_rows(logits: torch.Tensor, row_params: list[SamplingParams],
                        counts: TokenCounts | None = None) -> torch.Tensor:
    """process_logits with each row's own parameters (a batch of sessions, or the positions of a verify):
    the adjustment per row, then rows that share parameters shaped together. logits: [N, V]; counts: the
    token counts of the penalised rows -> float32 [N, V]."""
    return shape_rows(adjust_logits_rows(logits, row_params, counts), row_params)


def shape_rows(x: torch.Tensor, row_params: list[SamplingParams]) -> torch.Tensor:
    """process_logits_rows' second half, on logits adjust_logits_rows already adjusted: greedy one-hot, or
    temperature, min_p, top-k, top-p, rows that share parameters together. x: [N, V] -> float32 [N, V]."""
    groups: dict[SamplingParams, list[int]] = {}
    for i, params in enumerate(row_params):
        groups.setdefault(params, []).append(i)
    if len(groups) == 1:
        return _shape(x, row_params[0])
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for params, rows in groups.items():
        index = torch.tensor(rows, device=x.device)
        out[index] = _shape(x[index], params)
    return out


def logprobs_rows(logits: torch.Tensor, row_params: list[SamplingParams],
                  counts: TokenCounts | None = None) -> torch.Tensor:
    """The log-probabilities reported for each row (vLLM's "processed" logprobs): of the distribution the
    row samples from (log p, -inf outside top-k / top-p / min_p); for greedy rows, which sample nothing, of
    the softmax of the biased, penalised logits (no temperature), whose argmax greedy takes.
    logits: [N, V] -> float32 [N, V]."""
    out = process_logits_rows(logits, row_params, counts).log()
    greedy = [i for i, p in enumerate(row_params) if p.greedy]
    if greedy:
        index = torch.tensor(greedy, device=logits.device)
        x = adjust_logits_rows(logits[index], [row_params[i] for i in greedy],
                               _select(counts, greedy) if counts is not None else None)
        out[index] = x.log_softmax(dim=-1)
    return out


def _select(counts: TokenCounts, rows: list[int]) -> TokenCounts | None:
    """The counts of `rows`, renumbered 0..len(rows)-1 in that order."""
    where = {r: j for j, r in enumerate(rows)}
    keep = [k for k, r in enumerate(counts.rows.tolist()) if r in where]
    if not keep:
        return None
    index = torch.tensor(keep, device=counts.rows.device)
    renumbered = torch.tensor([where[int(r)] for r in counts.rows[index].tolist()], device=counts.rows.device)
    return TokenCounts(renumbered, counts.output[index], counts.seen[index])


def top_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, top_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chosen tokens' log-probabilities and each row's top_n alternatives, most likely first.

    logprobs: [N, V]; tokens: [N] int64 -> (chosen [N] float32, top_ids [N, n] int64, top_vals [N, n] float32)."""
    chosen = logprobs.gather(-1, tokens[:, None].to(logprobs.device))[:, 0]
    n = min(top_n, logprobs.shape[-1])
    vals, ids = torch.topk(logprobs, n, dim=-1)
    return chosen, ids, vals
