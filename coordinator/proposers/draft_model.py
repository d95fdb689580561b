"""The draft model as a proposer: the remote draft tier over one bidirectional stream per session. It proposes
a chain of K tokens or a token tree (coordinator.proposers.draft_tree), and with the speculation cache on the
draft tier pre-drafts the next round while the target verifies this one (ProposeResponse.speculated: the
round's drafts were ready when asked)."""

from __future__ import annotations

from coordinator.proposers.base import Proposal
from coordinator.proposers.draft_tree import DraftTreePolicy, TreeAsk
from specdec.core.proposer_names import DRAFT_MODEL
from coordinator.tiers.session import TierSession
from specdec.core.prefix import PrefixHashes
from specdec.proto import common_pb2, draft_pb2


class DraftModelProposer:
    """The draft tier, through the session's TierSession (its cursor, routing and back-off)."""

    source = DRAFT_MODEL

    def __init__(self, session: TierSession, sampling: common_pb2.SamplingParams, seed: int,
                 trees: DraftTreePolicy | None = None, grammar: str = "") -> None:
        """session: the draft's TierSession, over the session's ProposeStream. trees: how trees and the
        speculation cache are asked for (None: chains only). grammar: structured output's
        (coordinator.constraint.grammar_text), which the draft masks its q with."""
        self.grammar = grammar
        self.session = session
        self.sampling = sampling
        self.seed = seed
        self.trees = trees

    @property
    def available(self) -> bool:
        return self.session.available

    async def propose(self, committed: list[int], hashes: PrefixHashes, k: int, tree: TreeAsk | None = None) -> Proposal:
        """k drafts, or the tree `tree`. Raises TierError if the draft is unreachable (the caller falls back)."""
        def request(ctx: common_pb2.SessionContext) -> draft_pb2.ProposeRequest:
            message = draft_pb2.ProposeRequest(context=ctx, num_tokens=k, sampling=self.sampling, seed=self.seed,
                                               grammar=self.grammar)
            if self.trees is not None:
                self.trees.request_fields(message, tree, k)
            return message

        # A tree request's cached_len is the committed length: its nodes are not in the cursor's tail (the draft
        # moves the accepted path's entries into place when the next request's tokens show it).
        reply = await self.session.call(committed, hashes, request,
                                        extra=lambda response: [] if response.parents else list(response.tokens))
        response = reply.message
        return Proposal(DRAFT_MODEL, list(response.tokens), list(response.q), wall_ms=reply.wall_ms,
                        compute_ms=response.compute_ms, queue_ms=response.queue_ms, k=tree.depth if tree else k,
                        catch_up=reply.fed, parents=list(response.parents), tree_scheme=response.tree_scheme,
                        overlapped=response.speculated)

    async def close(self) -> None:
        await self.session.close()
