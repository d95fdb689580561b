"""The draft's work: propose K tokens for a session, the K steps batched with other sessions'.

The first step feeds the session's new committed tokens; each later step feeds the previous proposal.
After every step the works that got logits sample their next token together (specdec.engine.draft_sampler),
their logits first adjusted (logit_bias, and the penalties over the session's tokens so far: the
committed ones plus its proposals, specdec.math.penalties): greedy ones take the argmax, the others
sample from q, the distribution after their temperature / min_p / top-k / top-p truncated to the
draft_top_n most likely tokens and renormalised (DESIGN.md, "What q is on the wire"); a finished work's
q rows become its DraftProbs, the form q keeps up to the target's sampler. The draw for the token at
absolute position i is keyed by (the session's draft seed, i, the token) (specdec.math.keyed_draws), so a
proposal does not depend on how requests are split or batched, nor on whether it ran step by step or
as a draft chain: after d_1, the remaining K - 1 steps of works whose logits nothing adjusts run as one
chain on the device (specdec.engine.draft_chain; StepConfig.draft_chain).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from specdec.engine.draft_chain import ChainFeed, run_chain
from specdec.engine.draft_probs import DraftProbs
from specdec.engine.draft_sampler import DraftSampler
from specdec.engine.grammar import allowed_row
from specdec.engine.longs import longs
from specdec.engine.work import Work
from specdec.math.params import SamplingParams
from specdec.math.penalties import TokenCounts
from specdec.math.sampling import adjust_logits_rows


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
    step_id: int = 0  # the step batch_sessions and step_ms describe (Work.step_id)


@dataclass(eq=False)
class ProposeWork(Work):
    num_tokens: int = 1  # K
    params: SamplingParams = SamplingParams()
    seed: int = 0  # the session's base draft seed
    top_n: int = 64  # q truncation
    prompt_len: int = 0  # the session's prompt tokens: the penalties count the tokens after them as output
    grammar: str = ""  # structured output: the grammar (llguidance's text) that masks q (specdec.engine.grammar)
    matcher: object = None  # ...advanced through the session's output and this proposal's draws so far
    tokens: list[int] = field(default_factory=list)
    q_rows: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (token_ids [n], probs [n]) per draft
    features: torch.Tensor | None = None  # a feature draft's (specdec.engine.head_engine): the target's rows [n, W]...
    features_start: int = 0  # ...of positions features_start.. (a draft model ignores them)

    kind: ClassVar[str] = "propose"

    @classmethod
    def create(cls, session_id: str, prefix_len: int, prefix_hash: int, new_tokens: list[int], num_tokens: int,
               params: SamplingParams, seed: int, top_n: int, prompt_len: int = 0, grammar: str = "") -> "ProposeWork":
        return cls(session_id=session_id, prefix_len=prefix_len, prefix_hash=prefix_hash, pending=list(new_tokens),
                   num_logits=1, num_tokens=num_tokens, params=params, seed=seed, top_n=top_n, prompt_len=prompt_len,
                   grammar=grammar)

    @classmethod
    def finish_step(cls, works: list["ProposeWork"], logits: list[torch.Tensor], engine) -> None:
        rows = torch.cat(logits)  # [B, V]
        if any(w.params.adjusts_logits for w in works):
            counts = TokenCounts.cat([TokenCounts.at_positions(w.session.tokens, w.prompt_len, len(w.session), 1, i,
                                                               engine.vocab_size, rows.device)
                                      for i, w in enumerate(works) if w.params.penalized])
            rows = adjust_logits_rows(rows, [w.params for w in works], counts)  # [B, V] float32
        if any(w.grammar for w in works):
            rows = _mask_grammar(works, rows, engine)
        sampler = _sampler(works, engine, rows.device)
        positions = longs([len(w.session) for w in works], rows.device)  # where each draw lands
        tokens, q_ids, q_probs = sampler(rows, positions)
        tokens = tokens.tolist()
        if q_ids is not None:  # one copy to the host
            q_ids, q_probs = q_ids.cpu(), q_probs.cpu()
            for j, i in enumerate(sampler.sampled):
                works[i].q_rows.append(_q_row(q_ids[j], q_probs[j]))
        chain = engine.config.step.draft_chain
        for w, d in zip(works, tokens):
            w.tokens.append(d)
            if w.matcher is not None and not w.matcher.is_stopped() and not w.matcher.consume_token(d):
                w.matcher, w.grammar = None, ""  # (cannot happen for a masked draw) propose the rest unmasked
            left = w.num_tokens - len(w.tokens)
            if left and chain and not w.params.adjusts_logits and not w.grammar:
                w.chain_steps = left  # the engine runs the rest as one chain (run_chain)
            elif left:
                w.pending, w.num_logits = [d], 1  # feed it back for the next position
            else:
                w.finish(engine)

    @classmethod
    def run_chain(cls, works: list["ProposeWork"], engine) -> None:
        """The rest of the works' proposals as one draft chain (specdec.engine.draft_chain); they all have the
        same number of steps left. No engine lock held: the sessions' new tokens are appended by finish_chain."""
        sampler = _sampler(works, engine, engine.device)
        feeds = [ChainFeed(w.session.slot, len(w.session), w.tokens[-1]) for w in works]
        out = run_chain(engine.runner, feeds, works[0].chain_steps, sampler)
        for w, drawn in zip(works, out.tokens):
            w.tokens.extend(drawn)
        for i, ids, probs in zip(sampler.sampled, out.q_ids, out.q_probs):
            works[i].q_rows.extend(_q_row(a, b) for a, b in zip(ids, probs))

    @classmethod
    def finish_chain(cls, works: list["ProposeWork"], engine) -> None:
        """After run_chain, with the engine's lock: the sessions now hold every proposal but the last."""
        for w in works:
            engine.sessions.append(w.session, w.tokens[-w.chain_steps - 1 : -1])
            w.chain_steps = 0
            w.finish(engine)

    def finish(self, engine) -> None:
        sessions, _, seconds = self.last_step
        q = DraftProbs.from_rows(self.q_rows) if self.q_rows else None
        self.result = ProposeResult(self.tokens, q, len(self.session), self.compute_s * 1e3, sessions, seconds * 1e3,
                                    self.queue_ms(), self.reused, self.step_id)


