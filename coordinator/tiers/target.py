"""The target as the round loop calls it: verify(drafts) -> Verdict, over the session's TierSession (which
retries an unreachable target until the client's deadline, or tier_retry_s without one, and re-prefills a
replica that lacks the session)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

from coordinator.proposers.tier_cost import TierCost
from coordinator.stats import RoundStats
from coordinator.tiers.session import TierSession
from specdec.core.items_until import items_until
from specdec.core.prefix import PrefixHashes
from specdec.math.seeds import TARGET_STREAM, derive_seed
from specdec.proto import common_pb2, target_pb2
from specdec.serving.features import SessionFeatures


FEATURE_PART_BYTES = 4 << 20  # a request's rows at most: half the tiers' default --max-message-bytes (8 MiB)


@dataclass(frozen=True)
class Verdict:
    num_accepted: int  # n: the leading drafts the target accepted
    next_token: int  # the recovered token (n < K) or the bonus token (n == K)
    wall_ms: float  # the Verify's round trip
    path: tuple[int, ...] = ()  # a token tree: the accepted nodes, root-down; () for a chain (its first n drafts)
    logprobs: tuple[target_pb2.TokenLogprobs, ...] = ()  # per committed token (d_1..d_n, next_token, run_on), when asked
    run_on: tuple[int, ...] = ()  # the tokens the target decoded by itself after next_token (a target-only round's run-on)


class RoundParts:
    """A round's tokens as the target sends them in parts, ahead of its verdict (VerifyRequest.run_on_part): the
    accepted drafts, next_token and the run-on so far, each part repeating the earlier ones' tokens."""

    def __init__(self, size: int) -> None:
        self.size = size  # tokens a part adds
        self.given: list[int] = []  # the tokens yielded so far
        self.verdict: Verdict | None = None  # once until() is done
        self._parts: asyncio.Queue = asyncio.Queue()

    def add(self, tokens: list[int]) -> None:
        self._parts.put_nowait(tokens)

    async def until(self, verifying: Awaitable[Verdict]) -> AsyncIterator[list[int]]:
        """Each part's new tokens as it comes, until the verdict (then in .verdict). A part that does not extend
        the tokens given (a retried call's replica disagreeing) yields nothing; the verdict is checked."""
        main = asyncio.ensure_future(verifying)
        try:
            async for tokens in items_until(self._parts, main):
                if tokens[: len(self.given)] == self.given and len(tokens) > len(self.given):
                    new = tokens[len(self.given):]
                    self.given += new
                    yield new
            self.verdict = await main
        finally:
            if not main.done():
                main.cancel()


