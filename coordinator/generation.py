"""One generation: the speculative round loop over the draft and target tiers.

Per round: the draft proposes K tokens (with q), the target verifies them in one forward pass and
returns (n_accepted, next_token); the coordinator commits d_1..d_n + next_token, truncated at EOS, a
stop string or the token budget, and streams them. The committed sequence lives here only; tiers are
told, each request, which prefix of it they already cache (TierCursor).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from coordinator.text import IncrementalDetokenizer, StopMatcher
from coordinator.tiers import DraftClient, TargetClient, TierCursor, TierError
from specdec.prefix import PrefixHashes
from specdec.proto import common_pb2, draft_pb2, generate_pb2, target_pb2
from specdec.sampling import DRAFT_STREAM, TARGET_STREAM, SamplingParams, derive_seed

FinishReason = generate_pb2.FinishReason


@dataclass(frozen=True)
class GenerationParams:
    """A validated request."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    seed: int
    num_speculative_tokens: int  # K
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass
class RoundStats:
    """Counters over a generation (vLLM's meanings: acceptance length includes the bonus)."""

    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    committed_before_truncation: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    network_ms: float = 0.0
    rpc_wall_ms: float = 0.0
    per_round_accepted: list[int] = field(default_factory=list)

    def observe_rpc(self, wall_ms: float, compute_ms: float, is_draft: bool) -> None:
        self.rpc_wall_ms += wall_ms
        self.network_ms += max(0.0, wall_ms - compute_ms)
        if is_draft:
            self.draft_ms += compute_ms
        else:
            self.verify_ms += compute_ms