def _mask_grammar(works: list[ProposeWork], rows: torch.Tensor, engine) -> torch.Tensor:
    """Each constrained work's row outside its grammar's allowed tokens set to -inf (q then has no mass there)."""
    rows = rows.float().clone() if rows.dtype != torch.float32 else rows
    for i, w in enumerate(works):
        if not w.grammar:
            continue
        if w.matcher is None:  # the first step: the session's output so far
            w.matcher = engine.grammars.matcher(w.grammar, w.session.tokens[w.prompt_len:])
            if w.matcher is None:
                w.grammar = ""
                continue
        allowed = allowed_row(w.matcher, engine.vocab_size)  # (a complete grammar allows only EOS)
        if allowed is not None:
            rows[i].masked_fill_(~allowed.to(rows.device), float("-inf"))
    return rows


def _sampler(works: list[ProposeWork], engine, device) -> DraftSampler:
    """The works' sampler; over a draft vocabulary's columns alone where no work's grammar may leave it (a grammar
    allowing only tokens outside keeps them, at the floor, as q's support)."""
    columns = None if any(w.grammar for w in works) else engine.draft_columns
    return DraftSampler([w.params for w in works], [w.top_n for w in works], [w.seed for w in works],
                        engine.vocab_size, device, columns)


def _q_row(ids: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One q row as DraftProbs keeps it: the truncation's tokens with non-zero probability."""
    keep = probs > 0
    return ids[keep], probs[keep]
