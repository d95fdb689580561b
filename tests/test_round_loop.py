"""The round loop (coordinator.generation.Generation) driven with fakes: a target that accepts drafts while
they match its own continuation and returns its next token, a draft model whose guesses are chosen, a
tokenizer with one character per token and a clock that ticks by hand. The real Drafter, Policy, strategies
(the draft model's over a fake draft tier), Output and RoundStats run as they do in the coordinator; no
server, no model.

What the loop must do (DESIGN.md, "One round"): commit d_1..d_n + the target's token each round, so the
output is the target's own continuation whatever the drafts; cut at EOS inside an accepted block, at a stop
string that spans rounds, at the token budget (K clamped to it) and at the context; count the rounds the
draft tier's speculation cache had ready; fall back to prompt lookup when the draft tier fails; fail when the target does."""

from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest

from coordinator.generation import Generation
from coordinator.output import Output
from coordinator.params import GenerationParams
from coordinator.proposers.base import Proposal
from coordinator.proposers.draft_model import DraftModelConfig, DraftModelStrategy
from coordinator.proposers.drafter import Drafter
from coordinator.proposers.lookup import LookupConfig, LookupStrategy
from specdec.core.proposer_names import DRAFT_MODEL, PROMPT_LOOKUP, Proposer
from coordinator.proposers.policy import Policy, PolicyConfig
from coordinator.proposers.tier_cost import TierCost
from coordinator.stats import RoundStats
from coordinator.tiers.client import TierError
from coordinator.tiers.session import TierReply
from coordinator.tiers.target import TargetVerifier, Verdict
from specdec.math.params import SamplingParams
from specdec.proto import common_pb2, draft_pb2, generate_pb2

PROMPT = [1, 2, 3, 4]
EOS = 0
FR = generate_pb2.FinishReason


def truth(n: int = 200) -> list[int]:
    """The target's greedy continuation of PROMPT: tokens 5, 6, ... (never EOS unless a test puts one in)."""
    return [5 + i % 20 for i in range(n)]


class Tokenizer:
    """One letter per token id (a = 0, b = 1, ...)."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        self.t += 0.001
        return self.t


class FakeTarget:
    """Accepts the leading drafts that equal its continuation; its next token is the continuation's next."""

    def __init__(self, continuation: list[int], fail_on_call: int | None = None) -> None:
        self.continuation = continuation
        self.calls: list[list[int]] = []  # the drafts of each verify
        self.run_ons: list[int] = []  # the run-on each verify allowed
        self.masks: list[list[bytes]] = []  # the structured-output masks of each verify
        self.fail_on_call = fail_on_call
        self.closed = False
        self.prompt_len = len(PROMPT)  # where the continuation starts

    async def verify(self, committed, hashes, drafts, q, parents=(), masks=(), tree_scheme=0, run_on=0,
                     parts=None) -> Verdict:
        self.calls.append(list(drafts))
        self.run_ons.append(run_on)
        self.masks.append(list(masks))
        if self.fail_on_call is not None and len(self.calls) == self.fail_on_call:
            raise TierError("target", grpc.StatusCode.UNAVAILABLE, "connection refused")
        assert len(hashes) == len(committed)
        at = len(committed) - self.prompt_len
        n = 0
        while n < len(drafts) and drafts[n] == self.continuation[at + n]:
            n += 1
        verdict = Verdict(n, self.continuation[at + n], wall_ms=1.0,  # (the real target stops at EOS too)
                          run_on=tuple(self.continuation[at + n + 1: at + n + 1 + run_on]))
        if parts is not None:  # each time parts.size more tokens are known and more are to come: a part, then a pause
            tokens = list(drafts[:n]) + [verdict.next_token, *verdict.run_on]
            for known in range(parts.size, len(tokens), parts.size):
                parts.add(tokens[:known])
                await asyncio.sleep(0)
        return verdict

    async def close(self) -> None:
        self.closed = True


