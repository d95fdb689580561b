"""One generation: the speculative round loop.

Per round: a proposer offers up to K draft tokens (with q), the target verifies them in one forward
pass and returns (n_accepted, next_token); the coordinator commits d_1..d_n + next_token, truncated at
EOS, a stop string or the token budget, and streams them. The committed sequence lives here only;
each tier is told, per request, which prefix of it it already caches. Each tier is reached through the
session's TierSession (coordinator/tier_session.py), the same for draft and target: it routes the
session's calls to one replica, and handles lost sessions, retries and back-off, so this file holds only
the algorithm.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from coordinator.proposers.adaptive import AdaptiveConfig, TierLoad
from coordinator.proposers.lookup import LookupConfig
from coordinator.proposers.policy import ProposerPolicy
from coordinator.proposers.base import Proposal
from coordinator.proposers.draft_model import DraftModelProposer
from coordinator.proposers.lookup import PromptLookupProposer
from coordinator.proposers.names import DRAFT_MODEL, HYBRID, PROMPT_LOOKUP, SUFFIX
from coordinator.proposers.suffix import SuffixCache, SuffixConfig, SuffixProposer
from coordinator.stats import RoundStats
from coordinator.text import IncrementalDetokenizer, StopMatcher
from coordinator.tiers.session import DRAFT_RETRY, TARGET_RETRY, TierSession
from coordinator.tiers.client import TierClient, TierError
from specdec.core.prefix import PrefixHashes
from specdec.proto import common_pb2, generate_pb2, target_pb2
from specdec.math.params import SamplingParams
from specdec.math.seeds import DRAFT_STREAM, TARGET_STREAM, derive_seed

FinishReason = generate_pb2.FinishReason
UNFINISHED = FinishReason.FINISH_REASON_UNSPECIFIED


@dataclass(frozen=True)
class GenerationParams:
    """A validated request."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    seed: int
    num_speculative_tokens: int | None  # K; None = adaptive
    proposer: str = HYBRID  # DRAFT_MODEL | PROMPT_LOOKUP | SUFFIX | HYBRID
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass
class Limits:
    max_context: int  # the target's: generation ends here
    draft_max_context: int = 0  # the draft's: beyond it the draft model is not asked
    max_k: int = 16  # cap on K (server and tiers)
    overlap: bool = False  # draft round r+1 while the target verifies round r
    tier_retry_s: float = 30.0  # without a client deadline, how long to retry an unreachable target
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    lookup: LookupConfig = field(default_factory=LookupConfig)
    suffix: SuffixConfig = field(default_factory=SuffixConfig)
    target_load: TierLoad | None = None  # the target's batching, shared by the coordinator's sessions


