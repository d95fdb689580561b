"""The draft's work: propose K tokens for a session, the K steps batched with other sessions'.

The first step feeds the session's new committed tokens; each later step feeds the previous proposal.
After every step the works that got logits sample their next token together, their logits first adjusted
(logit_bias, and the penalties over the session's tokens so far: the committed ones plus its proposals,
specdec.math.penalties): greedy ones take the argmax, the others sample from q, the distribution after
their temperature / min_p / top-k / top-p truncated
to the draft_top_n most likely tokens and renormalised (DESIGN.md, "What q is on the wire"); a finished
work's q rows become its DraftProbs, the form q keeps up to the target's sampler. The
draw for the token at absolute position i uses a generator seeded from (seed, i), so a proposal does
not depend on how requests are split or batched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from specdec.engine.draft_probs import DraftProbs
from specdec.engine.work import Work
from specdec.math.params import SamplingParams
from specdec.math.penalties import TokenCounts
from specdec.math.sampling import adjust_logits_rows, make_generator, renormalise_top, shape_rows
from specdec.math.seeds import DRAFT_STREAM, derive_seed


@dataclass(frozen=True)
class ProposeResult:
    tokens: list[int]  # d_1..d_K
    q: DraftProbs | None  # q_1..q_K; None for greedy (q one-hot on the drafts)
    cached_len: int  # committed length + K - 1 (the last proposal is not fed back)
    compute_ms: float
    batch_sessions: int  # sessions in the work's last step
    step_ms: float  # that step's forward time
    queue_ms: float  # waiting, not computing
    reused: int = 0  # leading tokens of a fresh start taken from the prefix cache, not fed


@dataclass(eq=False)
class ProposeWork(Work):
    num_tokens: int = 1  # K
    params: SamplingParams = SamplingParams()
    seed: int = 0  # the session's base draft seed
    top_n: int = 64  # q truncation
    prompt_len: int = 0  # the session's prompt tokens: the penalties count the tokens after them as output
    tokens: list[int] = field(default_factory=list)
    q_rows: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (token_ids [n], probs [n]) per draft

    kind: ClassVar[str] = "propose"

    @classmethod
    def create(cls, session_id: str, prefix_len: int, prefix_hash: int, new_tokens: list[int], num_tokens: int,
               params: SamplingParams, seed: int, top_n: int, prompt_len: int = 0) -> "ProposeWork":
        return cls(session_id=session_id, prefix_len=prefix_len, prefix_hash=prefix_hash, pending=list(new_tokens),
                   num_logits=1, num_tokens=num_tokens, params=params, seed=seed, top_n=top_n, prompt_len=prompt_len)

    @classmethod
    def finish_step(cls, works: list["ProposeWork"], logits: list[torch.Tensor], engine) -> None:
        rows = torch.cat(logits)  # [B, V]
        if any(w.params.adjusts_logits for w in works):
            counts = TokenCounts.cat([TokenCounts.at_positions(w.session.tokens, w.prompt_len, len(w.session), 1, i,
                                                               engine.vocab_size, rows.device)
                                      for i, w in enumerate(works) if w.params.penalized])
            rows = adjust_logits_rows(rows, [w.params for w in works], counts)  # [B, V] float32
        tokens = torch.empty(len(works), dtype=torch.long)
        greedy = [i for i, w in enumerate(works) if w.params.greedy]
        sampled = [i for i, w in enumerate(works) if not w.params.greedy]
        if greedy:
            tokens[greedy] = rows[greedy].argmax(dim=-1).cpu()
        if sampled:
            _sample(works, rows, sampled, tokens, engine)
        for w, d in zip(works, tokens.tolist()):
            w.tokens.append(d)
            if len(w.tokens) < w.num_tokens:
                w.pending, w.num_logits = [d], 1  # feed it back for the next position
            else:
                sessions, _, seconds = w.last_step
                q = DraftProbs.from_rows(w.q_rows) if w.q_rows else None
                w.result = ProposeResult(w.tokens, q, len(w.session), w.compute_s * 1e3, sessions, seconds * 1e3,
                                         w.queue_ms(), w.reused)


def _sample(works, rows, sampled, tokens, engine) -> None:
    """Draw d for each sampled work from its truncated q, recording q."""
    subset = [works[i] for i in sampled]
    probs = shape_rows(rows[sampled].float(), [w.params for w in subset])  # [S, V]
    top_n = min(max(w.top_n for w in subset), probs.shape[-1])
    vals, ids = torch.topk(probs, top_n, dim=-1)  # [S, n], most likely first
    # The draws below are per session and tiny (n <= top_n): on the host, in one copy, so a GPU tier
    # does not synchronise per session, and draft draws are the same whatever the device.
    vals, ids = vals.cpu(), ids.cpu()
    for j, (i, w) in enumerate(zip(sampled, subset)):
        n = min(w.top_n, top_n)
        t, q = renormalise_top(vals[j, :n], ids[j, :n])  # the truncated q this token is drawn from
        gen = make_generator(derive_seed(w.seed, len(w.session), DRAFT_STREAM))
        noise = torch.empty_like(q).exponential_(1, generator=gen)
        tokens[i] = int(t[(q / noise).argmax()])  # = torch.multinomial(q, 1, generator=gen)
        w.q_rows.append((t, q))
