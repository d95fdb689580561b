"""Direct rounds as the round loop sees them (docs/DESIGN.md, Direct rounds): the session's draft replica runs
its rounds itself (DraftService.Drive: it proposes, asks the target, commits, proposes again) and the
coordinator reads each round's drafts and verdict off one stream, off the path between rounds.

They run while they last. Any failure (a replica with no --direct-target, a draft or target error, the draft
replica gone) ends them for the session: the error is counted, and the loop's own rounds go on from what was
committed (each tier is sent the whole sequence again: the Drive took the session's caches with it)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc

from coordinator.proposers.base import Proposal
from coordinator.stats import RoundStats
from coordinator.tiers.client import TierClient, TierError, stream_status
from coordinator.tiers.session import TierSession
from coordinator.tiers.target import Verdict
from specdec.core.proposer_names import DRAFT_MODEL
from specdec.math.seeds import DRAFT_STREAM, derive_seed
from specdec.proto import common_pb2, draft_pb2

log = logging.getLogger(__name__)


class DirectRounds:
    def __init__(self, draft: TierClient, sessions: tuple[TierSession, ...], routing_key: str, k: int,
                 sampling: common_pb2.SamplingParams, seed: int, eos: set[int], logprobs: int, fingerprint: str,
                 stats: RoundStats, time_left: Callable[[], float | None], speculate: bool = False,
                 draft_seed: int = 0, race_seed: int = 0) -> None:
        """draft: the draft tier; sessions: the session's TierSessions on both tiers (reset when the Drive ends);
        routing_key: the session's (both tiers' calls carry it); k: the request's K; seed: the request's;
        eos: the tokens that end the generation (empty: none); logprobs: as TargetVerifier's; speculate: the draft
        drafts ahead while the target verifies (DriveRequest.speculate); draft_seed: the draft's (0: derived from seed);
        race_seed: a seeded request's keyed race (DriveRequest.race_seed; 0: none)."""
        self.draft, self.sessions, self.routing_key, self.k = draft, sessions, routing_key, k
        self.sampling, self.seed, self.eos, self.logprobs = sampling, seed, eos, logprobs
        self.fingerprint, self.stats, self.time_left = fingerprint, stats, time_left
        self.session_id = sessions[0].session_id
        self.speculate = speculate
        self.draft_seed, self.race_seed = draft_seed or derive_seed(seed, 0, DRAFT_STREAM), race_seed
        self.usable = True  # until the Drive ends: then the loop's own rounds

    async def rounds(self, committed: list[int], limit: int) -> AsyncIterator[tuple[Proposal, Verdict]]:
        """Each round's proposal and verdict as they come, committing at most `limit` tokens in all. Ends (and
        stays ended) when the Drive does; a failure is counted in the stats, not raised."""
        self.usable = False
        request = draft_pb2.DriveRequest(
            context=common_pb2.SessionContext(session_id=self.session_id, new_tokens=committed,
                                              tokenizer_fingerprint=self.fingerprint),
            num_tokens=self.k, sampling=self.sampling, draft_seed=self.draft_seed, race_seed=self.race_seed,
            target_seed=self.seed, max_new_tokens=limit, eos_token_ids=sorted(self.eos),
            logprobs=self.logprobs >= 0, top_logprobs=max(self.logprobs, 0), target_routing_key=self.routing_key,
            speculate=int(self.speculate))
        call = self.draft.stub.Drive(request, metadata=self.draft.routing.metadata(self.routing_key),
                                     timeout=self.time_left())
        for session in self.sessions:  # the Drive holds the session on both tiers (ending it when it ends);
            session.cursor.reset()  # after it, each is sent it whole
        try:
            draft = self.sessions[-1].reachability  # each event is the draft tier's reply (the target's is the draft's)
            async for event in call:
                if draft is not None:
                    draft.heard()
                yield self._round(event)
        except grpc.aio.AioRpcError as e:
            code, details = stream_status(e.code(), e.details() or "", e.trailing_metadata())
            self.stats.observe_tier_error(TierError("draft", code, details, "Drive"))
            log.warning("session %s: direct rounds ended (%s: %s); the coordinator runs the rest", self.session_id,
                        code.name, details, extra={"session_id": self.session_id, "code": code.name})
        finally:
            call.cancel()

    def _round(self, event: draft_pb2.DriveEvent) -> tuple[Proposal, Verdict]:
        """The round as the loop commits it; its rpcs as the draft replica timed them (the proposal is the
        replica's own, with no wire), laid end to end before now on the round trace."""
        v, stats = event.verdict, self.stats
        now = time.perf_counter()
        verify_at = now - event.verify_wall_ms / 1e3
        if event.draft_tokens:
            stats.observe_rpc(event.draft_wall_ms, event.draft_compute_ms, event.draft_queue_ms, is_draft=True)
            stats.trace.observe("draft", verify_at - event.draft_wall_ms / 1e3, event.draft_wall_ms, event.draft_trace)
        stats.observe_rpc(event.verify_wall_ms, v.compute_ms, v.queue_ms, is_draft=False)
        stats.trace.observe("target", verify_at, event.verify_wall_ms, v.trace)
        stats.direct_rounds += 1
        if event.speculated:
            stats.observe_overlapped(0.0)
        proposal = Proposal(DRAFT_MODEL, list(event.draft_tokens), k=self.k, wall_ms=event.draft_wall_ms,
                            compute_ms=event.draft_compute_ms, queue_ms=event.draft_queue_ms,
                            overlapped=event.speculated)
        return proposal, Verdict(v.num_accepted, v.next_token, event.verify_wall_ms, logprobs=tuple(v.logprobs))