class FakeDraft:
    """The draft tier, as the draft-model strategy's TierSession: proposes its own guesses of the continuation
    (`guess`); with a speculation cache, reports a proposal as pre-drafted (speculated) when the last round's
    outcome was its own guess (the cache of the real draft tier holds at least that outcome)."""

    def __init__(self, guess: list[int], fail: bool = False, cache: bool = False) -> None:
        self.guess = guess
        self.fail = fail
        self.cache = cache
        self.available = True
        self.cached = 0  # committed tokens it holds (those of its last call)
        self.proposed = 0  # propose calls
        self.requests: list[draft_pb2.ProposeRequest] = []  # what each call asked
        self._expected: int | None = None  # committed length if the last proposal was wholly right

    async def call(self, committed, hashes, request, extra=None) -> TierReply:
        self.proposed += 1
        if self.fail:
            self.available = False
            raise TierError("draft", grpc.StatusCode.UNAVAILABLE, "connection refused")
        self.requests.append(request(common_pb2.SessionContext()))
        self.cached = len(committed)
        k = self.requests[-1].num_tokens
        at = len(committed) - len(PROMPT)
        hit = self.cache and self._expected == len(committed) and committed[len(PROMPT):] == self.guess[:at]
        self._expected = len(committed) + k + 1
        return TierReply(draft_pb2.ProposeResponse(tokens=self.guess[at:at + k], speculated=hit), 0.1 if hit else 1.0, 1)

    def pushed(self, committed, hashes):  # (no pushes: every proposal is asked for)
        return None

    async def close(self) -> None:
        pass


def generation(target, draft=None, *, k: int | None = 3, max_new: int = 20, proposer: Proposer = DRAFT_MODEL,
               stop=(), eos=frozenset(), max_context: int = 1000, prompt=PROMPT,
               constraint=None, draft_config: DraftModelConfig = DraftModelConfig(),
               load: TierCost | None = None, policy: PolicyConfig = PolicyConfig(max_k=8)) -> Generation:
    params = GenerationParams(prompt_ids=list(prompt), max_new_tokens=max_new, sampling=SamplingParams(), seed=1,
                              num_speculative_tokens=k, proposer=proposer, stop=tuple(stop))
    clock = Clock()
    stats = RoundStats(clock=clock)
    lookup = LookupStrategy(LookupConfig(), params.prompt_ids)
    strategies = [lookup] if proposer == PROMPT_LOOKUP else []
    if draft is not None:
        strategies.append(DraftModelStrategy(draft_config, draft, common_pb2.SamplingParams(), 1, stats,
                                             max_context=max_context))
    drafter = Drafter(params, Policy(policy), strategies, lookup, load or TierCost(), max_k=16)
    output = Output(Tokenizer(), params.prompt_ids, max_new, set(eos), stop)
    extra = {"constraint": constraint} if constraint is not None else {}
    return Generation(params, target=target, drafter=drafter, output=output, stats=stats, max_context=max_context,
                      clock=clock, **extra)


def run(gen: Generation) -> tuple[list[generate_pb2.TokenChunk], generate_pb2.GenerationResult]:
    async def go():
        events = [e async for e in gen.run()]
        await gen.close()
        return events

    events = asyncio.run(go())
    assert events[-1].HasField("result") and all(e.HasField("chunk") for e in events[:-1])
    return [e.chunk for e in events[:-1]], events[-1].result


def tokens(chunks) -> list[int]:
    return list(itertools.chain.from_iterable(c.token_ids for c in chunks))


def test_commits_the_accepted_drafts_and_the_targets_token():
    cont = truth()
    guess = [t if i % 3 != 2 else EOS + 99 for i, t in enumerate(cont)]  # every third guess wrong
    target, draft = FakeTarget(cont), FakeDraft(guess)
    gen = generation(target, draft, k=3, max_new=20)
    chunks, result = run(gen)
    assert tokens(chunks) == cont[:20] and result.finish_reason == FR.FINISH_REASON_LENGTH
    # Each round: K = 3 drafts from position p (p = 0 mod 3), of which 2 are right, so 3 tokens per round;
    # the last round has 2 tokens of budget left: K = 1.
    assert all(len(c.token_ids) == 3 for c in chunks[:-1]) and len(chunks) == 7
    assert [r.accepted for r in gen.stats.records] == [2] * 6 + [1]
    assert [r.drafts for r in gen.stats.records] == [3] * 6 + [1]
    s = result.stats
    assert (s.rounds, s.draft_tokens, s.accepted_tokens, s.generated_tokens) == (7, 19, 13, 20)
    assert s.proposer == "draft_model" and s.num_speculative_tokens == 3 and target.closed
    assert "".join(c.text for c in chunks) == Tokenizer().decode(cont[:20])


def test_eos_inside_an_accepted_block_ends_there():
    cont = truth()
    cont[5] = EOS
    target, draft = FakeTarget(cont), FakeDraft(cont)  # every draft right: EOS arrives as an accepted draft
    chunks, result = run(generation(target, draft, k=4, max_new=20, eos={EOS}))
    assert tokens(chunks) == cont[:6] and result.finish_reason == FR.FINISH_REASON_EOS
    assert target.calls[1] == cont[5:9]  # the second round's drafts run past EOS; what follows it is dropped
    assert result.stats.generated_tokens == 6