class Generation:
    def __init__(self, params: GenerationParams, draft: TierClient | None, target: TierClient, tokenizer,
                 eos_token_ids: set[int], limits: Limits, deadline: float | None = None,
                 suffix_cache: SuffixCache | None = None,
                 tokenizer_fingerprint: str = "") -> None:
        """deadline: time.monotonic() by which the client must have its answer (None: no deadline).
        tokenizer_fingerprint: the coordinator's, sent to every replica that gets the session's full
        sequence (each refuses the session if its tokenizer differs).
        suffix_cache: the coordinator's tree of recent outputs, shared by its sessions (None: none)."""
        self.params = params
        self.deadline = deadline
        self.tokenizer = tokenizer
        self.eos = set() if params.ignore_eos else eos_token_ids
        self.limits = limits
        self.session_id = uuid.uuid4().hex
        self.stats = RoundStats()
        self._sampling = common_pb2.SamplingParams(
            temperature=params.sampling.temperature, top_k=params.sampling.top_k, top_p=params.sampling.top_p)
        # The session on each tier: routing to its replica, its cache cursor, retries and re-prefills.
        self.target = TierSession(target.session(self.session_id), dataclasses.replace(TARGET_RETRY, retry_s=limits.tier_retry_s),
                                  self.stats, tokenizer_fingerprint, self._time_left)
        # Prompt lookup is always ready: it is a proposer of the lookup/hybrid modes and the fallback
        # whenever the draft tier is unreachable.
        self.lookup = PromptLookupProposer(limits.lookup, params.prompt_ids)
        self.suffix_cache = suffix_cache
        self.suffix = (SuffixProposer(limits.suffix, suffix_cache) if params.proposer in (SUFFIX, HYBRID) else None)
        self.draft = None
        if draft is not None and params.proposer in (DRAFT_MODEL, HYBRID):
            self.draft = DraftModelProposer(
                TierSession(draft.session(self.session_id), DRAFT_RETRY, self.stats, tokenizer_fingerprint, self._time_left),
                self._sampling, derive_seed(params.seed, 0, DRAFT_STREAM))
        self._local = [x for x in (self.suffix, self.lookup) if x is not None and params.proposer in (x.source, HYBRID)]
        cfg = dataclasses.replace(limits.adaptive, max_k=min(limits.adaptive.max_k, limits.max_k))
        self.policy = ProposerPolicy(cfg, (SUFFIX, PROMPT_LOOKUP, DRAFT_MODEL), load=limits.target_load)
        # Sampling with a fixed K is reproducible (same seed, same output): then no timing and no other
        # session (the shared suffix tree) may sway the proposals. Adaptive K never was reproducible.
        self._reproducible = params.sampling.temperature > 0 and params.num_speculative_tokens is not None
        self._output: list[int] | None = None  # the generated tokens, once finished

    def _max_k(self, budget: int) -> int:
        k = self.params.num_speculative_tokens
        return min(budget, self.policy.config.max_k if k is None else k)

    async def _propose(self, committed: list[int], hashes: PrefixHashes, budget: int) -> tuple[Proposal, list[Proposal]]:
        """This round's proposal (the policy's pick among the sources), and the local sources' offers."""
        max_k = self._max_k(budget)
        draft_ok = (self.draft is not None and self.draft.available
                    and len(committed) + budget <= self.limits.draft_max_context)
        local = self._local if self._local or draft_ok else [self.lookup]  # draft mode, draft down: lookup
        shared = not self._reproducible
        offers = [x.propose(max_k, shared) for x in local] if max_k > 0 else []
        fixed = self.params.num_speculative_tokens is not None
        choice = self.policy.choose(offers, max_k, draft_ok, fixed, measured_costs=shared)
        # The draft model is down and backing off: the local proposers stand in.
        fallback = self.draft is not None and not self.draft.available
        if choice.source == DRAFT_MODEL and choice.k > 0:
            try:
                proposal = await self.draft.propose(committed, hashes, choice.k)
                self.stats.observe_rpc(proposal.wall_ms, proposal.compute_ms, proposal.queue_ms, is_draft=True)
                return proposal, offers
            except TierError:  # counted, and the draft left alone for a back-off, by its TierSession
                fallback = True  # the draft is down: the best local offer instead
                offers = offers or [self.lookup.propose(max_k)]
                choice = self.policy.choose(offers, max_k, False, fixed, measured_costs=shared)
        offer = next((o for o in offers if o.source == choice.source), None)
        if offer is None:
            return Proposal(choice.source, [], k=choice.k, fallback=fallback), offers
        return dataclasses.replace(offer, tokens=offer.tokens[: choice.k], probs=offer.probs[: choice.k], k=choice.k,
                                   fallback=fallback), offers

    async def run(self) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """Yield one chunk per round, then the result. The caller must call close() afterwards."""
        p = self.params
        t_start = time.perf_counter()
        first_token_at = None
        committed = list(p.prompt_ids)
        hashes = PrefixHashes(committed)
        detok = IncrementalDetokenizer(self.tokenizer, p.prompt_ids)
        stop = StopMatcher(list(p.stop))
        text, streamed = "", 0
        n_generated = 0
        finish = UNFINISHED
        pending: Proposal | None = None  # next round's drafts, pre-drafted during this round's verify
        if self.suffix is not None:
            await self.suffix.index_prompt(p.prompt_ids)

        while finish == UNFINISHED:
            self.stats.begin_round()
            remaining = p.max_new_tokens - n_generated
            room = self.limits.max_context - len(committed)
            if room <= 0:
                finish = FinishReason.FINISH_REASON_CONTEXT
                break
            # K larger than the budget is clamped: the round also yields one token of its own.
            budget = min(self.limits.max_k, remaining - 1, room - 1)
            offers: list[Proposal] = []
            if pending is not None:
                proposal, pending = pending, None
                self.stats.observe_overlapped(proposal.compute_ms)
            else:
                proposal, offers = await self._propose(committed, hashes, budget)
            drafts = proposal.tokens[: max(budget, 0)]
            verifying = self._verify(committed, hashes, drafts, proposal.q[: len(drafts)])
            speculating = False
            if self.limits.overlap and drafts and proposal.source == DRAFT_MODEL and self.draft.available:
                # Verify in a task of its own while the draft is asked for the next block.
                verify = asyncio.ensure_future(verifying)
                k_fixed = self.params.num_speculative_tokens
                k_next = min(self.policy.best_draft_k(self._max_k(budget)) if k_fixed is None else k_fixed,
                             remaining - len(drafts) - 2, room - len(drafts) - 2)
                if k_next > 0 and len(committed) + len(drafts) + k_next + 1 <= self.limits.draft_max_context:
                    speculating = await self.draft.speculate(committed, hashes, drafts, k_next)
                try:
                    verdict = await verify
                except BaseException:
                    verify.cancel()
                    raise
            else:
                verdict = await verifying
            n = verdict.num_accepted
            if speculating:
                pending = await self.draft.collect(n == len(drafts), verdict.next_token)
            new = drafts[:n] + [verdict.next_token]
            self.policy.observe(proposal, len(drafts), n, verdict.wall_ms)
            if p.sampling.temperature == 0:
                self.policy.observe_unchosen(offers, proposal.source if drafts else None, new)

            # Commit d_1..d_n + next_token, cut at EOS or the token budget, then at a stop string in the text.
            chunk: list[int] = []
            for tok in new:
                chunk.append(tok)
                if tok in self.eos:
                    finish = FinishReason.FINISH_REASON_EOS
                    break
                if n_generated + len(chunk) >= p.max_new_tokens:
                    finish = FinishReason.FINISH_REASON_LENGTH
                    break
            if stop.stops:  # token by token, to end at the first token whose text completes a stop string
                for i, tok in enumerate(chunk):
                    before = len(text)
                    text += detok.push(tok)
                    at = stop.find(text, before)
                    if at >= 0:
                        text = text[:at]
                        chunk = chunk[: i + 1]
                        finish = FinishReason.FINISH_REASON_STOP
                        break
            else:
                text += detok.push_many(chunk)
            committed.extend(chunk)
            n_generated += len(chunk)
            hashes.extend(chunk)
            self.lookup.commit(chunk)
            if self.suffix is not None:
                self.suffix.commit(chunk)
            upto = len(text) if finish != UNFINISHED else stop.safe_len(text)
            delta = text[streamed:upto] if upto > streamed else ""
            streamed = max(streamed, upto)
            if first_token_at is None:
                first_token_at = time.perf_counter()
            self.stats.end_round(proposal, len(drafts), n, len(new))
            yield generate_pb2.GenerateResponse(chunk=generate_pb2.TokenChunk(token_ids=chunk, text=delta))

        self._output = committed[len(p.prompt_ids) - min(self.limits.suffix.cache_context, len(p.prompt_ids)) :]
        if streamed < len(text):
            yield generate_pb2.GenerateResponse(chunk=generate_pb2.TokenChunk(text=text[streamed:]))
        elapsed = time.perf_counter() - t_start
        yield generate_pb2.GenerateResponse(result=generate_pb2.GenerationResult(
            finish_reason=finish, stats=self._final_stats(n_generated, elapsed, first_token_at, t_start)))

    def _final_stats(self, n_generated: int, elapsed: float, first_token_at: float | None, t_start: float) -> generate_pb2.GenerationStats:
        st = self.stats
        k = self.params.num_speculative_tokens
        return generate_pb2.GenerationStats(
            prompt_tokens=len(self.params.prompt_ids),
            generated_tokens=n_generated,
            rounds=st.rounds,
            draft_tokens=st.draft_tokens,
            accepted_tokens=st.accepted_tokens,
            acceptance_rate=st.accepted_tokens / st.draft_tokens if st.draft_tokens else 0.0,
            mean_tokens_per_forward=st.committed_before_truncation / st.rounds if st.rounds else 0.0,
            elapsed_s=elapsed,
            tokens_per_s=n_generated / elapsed if elapsed > 0 else 0.0,
            time_to_first_token_s=(first_token_at - t_start) if first_token_at else 0.0,
            draft_ms=st.draft_ms,
            verify_ms=st.verify_ms,
            tier_ms=st.tier_ms,
            network_ms=st.network_ms,
            coordinator_ms=max(0.0, elapsed * 1e3 - st.rpc_wall_ms),
            num_speculative_tokens=-1 if k is None else k,
            mean_num_speculative_tokens=st.draft_tokens / st.rounds if st.rounds else 0.0,
            proposer=self.params.proposer,
            overlapped_rounds=st.overlapped_rounds,
        )

    def _time_left(self) -> float | None:
        """Seconds until we must answer the client, keeping a margin to report an error in time."""
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        return left - min(0.5, 0.1 * max(left, 0.0))

    async def _verify(self, committed: list[int], hashes: PrefixHashes, drafts: list[int], q_rows) -> "Verdict":
        """Verify on the target (its TierSession retries an unreachable target until the client's deadline,
        or tier_retry_s without one, and re-prefills a replica that lacks the session)."""
        seed = derive_seed(self.params.seed, len(committed), TARGET_STREAM)
        reply = await self.target.call(
            committed, hashes,
            lambda ctx: target_pb2.VerifyRequest(context=ctx, draft_tokens=drafts, q=q_rows, sampling=self._sampling, seed=seed),
            extra=lambda response: drafts)
        response = reply.message
        self.stats.observe_rpc(reply.wall_ms, response.compute_ms, response.queue_ms, is_draft=False)
        if self.limits.target_load is not None:
            self.limits.target_load.observe(response.batch_sessions, response.batch_tokens, response.step_ms, reply.wall_ms,
                                            response.compute_ms, response.queue_ms)
        return Verdict(response.num_accepted, response.next_token, reply.wall_ms)

    async def close(self) -> None:
        """Free the session on both tiers (best effort: a tier may already have evicted it); a
        finished generation's output (after a few prompt tokens) joins the shared suffix tree."""
        if self.draft is not None:
            await self.draft.close()
        await self.target.close()
        if self.suffix_cache is not None and self._output is not None:
            await self.suffix_cache.add_async(self._output)


@dataclass(frozen=True)
class Verdict:
    num_accepted: int
    next_token: int
    wall_ms: float