class Generation:
    def __init__(
        self,
        params: GenerationParams,
        draft: DraftClient | None,
        target: TargetClient,
        tokenizer,
        eos_token_ids: set[int],
        max_context: int,
        draft_max_context: int = 0,
    ) -> None:
        self.params = params
        self.draft = draft
        self.target = target
        self.tokenizer = tokenizer
        self.eos = set() if params.ignore_eos else eos_token_ids
        self.max_context = max_context  # the target's: generation ends here
        self.draft_max_context = draft_max_context  # the draft's: past it, rounds go target-only
        self.session_id = uuid.uuid4().hex
        self.stats = RoundStats()
        self._sampling = common_pb2.SamplingParams(
            temperature=params.sampling.temperature, top_k=params.sampling.top_k, top_p=params.sampling.top_p
        )
        self._draft_cursor = TierCursor()
        self._target_cursor = TierCursor()
        self._draft_stream = draft.stream() if draft is not None else None

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
        finish = FinishReason.FINISH_REASON_UNSPECIFIED

        while finish == FinishReason.FINISH_REASON_UNSPECIFIED:
            remaining = p.max_new_tokens - n_generated
            room = self.max_context - len(committed)
            if room <= 0:
                finish = FinishReason.FINISH_REASON_CONTEXT
                break
            # K larger than the budget is clamped: the round also yields one token of its own.
            k = max(0, min(p.num_speculative_tokens, remaining - 1, room - 1)) if self.draft else 0
            if len(committed) + k > self.draft_max_context:
                k = 0
            drafts: list[int] = []
            q_rows = ()
            if k > 0:
                proposal = await self._propose(committed, hashes, k)
                drafts, q_rows = list(proposal.tokens), proposal.q
            verdict = await self._verify(committed, hashes, drafts, q_rows)
            n = verdict.num_accepted
            new = drafts[:n] + [verdict.next_token]
            st = self.stats
            st.rounds += 1
            st.draft_tokens += len(drafts)
            st.accepted_tokens += n
            st.committed_before_truncation += len(new)
            st.per_round_accepted.append(n)

            chunk: list[int] = []
            for tok in new:
                committed.append(tok)
                chunk.append(tok)
                n_generated += 1
                before = len(text)
                text += detok.push(tok)
                if stop.stops:
                    at = stop.find(text, before)
                    if at >= 0:
                        text = text[:at]
                        finish = FinishReason.FINISH_REASON_STOP
                        break
                if tok in self.eos:
                    finish = FinishReason.FINISH_REASON_EOS
                    break
                if n_generated >= p.max_new_tokens:
                    finish = FinishReason.FINISH_REASON_LENGTH
                    break
            hashes.extend(chunk)
            upto = len(text) if finish != FinishReason.FINISH_REASON_UNSPECIFIED else stop.safe_len(text)
            delta = text[streamed:upto] if upto > streamed else ""
            streamed = max(streamed, upto)
            if first_token_at is None:
                first_token_at = time.perf_counter()
            yield generate_pb2.GenerateResponse(chunk=generate_pb2.TokenChunk(token_ids=chunk, text=delta))

        if streamed < len(text):
            yield generate_pb2.GenerateResponse(chunk=generate_pb2.TokenChunk(text=text[streamed:]))
        elapsed = time.perf_counter() - t_start
        yield generate_pb2.GenerateResponse(result=generate_pb2.GenerationResult(
            finish_reason=finish, stats=self._final_stats(n_generated, elapsed, first_token_at, t_start)))

    def _final_stats(self, n_generated: int, elapsed: float, first_token_at: float | None, t_start: float) -> generate_pb2.GenerationStats:
        st = self.stats
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
            network_ms=st.network_ms,
            coordinator_ms=max(0.0, elapsed * 1e3 - st.rpc_wall_ms),
            num_speculative_tokens=self.params.num_speculative_tokens,
        )

    async def _propose(self, committed: list[int], hashes: PrefixHashes, k: int) -> draft_pb2.ProposeResponse:
        seed = derive_seed(self.params.seed, len(committed), DRAFT_STREAM)
        for attempt in range(2):
            ctx = self._draft_cursor.context(self.session_id, committed, hashes)
            request = draft_pb2.ProposeRequest(context=ctx, num_tokens=k, sampling=self._sampling, seed=seed)
            t0 = time.perf_counter()
            try:
                response = await self._draft_stream.propose(request)
            except TierError as e:
                if e.code == grpc.StatusCode.FAILED_PRECONDITION and attempt == 0:
                    self._draft_cursor.reset()  # the draft lost the session: resend everything
                    continue
                raise
            self.stats.observe_rpc((time.perf_counter() - t0) * 1e3, response.compute_ms, is_draft=True)
            self._draft_cursor.update(ctx, list(response.tokens), response.cached_len)
            return response
        raise AssertionError("unreachable")

    async def _verify(self, committed: list[int], hashes: PrefixHashes, drafts: list[int], q_rows) -> target_pb2.VerifyResponse:
        seed = derive_seed(self.params.seed, len(committed), TARGET_STREAM)
        for attempt in range(2):
            ctx = self._target_cursor.context(self.session_id, committed, hashes)
            request = target_pb2.VerifyRequest(context=ctx, draft_tokens=drafts, q=q_rows, sampling=self._sampling, seed=seed)
            t0 = time.perf_counter()
            try:
                response = await self.target.verify(request)
            except TierError as e:
                if e.code == grpc.StatusCode.FAILED_PRECONDITION and attempt == 0:
                    self._target_cursor.reset()
                    continue
                raise
            self.stats.observe_rpc((time.perf_counter() - t0) * 1e3, response.compute_ms, is_draft=False)
            self._target_cursor.update(ctx, drafts, response.cached_len)
            return response
        raise AssertionError("unreachable")

    async def close(self) -> None:
        """Free the session on both tiers (best effort: a tier may already have evicted it)."""
        if self._draft_stream is not None:
            self._draft_stream.close()
        calls = [self.target.end_session(self.session_id)]
        if self.draft is not None:
            calls.append(self.draft.end_session(self.session_id))
        for call in calls:
            try:
                await call
            except grpc.aio.AioRpcError:
                pass
