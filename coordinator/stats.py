"""A generation's statistics: counters over its rounds (vLLM's meanings: acceptance length includes the
bonus) and one RoundRecord per round, for the metrics, the debug log and the final GenerationStats."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from coordinator.proposers.base import Proposal
from coordinator.trace import RoundTrace
from specdec.proto import generate_pb2


@dataclass(frozen=True)
class RoundRecord:
    """One round, as the metrics and the debug log see it."""

    index: int  # round number in the generation, from 0
    proposer: str  # DRAFT_MODEL, PROMPT_LOOKUP or SUFFIX: where this round's drafts came from
    k: int  # drafts asked of the proposer (K after clamping to the token budget)
    drafts: int  # draft tokens the target verified (a proposer may offer fewer than k)
    accepted: int  # of those, accepted by the target: always the leading ones, d_1..d_accepted
    draft_ms: float  # draft model compute
    verify_ms: float  # target model compute
    tier_ms: float  # time at the tiers outside the forwards: waiting for a step, verification / sampling math
    network_ms: float  # rpc round trips minus the tiers' time (compute + tier_ms): the wire and the gRPC stacks
    coordinator_ms: float  # the round's wall time minus its rpcs: proposing by lookup, bookkeeping, detokenizing
    fallback: bool  # the draft model was wanted but unreachable: prompt lookup proposed instead
    overlapped: bool  # the drafts were pre-drafted during the previous round's verification


@dataclass
class RoundStats:
    """Counters over a generation (vLLM's meanings: acceptance length includes the bonus), and one
    RoundRecord per round (per-position acceptance, K, proposer and timings for the metrics)."""

    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    committed_before_truncation: int = 0
    forwards: int = 0  # the target's: one a round, and one per token a target-only round ran on for
    overlapped_rounds: int = 0
    overlap_saved_ms: float = 0.0  # draft latency the speculation cache's hits saved (estimated)
    pushed_rounds: int = 0  # draft-model rounds whose proposal the draft had pushed before the verdict
    direct_rounds: int = 0  # rounds the draft tier ran itself (coordinator.tiers.direct)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    tier_ms: float = 0.0
    network_ms: float = 0.0
    rpc_wall_ms: float = 0.0
    records: list[RoundRecord] = field(default_factory=list)
    # Full resends of the committed tokens after a tier lost the session (evicted, restarted), by tier.
    reprefills: Counter = field(default_factory=Counter)
    # Failed internal rpcs, by (tier, rpc, status name); the generation may have recovered from them.
    tier_errors: Counter = field(default_factory=Counter)
    # Per proposer that drafted: [rounds with drafts, draft tokens verified, accepted] (GenerationStats.by_proposer).
    by_proposer: dict[str, list[int]] = field(default_factory=dict)
    trace: RoundTrace = field(default_factory=RoundTrace)  # the round trace (coordinator.trace)
    clock: Callable[[], float] = time.perf_counter  # seconds; a fake in the round loop's unit tests
    # The round in progress: its start and what its rpcs cost so far.
    _round_t0: float = 0.0
    _round_ms: dict = field(default_factory=lambda: dict.fromkeys(("draft", "verify", "tier", "network", "rpc_wall"), 0.0))

    def begin_round(self) -> None:
        self._round_t0 = self.clock()
        self._round_ms = dict.fromkeys(self._round_ms, 0.0)

    def observe_rpc(self, wall_ms: float, compute_ms: float, queue_ms: float, is_draft: bool) -> None:
        """One rpc: its round trip here, and the tier's forward time and other time (its queue_ms)."""
        tier = min(max(0.0, queue_ms), max(0.0, wall_ms - compute_ms))
        network = max(0.0, wall_ms - compute_ms - tier)
        self.rpc_wall_ms += wall_ms
        self.tier_ms += tier
        self.network_ms += network
        if is_draft:
            self.draft_ms += compute_ms
        else:
            self.verify_ms += compute_ms
        r = self._round_ms
        r["rpc_wall"] += wall_ms
        r["tier"] += tier
        r["network"] += network
        r["draft" if is_draft else "verify"] += compute_ms

    def observe_overlapped(self, draft_compute_ms: float, saved_ms: float = 0.0) -> None:
        """This round's drafts were pre-drafted during the previous round (the draft's speculation cache);
        saved_ms: the draft call's usual wall time less this one's."""
        self.overlapped_rounds += 1
        self.overlap_saved_ms += saved_ms
        self.draft_ms += draft_compute_ms
        self._round_ms["draft"] += draft_compute_ms

    def observe_tier_error(self, error) -> None:
        """error: a coordinator.tiers.client.TierError (its tier, rpc and status code)."""
        self.tier_errors[(error.tier, error.rpc, error.code.name)] += 1

    def end_round(self, proposal: Proposal, drafts: int, accepted: int, committed: int, forwards: int = 1) -> RoundRecord:
        """forwards: the target's in this round (1 + the tokens its target ran on for)."""
        r = self._round_ms
        self.rounds += 1
        self.forwards += forwards
        self.draft_tokens += drafts
        self.accepted_tokens += accepted
        self.committed_before_truncation += committed
        if drafts:
            counts = self.by_proposer.setdefault(proposal.source, [0, 0, 0])
            counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + drafts, counts[2] + accepted
        now = self.clock()
        wall_ms = (now - self._round_t0) * 1e3
        record = RoundRecord(
            index=len(self.records), proposer=proposal.source, k=proposal.k, drafts=drafts, accepted=accepted,
            draft_ms=r["draft"], verify_ms=r["verify"], tier_ms=r["tier"], network_ms=r["network"],
            coordinator_ms=max(0.0, wall_ms - r["rpc_wall"]), fallback=proposal.fallback, overlapped=proposal.overlapped)
        self.records.append(record)
        self.trace.end_round(record.index, self._round_t0, now, **{"specdec.proposer": proposal.source,
                             "specdec.drafts": drafts, "specdec.accepted": accepted})
        return record

    def summary(self, prompt_tokens: int, generated: int, elapsed_s: float, first_token_s: float | None, k: int | None,
                proposer: str) -> generate_pb2.GenerationStats:
        """The generation's GenerationStats. first_token_s: seconds to the first streamed chunk (None: none);
        k: the request's K (None: adaptive)."""
        return generate_pb2.GenerationStats(
            prompt_tokens=prompt_tokens,
            generated_tokens=generated,
            rounds=self.rounds,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
            acceptance_rate=self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            mean_tokens_per_forward=self.committed_before_truncation / self.forwards if self.forwards else 0.0,
            target_forwards=self.forwards,
            elapsed_s=elapsed_s,
            tokens_per_s=generated / elapsed_s if elapsed_s > 0 else 0.0,
            time_to_first_token_s=first_token_s or 0.0,
            draft_ms=self.draft_ms,
            verify_ms=self.verify_ms,
            tier_ms=self.tier_ms,
            network_ms=self.network_ms,
            coordinator_ms=max(0.0, elapsed_s * 1e3 - self.rpc_wall_ms),
            num_speculative_tokens=-1 if k is None else k,
            mean_num_speculative_tokens=self.draft_tokens / self.rounds if self.rounds else 0.0,
            proposer=proposer,
            overlapped_rounds=self.overlapped_rounds,
            overlap_saved_ms=self.overlap_saved_ms,
            trace=self.trace.totals(),
            pushed_rounds=self.pushed_rounds,
            direct_rounds=self.direct_rounds,
            by_proposer={name: generate_pb2.ProposerStats(rounds=r, draft_tokens=d, accepted_tokens=a)
                         for name, (r, d, a) in self.by_proposer.items()},
        )
