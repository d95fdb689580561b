"""The draft model as a proposer: the remote draft tier over one bidirectional stream per session, with its
prefetch (the overlap): while the target verifies round r, the draft already drafts round r + 1 from the
most likely outcome, and the block is kept if that outcome happened."""

from __future__ import annotations

import grpc

from coordinator.proposers.base import Proposal
from coordinator.proposers.names import DRAFT_MODEL
from coordinator.tiers.session import TierSession
from coordinator.tiers.client import SessionStream, TierError
from coordinator.tiers.cursor import Extended
from specdec.core.prefix import PrefixHashes
from specdec.proto import common_pb2, draft_pb2


class DraftModelProposer:
    """The draft tier, through the session's TierSession (its cursor, routing and back-off)."""

    source = DRAFT_MODEL

    def __init__(self, session: TierSession, sampling: common_pb2.SamplingParams, seed: int, grammar: str = "") -> None:
        """session: the draft's TierSession, over the session's ProposeStream (a SessionStream); grammar: structured
        output's (coordinator.constraint.grammar_text), which the draft masks its q with."""
        self.grammar = grammar
        self.session = session
        self.stream: SessionStream = session.calls  # send / recv apart, for the overlap
        self.sampling = sampling
        self.seed = seed
        self._speculation: tuple[common_pb2.SessionContext, int] | None = None  # (context, committed length)

    @property
    def available(self) -> bool:
        return self.session.available

    async def propose(self, committed: list[int], hashes: PrefixHashes, k: int) -> Proposal:
        """Raises TierError if the draft is unreachable (the caller falls back)."""
        reply = await self.session.call(
            committed, hashes,
            lambda ctx: draft_pb2.ProposeRequest(context=ctx, num_tokens=k, sampling=self.sampling, seed=self.seed,
                                                 grammar=self.grammar),
            extra=lambda response: list(response.tokens))
        response = reply.message
        return Proposal(DRAFT_MODEL, list(response.tokens), list(response.q), wall_ms=reply.wall_ms,
                        compute_ms=response.compute_ms, queue_ms=response.queue_ms, k=k, catch_up=reply.fed)

    # --- prefetch (the overlap): draft round r+1 while the target verifies round r ---------------------

    async def prefetch(self, committed: list[int], hashes: PrefixHashes, drafts: list[int], k: int) -> bool:
        """Ask for the next block assuming every draft is accepted: K + 1 tokens after
        committed + drafts, the first being the draft's guess of the target's bonus token. Only sends;
        collect() reads the reply. Returns False if the request could not be sent."""
        ctx = self.session.context(Extended(committed, drafts), hashes.extended(drafts))
        request = draft_pb2.ProposeRequest(context=ctx, num_tokens=k + 1, sampling=self.sampling, seed=self.seed,
                                           grammar=self.grammar)
        try:
            await self.stream.send(request)
        except TierError as e:
            self.session.cursor.reset()
            self.session.mark_down(e)
            return False
        self._speculation = (ctx, len(committed))
        return True

    async def collect(self, all_accepted: bool, next_token: int) -> Proposal | None:
        """After verification: the pre-drafted block if the guess held (all drafts accepted and the
        bonus equal to the draft's guess), else None. Draws are keyed by position, so the block equals
        what a fresh Propose would return now."""
        if self._speculation is None:
            return None
        ctx, committed_len = self._speculation
        self._speculation = None
        try:
            response = await self.stream.recv()
        except TierError as e:
            self.session.cursor.reset()
            if e.code != grpc.StatusCode.FAILED_PRECONDITION:
                self.session.mark_down(e)
            return None
        self.session.cursor.update(ctx, list(response.tokens), response.cached_len, committed_len=committed_len)
        if all_accepted and response.tokens and response.tokens[0] == next_token:
            return Proposal(DRAFT_MODEL, list(response.tokens[1:]), list(response.q[1:]), wall_ms=0.0,
                            compute_ms=response.compute_ms, overlapped=True, k=len(response.tokens) - 1)
        return None

    async def close(self) -> None:
        await self.session.close()