def test_a_stop_string_across_rounds_is_cut_and_never_streamed():
    cont = truth()
    text = Tokenizer().decode(cont)
    stop = text[4:6]  # the 5th and 6th tokens' letters: round 1 commits tokens 1-4 (K=3), round 2 tokens 5-8
    target, draft = FakeTarget(cont), FakeDraft(cont)
    chunks, result = run(generation(target, draft, k=3, max_new=20, stop=[stop]))
    assert result.finish_reason == FR.FINISH_REASON_STOP
    assert tokens(chunks) == cont[:6]  # up to the token that completes the stop string
    assert "".join(c.text for c in chunks) == text[:4]
    assert stop[0] not in chunks[0].text  # the held-back character was not streamed before the match


def test_k_is_clamped_to_the_token_budget_and_the_context():
    cont = truth()
    target, draft = FakeTarget(cont), FakeDraft(cont)
    chunks, result = run(generation(target, draft, k=8, max_new=5))
    assert [len(d) for d in target.calls] == [4] and tokens(chunks) == cont[:5]  # K = remaining - 1
    assert result.finish_reason == FR.FINISH_REASON_LENGTH

    target, draft = FakeTarget(cont), FakeDraft(cont)
    chunks, result = run(generation(target, draft, k=8, max_new=50, max_context=len(PROMPT) + 7))
    assert [len(d) for d in target.calls] == [6] and tokens(chunks) == cont[:7]  # K = room - 1
    assert result.finish_reason == FR.FINISH_REASON_CONTEXT


def test_rounds_the_speculation_cache_had_ready_are_counted_with_the_time_saved():
    cont = truth()
    # hit: the draft is always right, so every round after the first was pre-drafted
    target, draft = FakeTarget(cont), FakeDraft(cont, cache=True)
    gen = generation(target, draft, k=3, max_new=20)
    chunks, result = run(gen)
    assert tokens(chunks) == cont[:20]
    assert result.stats.overlapped_rounds == result.stats.rounds - 1 > 0
    assert [r.overlapped for r in gen.stats.records] == [False] + [True] * (result.stats.rounds - 1)
    assert result.stats.overlap_saved_ms == pytest.approx(0.9 * (result.stats.rounds - 1))

    # miss: the draft's guess of every bonus token (each 4th token) is wrong: nothing was ready
    guess = [t if i % 4 != 3 else 99 for i, t in enumerate(cont)]
    target, draft = FakeTarget(cont), FakeDraft(guess, cache=True)
    gen = generation(target, draft, k=3, max_new=20)
    chunks, result = run(gen)
    assert tokens(chunks) == cont[:20] and result.stats.overlapped_rounds == 0 == result.stats.overlap_saved_ms
    assert draft.proposed == result.stats.rounds


def test_a_round_that_runs_on_asks_the_draft_for_no_pre_drafting():
    """With the speculation cache (--overlap), a chain is asked as a tree of branching 1 with `speculate` outcomes
    to pre-draft the next round for; a round that runs on asks a plain chain with none, since the next round starts
    past the target's own run-on tokens, which no pre-drafted outcome holds."""
    from coordinator.proposers.draft_tree import DraftTreeConfig, DraftTrees
    from coordinator.proposers.strategy import Prediction
    from specdec.core.prefix import PrefixHashes

    cont = truth()
    draft = FakeDraft(cont)
    trees = DraftTrees(DraftTreeConfig(speculate=4), 0.9)
    strategy = DraftModelStrategy(DraftModelConfig(), draft, common_pb2.SamplingParams(), 1, RoundStats(), trees=trees,
                                  push=True)
    committed = list(PROMPT)
    for run_on in (0, 3):
        choice = Prediction(strategy, k=2, tokens=2.0, cost_ms=10.0, run_on=run_on)
        proposal = asyncio.run(strategy.propose(choice, committed, PrefixHashes(committed)))
        assert proposal.tokens == cont[:2]
    plain, running_on = draft.requests
    assert (plain.speculate, plain.push, plain.tree_branching, plain.tree_nodes) == (4, True, 1, 2)
    assert (running_on.speculate, running_on.push, running_on.tree_nodes, running_on.num_tokens) == (0, False, 0, 2)


def test_a_failed_draft_tier_falls_back_to_prompt_lookup():
    cont = [3, 4] * 20  # the prompt's own n-grams continue it: prompt lookup proposes it right
    prompt = [1, 2, 3, 4]
    target, draft = FakeTarget(cont), FakeDraft(cont, fail=True)
    gen = generation(target, draft, k=3, max_new=12, prompt=prompt)
    chunks, result = run(gen)
    assert tokens(chunks) == cont[:12]
    records = gen.stats.records
    assert draft.proposed == 1 and all(r.fallback for r in records)
    assert records[0].proposer == PROMPT_LOOKUP and sum(r.accepted for r in records) > 0


