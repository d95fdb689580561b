"""One generation: the speculative round loop.

Per round: the drafter proposes up to K draft tokens (with q), the target verifies them in one forward
(under structured output, with the grammar's mask at each position; tokens the grammar forces are
committed first, with no forward: coordinator.constraint) and returns (n_accepted, next_token); the output commits d_1..d_n + next_token (for a token tree: the
accepted path's tokens + next_token), cut at EOS, a stop string
or the token budget, and streams them. The committed sequence lives here only; each tier is told, per
request, which prefix of it it already caches. Everything else lives in the collaborators, passed in (the
unit tests pass fakes): the target (coordinator.tiers.target: routing, retries, re-prefills), the drafter
(coordinator.proposers.drafter: the proposal strategies and the policy that picks among them), the output
(coordinator.output: stop, EOS, detokenizing, streaming) and the stats (coordinator.stats).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

import grpc

from coordinator.constraint import Constraint, NoConstraint
from coordinator.output import FinishReason, Output
from coordinator.params import GenerationParams
from coordinator.proposers.base import Proposal
from coordinator.proposers.drafter import Drafter
from coordinator.stats import RoundStats
from coordinator.tiers.client import TierError
from coordinator.tiers.direct import DirectRounds
from coordinator.tiers.target import RoundParts, Verdict
from specdec.core.prefix import PrefixHashes
from specdec.proto import common_pb2, generate_pb2


class Target(Protocol):
    """The target as the loop calls it (coordinator.tiers.target.TargetVerifier; a fake in tests)."""

    async def verify(self, committed: list[int], hashes: PrefixHashes, drafts: list[int],
                     q: list[common_pb2.DraftDistribution], parents: list[int] = (), masks: list[bytes] = (),
                     tree_scheme: int = 0, run_on: int = 0, parts: RoundParts | None = None) -> Verdict: ...

    async def score(self, prompt: list[int], hashes: PrefixHashes, top: int) -> Sequence: ...

    async def close(self) -> None: ...


class Generation:
    def __init__(self, params: GenerationParams, *, target: Target, drafter: Drafter, output: Output,
                 stats: RoundStats, max_context: int, session_id: str = "",
                 constraint: Constraint | NoConstraint = NoConstraint(), direct: DirectRounds | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """max_context: the target's (generation ends there); session_id: the session's on both tiers; direct:
        the draft tier's own rounds, used while they last (None: every round here)."""
        self.params = params
        self.target = target
        self.drafter = drafter
        self.output = output
        self.stats = stats
        self.max_context = max_context
        self.session_id = session_id
        self.constraint = constraint
        self.direct = direct
        self.clock = clock

    async def run(self) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """Yield one chunk per round, then the result. The caller must call close() afterwards."""
        p, out, stats = self.params, self.output, self.stats
        t_start, first_token_at = self.clock(), None
        committed = list(p.prompt_ids)
        hashes = PrefixHashes(committed)
        await self.drafter.start()
        if p.prompt_logprobs >= 0:  # the prompt scored first: one target call over it, which leaves it cached
            yield out.prompt_event(p.prompt_ids, await self.target.score(committed, hashes, p.prompt_logprobs))
        while not out.finished:
            stats.begin_round()
            limit = min(out.remaining, self.max_context - len(committed))  # tokens this round may commit
            if limit <= 0:
                out.end(FinishReason.FINISH_REASON_CONTEXT)
                break
            if forced := self.constraint.forced(limit):  # structured output: tokens the grammar forces are free
                await self.drafter.started()
                chunk = out.take(forced)
                committed.extend(chunk)
                hashes.extend(chunk)
                self.drafter.commit(chunk)
                first_token_at = first_token_at or self.clock()
                yield out.event(chunk)
                continue
            if self.direct is not None and self.direct.usable:  # the draft tier runs the rounds itself, until it stops
                await self.drafter.started()
                async with contextlib.aclosing(self.direct.rounds(committed, limit)) as rounds:
                    async for proposal, verdict in rounds:
                        chunk = self._commit(proposal, verdict, committed, hashes)
                        if first_token_at is None:
                            first_token_at = self.clock()
                        yield out.event(chunk, verdict.logprobs[: len(chunk)])
                        if out.finished:
                            break
                        stats.begin_round()
                continue
            proposal = await self.drafter.propose(committed, hashes, limit)  # propose
            proposal, masks = self.constraint.check(proposal, p.sampling.greedy)  # (the grammar's masks)
            most = len(proposal.tokens) + 1 + proposal.run_on  # the round's tokens at the most
            parts = RoundParts(proposal.run_on_part) if 0 < proposal.run_on_part < most else None
            verifying = self.drafter.verify(self.target.verify(  # verify (the draft tier may push meanwhile)
                committed, hashes, proposal.tokens, proposal.q, proposal.parents, masks, proposal.tree_scheme,
                proposal.run_on, parts), proposal)
            if parts is not None:  # a long run-on: its tokens emitted in parts as the target decodes them
                async for tokens in parts.until(verifying):
                    await self.drafter.started()
                    if chunk := self._commit_tokens(tokens, committed, hashes):
                        first_token_at = first_token_at or self.clock()
                        yield out.event(chunk)
                verdict = parts.verdict
            else:
                verdict = await verifying
            await self.drafter.started()  # (the strategies' start ran beside the first round)
            chunk = self._commit(proposal, verdict, committed, hashes, parts.given if parts else None)  # accept, commit
            if chunk:  # (none where a part ended the output)
                first_token_at = first_token_at or self.clock()
                yield out.event(chunk, verdict.logprobs[: len(chunk)])  # emit
        self.drafter.finish(committed)
        if (tail := out.tail()) is not None:
            yield tail
        elapsed = self.clock() - t_start
        yield generate_pb2.GenerateResponse(result=generate_pb2.GenerationResult(finish_reason=out.finish, stats=stats.summary(
            len(p.prompt_ids), out.generated, elapsed, None if first_token_at is None else first_token_at - t_start,
            p.num_speculative_tokens, p.proposer)))

    def _commit(self, proposal: Proposal, verdict: Verdict, committed: list[int], hashes: PrefixHashes,
                given: list[int] | None = None) -> list[int]:
        """The round's outcome: the accepted drafts (a tree's accepted path) + the next token + the target's run-on,
        less the tokens its parts gave already, committed; returns the chunk to emit."""
        n = verdict.num_accepted
        path = verdict.path if proposal.parents else range(n)  # a token tree: the accepted path's nodes
        accepted = [proposal.tokens[i] for i in path] + [verdict.next_token] + list(verdict.run_on)
        given = given or []
        if accepted[: len(given)] != given:
            raise TierError("target", grpc.StatusCode.INTERNAL, "the round's verdict does not extend the tokens its "
                            "parts gave (a retried call's replica decoded other tokens)")
        self.drafter.observe(proposal, verdict, accepted)
        chunk = self._commit_tokens(accepted[len(given):], committed, hashes)
        self.stats.end_round(proposal, len(proposal.tokens), n, len(accepted), forwards=1 + len(verdict.run_on))
        return chunk

    def _commit_tokens(self, tokens: list[int], committed: list[int], hashes: PrefixHashes) -> list[int]:
        """Tokens of the round cut at EOS, the budget or a stop string (none once the output ended), committed."""
        chunk = self.output.take(tokens) if not self.output.finished else []
        self.constraint.commit(chunk)
        committed.extend(chunk)
        hashes.extend(chunk)
        self.drafter.commit(chunk)
        return chunk

    async def close(self) -> None:
        """Free the session on both tiers (best effort: a tier may already have evicted it)."""
        await self.drafter.close()
        await self.target.close()
