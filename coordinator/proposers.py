"""Where draft tokens come from. Every proposer returns tokens plus their q rows (empty = one-hot, for
deterministic proposals); the target verifies them all the same way, losslessly.

- DraftModelProposer: the remote draft service over one bidirectional stream per session.
- PromptLookupProposer: n-gram continuation from the session's own tokens, run here in the
  coordinator: it needs no model, and running it here saves a network hop per round.
- HybridProposer: prompt lookup when it finds a match, the draft model otherwise.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import grpc

from coordinator.lookup import LookupConfig, NgramIndex
from coordinator.tiers import DraftClient, TierCursor, TierError
from specdec.prefix import PrefixHashes
from specdec.proto import common_pb2, draft_pb2
from specdec.sampling import DRAFT_STREAM, derive_seed

log = logging.getLogger(__name__)

DRAFT_MODEL, PROMPT_LOOKUP, HYBRID = "draft_model", "prompt_lookup", "hybrid"


@dataclass
class Proposal:
    source: str  # DRAFT_MODEL or PROMPT_LOOKUP
    tokens: list[int]  # d_1..d_K (possibly fewer than asked, or none)
    q: list[common_pb2.DraftDistribution] = field(default_factory=list)  # empty = one-hot on tokens
    wall_ms: float = 0.0  # time the proposal took, as seen here
    compute_ms: float = 0.0  # of which model compute on the draft tier


class PromptLookupProposer:
    source = PROMPT_LOOKUP

    def __init__(self, config: LookupConfig, prompt_ids: list[int]) -> None:
        self.index = NgramIndex(config, prompt_ids)

    def commit(self, tokens: list[int]) -> None:
        self.index.extend(tokens)

    def propose(self, k: int) -> Proposal:
        t0 = time.perf_counter()
        tokens = self.index.propose(k)
        return Proposal(PROMPT_LOOKUP, tokens, wall_ms=(time.perf_counter() - t0) * 1e3)


class DraftModelProposer:
    """The draft tier, with the coordinator's view of its cache and a back-off when it is down."""

    source = DRAFT_MODEL
    BACKOFF_S = (0.5, 1.0, 2.0, 5.0)  # retry delays after consecutive failures

    def __init__(self, client: DraftClient, session_id: str, sampling: common_pb2.SamplingParams, seed: int) -> None:
        self.client = client
        self.session_id = session_id
        self.sampling = sampling
        self.seed = seed
        self.cursor = TierCursor()
        self.stream = client.stream()
        self._failures = 0
        self._down_until = 0.0

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    async def propose(self, committed: list[int], hashes: PrefixHashes, k: int) -> Proposal:
        """Raises TierError if the draft is unreachable (the caller falls back)."""
        seed = derive_seed(self.seed, len(committed), DRAFT_STREAM)
        for attempt in range(2):
            ctx = self.cursor.context(self.session_id, committed, hashes)
            request = draft_pb2.ProposeRequest(context=ctx, num_tokens=k, sampling=self.sampling, seed=seed)
            t0 = time.perf_counter()
            try:
                response = await self.stream.propose(request)
            except TierError as e:
                self.cursor.reset()
                if e.code == grpc.StatusCode.FAILED_PRECONDITION and attempt == 0:
                    continue  # the draft lost the session: resend everything
                self._mark_down(e)
                raise
            self._failures = 0
            self.cursor.update(ctx, list(response.tokens), response.cached_len)
            return Proposal(DRAFT_MODEL, list(response.tokens), list(response.q),
                            wall_ms=(time.perf_counter() - t0) * 1e3, compute_ms=response.compute_ms)
        raise AssertionError("unreachable")

    def _mark_down(self, e: TierError) -> None:
        delay = self.BACKOFF_S[min(self._failures, len(self.BACKOFF_S) - 1)]
        self._failures += 1
        self._down_until = time.monotonic() + delay
        self.stream.close()
        log.warning("session %s: draft unavailable (%s); prompt lookup for %.1fs", self.session_id, e, delay)

    async def close(self) -> None:
        self.stream.close()
        try:
            await self.client.end_session(self.session_id)
        except grpc.aio.AioRpcError:
            pass