@pytest.mark.parametrize("open_sessions, k, asked", [(1, None, True), (2, None, False), (2, 3, True)])
def test_the_draft_model_is_asked_only_while_few_sessions_share_the_target(open_sessions, k, asked):
    """DraftModelConfig.max_sessions = 1 (tiers on shared cores): with another generation open on the
    target, adaptive K leaves the draft model alone; a request's own K still gets its drafts. The output
    is the target's either way."""
    cont = truth()
    load = TierCost()
    load.live = open_sessions
    target, draft = FakeTarget(cont), FakeDraft(cont)
    gen = generation(target, draft, k=k, max_new=12, draft_config=DraftModelConfig(max_sessions=1), load=load)
    chunks, _ = run(gen)
    assert tokens(chunks) == cont[:12]
    assert (draft.proposed > 0) == asked
    if not asked:
        assert all(not calls for calls in target.calls)  # nothing local to offer here: target-only rounds


def test_the_target_verifier_counts_the_sessions_open_on_the_target():
    class Session:
        async def close(self) -> None:
            pass

    load = TierCost()
    a = TargetVerifier(Session(), common_pb2.SamplingParams(), 1, RoundStats(), load)
    b = TargetVerifier(Session(), common_pb2.SamplingParams(), 2, RoundStats(), load)
    assert load.live == 2
    asyncio.run(a.close())
    asyncio.run(a.close())  # closing twice counts once
    assert load.live == 1
    asyncio.run(b.close())
    assert load.live == 0


def test_a_failed_target_fails_the_generation():
    cont = truth()
    target, draft = FakeTarget(cont, fail_on_call=2), FakeDraft(cont)
    gen = generation(target, draft, k=3, max_new=20)

    async def go():
        seen = []
        with pytest.raises(TierError) as e:
            async for event in gen.run():
                seen.append(event)
        await gen.close()
        return seen, e.value

    seen, error = asyncio.run(go())
    assert error.code == grpc.StatusCode.UNAVAILABLE and error.tier == "target"
    assert len(seen) == 1 and list(seen[0].chunk.token_ids) == cont[:4]  # round 1 streamed, then the failure
    assert target.closed


class FakeConstraint:
    """A grammar that forces the first two tokens, then allows only the first draft of each proposal."""

    def __init__(self, forced: list[int]) -> None:
        self.to_force, self.committed, self.checked = list(forced), [], []

    def forced(self, limit: int) -> list[int]:
        out, self.to_force = self.to_force[:limit], self.to_force[limit:]
        self.committed += out
        return out

    def check(self, proposal: Proposal, greedy: bool):
        self.checked.append(list(proposal.tokens))
        proposal.tokens = proposal.tokens[:1]
        return proposal, [b"mask"] * (len(proposal.tokens) + 1)

    def commit(self, tokens: list[int]) -> None:
        self.committed += tokens


def test_structured_output_forced_tokens_skip_the_tiers_and_the_masks_reach_the_target():
    t = truth()
    target, constraint = FakeTarget(t), FakeConstraint(t[:2])
    chunks, result = run(generation(target, FakeDraft(t), k=3, max_new=8, constraint=constraint))
    assert [list(c.token_ids) for c in chunks][0] == t[:2]  # the forced tokens, before any verify
    assert [tok for c in chunks for tok in c.token_ids] == t[:8] == constraint.committed
    assert all(len(d) <= 1 for d in target.calls) and all(len(m) == len(d) + 1 for d, m in zip(target.calls, target.masks))
    assert constraint.checked[0] == t[2:5]  # the draft's proposal, before the grammar cut it
    assert result.finish_reason == FR.FINISH_REASON_LENGTH


def test_target_only_rounds_let_the_target_run_on_more_as_they_follow_one_another():
    cont = truth()
    target = FakeTarget(cont)
    chunks, result = run(generation(target, k=0, max_new=30))
    assert tokens(chunks) == cont[:30] and result.finish_reason == FR.FINISH_REASON_LENGTH
    assert target.run_ons == [0, 1, 3, 7, 8, 5]  # never on the first token; doubling to the cap; the last cut to the budget
    assert [len(c.token_ids) for c in chunks] == [1, 2, 4, 8, 9, 6] and result.stats.rounds == 6

    cont[9] = EOS  # inside the fourth round's run-on
    target = FakeTarget(cont)
    chunks, result = run(generation(target, k=0, max_new=30, eos={EOS}))
    assert tokens(chunks) == cont[:10] and result.finish_reason == FR.FINISH_REASON_EOS

    text = Tokenizer().decode(cont)
    target = FakeTarget(truth())
    chunks, result = run(generation(target, k=0, max_new=30, stop=[text[5:7]]))  # a stop string inside a run-on
    assert tokens(chunks) == cont[:7] and result.finish_reason == FR.FINISH_REASON_STOP


