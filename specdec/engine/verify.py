"""The target's work: verify a session's K draft tokens, for every session of a step at once.

One forward scores [uncached committed tokens + d_1..d_K]; then all sessions whose verify completed in
the step are verified together: greedy sessions with verify_greedy_batched, the others with
rejection_sample_batched (specdec.math.rejection) over the batch's SpecDecodeMetadata (flattened drafts)
and its q (the sessions' DraftProbs, one-hot for deterministic drafts, made dense by the math module),
each with its own sampling parameters and seed. The session then keeps the committed prefix plus the accepted drafts: a crop,
which is a length change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from specdec.engine.draft_probs import DraftProbs
from specdec.engine.spec_metadata import SpecDecodeMetadata
from specdec.engine.work import Work
from specdec.math.params import SamplingParams
from specdec.math.rejection import rejection_sample_batched, round_randomness, verify_greedy_batched
from specdec.math.sampling import make_generator, process_logits_rows


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int  # n: leading drafts accepted
    next_token: int  # the bonus (n == K) or the recovered token (n < K)
    cached_len: int  # tokens the session now caches: committed + n
    compute_ms: float  # forward steps this request took part in
    batch_sessions: int  # sessions in the step that verified it
    batch_tokens: int  # tokens in that step
    step_ms: float  # that step's forward time
    queue_ms: float  # waiting, not computing
    reused: int = 0  # leading tokens of a fresh start taken from the prefix cache, not fed


@dataclass(eq=False)
class VerifyWork(Work):
    drafts: list[int] = field(default_factory=list)  # d_1..d_K
    q: DraftProbs | None = None  # q_1..q_K; None = one-hot on each d_i (greedy rounds, deterministic proposers)
    params: SamplingParams = SamplingParams()
    seed: int = 0  # this round's seed (accept/reject draws and the final sample)
    committed_len: int = 0  # prefix_len + new committed tokens

    kind: ClassVar[str] = "verify"

    @classmethod
    def create(cls, session_id: str, prefix_len: int, prefix_hash: int, new_tokens: list[int], drafts: list[int],
               q: DraftProbs | None, params: SamplingParams, seed: int) -> "VerifyWork":
        return cls(session_id=session_id, prefix_len=prefix_len, prefix_hash=prefix_hash,
                   pending=list(new_tokens) + list(drafts), num_logits=len(drafts) + 1, drafts=list(drafts), q=q,
                   params=params, seed=seed, committed_len=prefix_len + len(new_tokens))

    @classmethod
    def finish_step(cls, works: list["VerifyWork"], logits: list[torch.Tensor], engine) -> None:
        greedy = [i for i, w in enumerate(works) if w.params.greedy and w.q is None]
        sampled = [i for i, w in enumerate(works) if not (w.params.greedy and w.q is None)]
        outcome: dict[int, tuple[int, int]] = {}
        for subset, verify in ((greedy, _verify_greedy), (sampled, _verify_sampled)):
            if subset:
                n, nxt = verify([works[i] for i in subset], [logits[i] for i in subset], engine.vocab_size)
                outcome.update(zip(subset, zip(n.tolist(), nxt.tolist())))
        for i, w in enumerate(works):
            n, nxt = outcome[i]
            keep = w.committed_len + n
            engine.sessions.crop(w.session, keep)  # the committed prefix plus the accepted drafts
            sessions, tokens, seconds = w.last_step
            w.result = VerifyResult(n, nxt, keep, w.compute_s * 1e3, sessions, tokens, seconds * 1e3, w.queue_ms(),
                                    w.reused)


def _verify_greedy(works, logits, vocab_size):
    rows = torch.cat(logits)  # [N + B, V]
    meta = SpecDecodeMetadata.build([w.drafts for w in works], rows.device)
    return verify_greedy_batched(rows, meta.draft_token_ids, meta.cu_num_draft_tokens)


def _verify_sampled(works, logits, vocab_size):
    rows = torch.cat(logits)  # [N + B, V]
    device = rows.device
    meta = SpecDecodeMetadata.build([w.drafts for w in works], device)
    p = process_logits_rows(rows, [w.params for w, k in zip(works, meta.num_draft_tokens) for _ in range(k + 1)])  # [N + B, V]
    q = DraftProbs.cat([w.q if w.q is not None else DraftProbs.one_hot(w.drafts) for w in works])
    generators = [make_generator(w.seed, device) for w in works]
    uniform, noise = round_randomness(generators, meta.num_draft_tokens, vocab_size, device)
    return rejection_sample_batched(p, q.dense(vocab_size, device), meta.draft_token_ids, meta.cu_num_draft_tokens,
                                    uniform, noise)