class TargetVerifier:
    def __init__(self, session: TierSession, sampling: common_pb2.SamplingParams, seed: int, stats: RoundStats,
                 load: TierCost | None = None, logprobs: int = -1, features: SessionFeatures | None = None,
                 race_seed: int = 0) -> None:
        """seed: the request's (each round's draws are keyed by it and the committed length); load: the target's
        batching, shared by the coordinator's sessions, learnt from every response (None: not learnt);
        logprobs: -1 none, n >= 0 the committed tokens' logprobs with the top n alternatives; features: a feature
        draft's rows, which every verdict brings (None: no feature draft); race_seed: a seeded request's keyed race
        (VerifyRequest.race_seed; the drafts' q is then not sent), 0: rejection sampling."""
        self.logprobs = logprobs
        self.features = features
        self.session = session
        self.sampling = sampling
        self.seed, self.race_seed = seed, race_seed
        self.stats = stats
        self.load = load
        self._open = load is not None  # counted in load.live until close()
        if load is not None:
            load.live += 1

    async def verify(self, committed: list[int], hashes: PrefixHashes, drafts: list[int],
                     q: list[common_pb2.DraftDistribution], parents: list[int] = (), masks: list[bytes] = (),
                     tree_scheme: int = 0, run_on: int = 0, parts: RoundParts | None = None) -> Verdict:
        """Verify drafts (with their q rows; none = one-hot) after the committed tokens; with parents, the
        drafts are a token tree's nodes, drawn as tree_scheme says (0: candidates without q, IID with q); masks:
        structured output's allowed tokens at each of the K + 1 positions; run_on: after its verdict the target may
        decode up to this many more tokens, the i-th with the seed of a target-only round after len(committed) + i
        tokens (none with a feature draft, whose head needs every position's features); parts: given the round's
        tokens in parts of parts.size as the target decodes them. Raises TierError."""
        if self.features is not None:
            await self._prefill_in_parts(committed, hashes)
            run_on = 0
        seed = derive_seed(self.seed, len(committed), TARGET_STREAM)
        run_on_seeds = [derive_seed(self.seed, len(committed) + i, TARGET_STREAM) for i in range(1, run_on + 1)]
        def accepted(response) -> list[int]:
            return [drafts[i] for i in response.accepted_path] if parents else list(drafts[: response.num_accepted])

        part = parts.size if parts is not None and run_on_seeds else 0
        if part:
            self.session.calls.on_part = lambda r: parts.add(accepted(r) + [r.next_token, *r.run_on_tokens])
        try:
            reply = await self.session.call(
                committed, hashes,
                lambda ctx: target_pb2.VerifyRequest(
                    context=ctx, draft_tokens=drafts, q=() if self.race_seed else q, sampling=self.sampling, seed=seed,
                    race_seed=self.race_seed,
                    logprobs=self.logprobs >= 0, top_logprobs=max(self.logprobs, 0), draft_parents=parents,
                    token_masks=masks, tree_scheme=tree_scheme if parents else 0,
                    feature_layers=self.features.layers if self.features else (), run_on_seeds=run_on_seeds,
                    run_on_part=part),
                extra=lambda response: accepted(response) + (  # the accepted drafts, then the run-on
                    [response.next_token, *response.run_on_tokens[:-1]] if response.run_on_tokens else []))
        finally:
            self.session.calls.on_part = None
        response = reply.message
        if self.features is not None:
            self.features.absorb(response.features_start, response.features, on_gap=self.session.cursor.reset)
        self.stats.observe_rpc(reply.wall_ms, response.compute_ms, response.queue_ms, is_draft=False)
        if self.load is not None:
            self.load.observe(response.batch_sessions, response.batch_tokens, response.step_ms, reply.wall_ms,
                              response.compute_ms, response.queue_ms, drafts=len(drafts), step_id=response.step_id,
                              wait_ms=response.trace.queue_us / 1e3)
        return Verdict(response.num_accepted, response.next_token, reply.wall_ms, tuple(response.accepted_path),
                       tuple(response.logprobs), tuple(response.run_on_tokens))

    async def score(self, prompt: list[int], hashes: PrefixHashes, top: int) -> tuple[target_pb2.TokenLogprobs, ...]:
        """The prompt's scores (each token's after the first, with its top alternatives): a call over the whole prompt
        before the first round, its verdict dropped. The target then holds the prompt as the first round's verify
        would have left it; with a feature draft (whose rows this call does not ask for) it is sent again, asking."""
        reply = await self.session.call(
            prompt, hashes,
            lambda ctx: target_pb2.VerifyRequest(context=ctx, sampling=self.sampling, prompt_logprobs=True,
                                                 top_logprobs=top),
            extra=lambda response: [])
        if self.features is not None:
            self.session.cursor.reset(lost=False)
        self.stats.observe_rpc(reply.wall_ms, reply.message.compute_ms, reply.message.queue_ms, is_draft=False)
        return tuple(reply.message.prompt_logprobs)

    async def _prefill_in_parts(self, committed: list[int], hashes: PrefixHashes) -> None:
        """With features asked, a request feeds at most FEATURE_PART_BYTES of rows (the target refuses a request
        whose rows could exceed one response): a longer uncached part (a prompt, a re-prefill) goes first in parts,
        each a verify without drafts over a prefix whose verdict is dropped (only its rows are kept)."""
        part = max(1, FEATURE_PART_BYTES // self.features.row_bytes)
        while (uncached := len(committed) - self.session.cursor.prefix(committed)) > part:
            end = len(committed) - uncached + part
            prefix = committed[:end]
            reply = await self.session.call(
                prefix, hashes,
                lambda ctx: target_pb2.VerifyRequest(context=ctx, sampling=common_pb2.SamplingParams(),  # (dropped)
                                                     feature_layers=self.features.layers),
                extra=lambda response: [])
            self.features.absorb(reply.message.features_start, reply.message.features, on_gap=self.session.cursor.reset)

    async def close(self) -> None:
        if self._open:
            self._open = False
            self.load.live -= 1
        await self.session.close()