def test_a_request_that_never_drafts_indexes_nothing():
    """K = 0 throughout: no strategy starts, so the prompt lookup standing by indexes neither the prompt nor the
    output (py-spy put them at 5-7% of the coordinator's samples for 64-token requests at 32 clients); a request
    that drafts has it indexed by the first commit."""
    gen = generation(FakeTarget(truth()), k=0, max_new=30)
    chunks, _ = run(gen)
    assert len(tokens(chunks)) == 30 and gen.drafter.fallback.index.tokens == [] and not gen.drafter.fallback.ready
    gen = generation(FakeTarget(truth()), k=3, max_new=30, proposer=PROMPT_LOOKUP)
    chunks, _ = run(gen)
    assert gen.drafter.fallback.index.tokens == PROMPT + tokens(chunks)


def test_a_round_with_drafts_starts_the_run_on_over():
    cont = list(range(5, 25)) + list(range(5, 17)) + list(range(100, 160))  # a repeat prompt lookup finds, then none
    target = FakeTarget(cont)
    chunks, _ = run(generation(target, k=3, max_new=70, proposer=PROMPT_LOOKUP))
    assert tokens(chunks) == cont[:70]
    drafted = [i for i, d in enumerate(target.calls) if d]
    assert drafted and target.run_ons[drafted[-1] + 1: drafted[-1] + 4] == [0, 1, 3]
    assert all(target.run_ons[i] == 0 for i in drafted)


def test_the_suffix_tree_indexes_the_prompt_beside_the_first_round():
    """The default request's strategies start (the suffix tree indexes the prompt) in a task of their own: the
    first round's verify goes out before it has run, a strategy not yet ready is not asked, and the prompt is
    indexed before anything is committed (from the second round the suffix strategy offers, and drafts once it
    has watched). The output is the target's own."""
    from coordinator.proposers.suffix import SuffixConfig, SuffixStrategy

    prompt = truth()[:40]  # the continuation repeats the prompt's cycle: suffix decoding finds it
    cont = truth(260)[40:]
    suffix = SuffixStrategy(SuffixConfig(), None, prompt)
    ready_at_verify = []

    class Target(FakeTarget):
        async def verify(self, committed, hashes, drafts, q, *args, **kw):
            ready_at_verify.append(suffix.ready)
            return await super().verify(committed, hashes, drafts, q, *args, **kw)

    params = GenerationParams(prompt_ids=prompt, max_new_tokens=60, sampling=SamplingParams(), seed=1,
                              num_speculative_tokens=None, proposer=DRAFT_MODEL)
    stats, lookup = RoundStats(clock=Clock()), LookupStrategy(LookupConfig(), prompt)
    drafter = Drafter(params, Policy(PolicyConfig(max_k=8)), [suffix], lookup, TierCost(), max_k=16)
    target = Target(cont)
    target.prompt_len = len(prompt)
    gen = Generation(params, target=target, drafter=drafter, output=Output(Tokenizer(), prompt, 60, set(), ()),
                     stats=stats, max_context=1000, clock=Clock())
    chunks, result = run(gen)
    assert tokens(chunks) == cont[:60]
    assert ready_at_verify[0] is False and all(ready_at_verify[1:])  # indexed beside the first round only
    assert result.stats.draft_tokens > 0  # and it drafts once it has watched


def test_a_probe_keeps_the_run_on_streak():
    """While K = 0 wins, the policy probes a K = 1 now and then (PolicyConfig.probe_every): a probe is K = 0's
    exploration, so it runs on as the target-only round it stands in for would, and those after it run on where
    the streak was, not from one token again."""
    cont = truth()
    target = FakeTarget(cont)
    chunks, result = run(generation(target, FakeDraft([c + 1 for c in cont]), k=None, max_new=150))  # every guess wrong
    assert tokens(chunks) == cont[:150]
    # (the first rounds draft on the prior's acceptance until the misses teach it; then K = 0 wins)
    probes = [i for i, d in enumerate(target.calls) if len(d) == 1 and i > 0 and not target.calls[i - 1]]
    assert probes  # a K = 1 after target-only rounds
    assert all(target.run_ons[i - 1] == target.run_ons[i] == target.run_ons[i + 1] == 8 for i in probes)  # the cap
