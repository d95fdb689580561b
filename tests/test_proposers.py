"""Exact cases for prompt lookup, the estimates, and the strategies' predictions as the policy weighs them."""

import asyncio

import pytest

from coordinator.proposers.base import Proposal
from coordinator.proposers.estimates import Calibration, LinearCost, SharedPriors, expected_tokens
from coordinator.proposers.lookup import LookupConfig, LookupStrategy
from coordinator.proposers.ngram_index import NgramIndex
from specdec.core.proposer_names import DRAFT_MODEL, PROMPT_LOOKUP, SUFFIX
from coordinator.proposers.policy import Policy, PolicyConfig
from coordinator.proposers.strategy import Outcome
from coordinator.proposers.suffix import SuffixConfig, SuffixStrategy
from coordinator.proposers.tier_cost import TierCost
from tests.proposer_fakes import Offer, ask, draft, outcome, started

SOURCES = (SUFFIX, PROMPT_LOOKUP, DRAFT_MODEL)


def test_lookup_continues_latest_earlier_match_of_longest_suffix():
    idx = NgramIndex(LookupConfig(min_ngram=1, max_ngram=3), [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7])
    # suffix (6, 7): latest earlier occurrence ends at 8 -> continuation 2, 3, 6, 7
    assert idx.propose(2) == [2, 3]
    assert idx.propose(10) == [2, 3, 6, 7]
    idx.extend([2])
    # suffix (6, 7, 2) matched at length 3 -> continuation 3, 6, 7, 2
    assert idx.propose(3) == [3, 6, 7]


def test_lookup_prefers_longer_ngrams_and_respects_min():
    tokens = [1, 2, 3, 9, 4, 2, 3, 8, 4, 2, 3]
    # 3-gram (4, 2, 3) last seen ending at 7 -> [8, ...]; the 2-gram alone would give the same here
    assert NgramIndex(LookupConfig(1, 3), tokens).propose(1) == [8]
    # with only 2-grams: (2, 3) latest earlier ends at 7 -> 8
    assert NgramIndex(LookupConfig(2, 2), tokens).propose(2) == [8, 4]
    # min_ngram 2: a suffix whose 2-gram never occurred before gives nothing
    assert NgramIndex(LookupConfig(2, 4), [1, 2, 3, 4]).propose(3) == []
    assert NgramIndex(LookupConfig(1, 4), [1, 2, 3, 1]).propose(3) == [2, 3, 1]


def test_lookup_never_matches_the_suffix_itself_and_handles_short_sequences():
    assert NgramIndex(LookupConfig(1, 3), []).propose(4) == []
    assert NgramIndex(LookupConfig(1, 3), [7]).propose(4) == []
    assert NgramIndex(LookupConfig(1, 3), [7, 7]).propose(4) == [7]  # 1-gram (7,) earlier at 0 -> [7]
    assert NgramIndex(LookupConfig(1, 3), [1, 2]).propose(0) == []
    with pytest.raises(ValueError):
        NgramIndex(LookupConfig(3, 2))


def test_lookup_incremental_equals_fresh_index():
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    grown = NgramIndex(LookupConfig(1, 3), seq[:5])
    for i in range(5, len(seq)):
        grown.extend([seq[i]])
        assert grown.propose(4) == NgramIndex(LookupConfig(1, 3), seq[: i + 1]).propose(4)


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_linear_cost_recovers_a_line():
    cost = LinearCost(decay=0.95)
    assert cost.predict(5) == pytest.approx(0.0, abs=1e-5)  # nothing observed: no cost
    for _ in range(30):
        for k in (1, 3, 6):
            cost.observe(k, 40.0 + 5.0 * k)
    assert cost.predict(0) == pytest.approx(40.0, rel=0.1)
    assert cost.predict(8) == pytest.approx(80.0, rel=0.1)


# --- the strategies' predictions, as the policy weighs them ---------------------------------------------
# With nothing measured: acceptance 0.5 for every strategy, verify(K) = 53 + 3K ms (a step of K + 1 tokens
# on the target's prior curve), propose(K) = 0 for the model-free strategies and 1 + 5K ms for the draft, the
# suffix tree's estimate taken at face value.


def chosen(choice) -> tuple[str, int] | None:
    return None if choice is None else (choice.by.source, choice.k)


def offering(source: str, tokens, probs=(), **kw) -> Offer:
    s = Offer(source, **kw)
    s.next = Proposal(source, list(tokens), probs=list(probs))
    return s


def play(strategies, cost: TierCost, choice, n: int, *, propose_ms: float = 0.0, verify_ms: float = 50.0,
         catch_up: int = 1, accepted=None) -> None:
    """A verified round of `choice` (None: K = 0) with n drafts accepted, as the tiers would report it."""
    k = choice.k if choice is not None else 0
    source = choice.by.source if choice is not None else PROMPT_LOOKUP
    proposal = Proposal(source, [0] * k, wall_ms=propose_ms, k=k, catch_up=catch_up)
    if choice is not None and choice.by.source != DRAFT_MODEL:
        proposal = choice.by._offer
        proposal = Proposal(source, proposal.tokens[:k], probs=proposal.probs[:k])
    for s in strategies:
        s.observe(outcome(proposal, n, accepted, verify_ms))
    cost.observe(0, 0, 0.0, verify_ms, drafts=k)  # a tier without batch data: a step of its own


def _drive(acceptance: float, draft_ms_per_token: float, verify_ms: float, rounds: int = 60, probe_every: int = 8) -> list[int]:
    """The draft model alone: K per round."""
    policy, cost, d = Policy(PolicyConfig(max_k=8, probe_every=probe_every)), TierCost(), draft()
    ks = []
    for _ in range(rounds):
        choice = policy.choose([d], ask(cost))
        k = choice.k if choice else 0
        ks.append(k)
        play([d], cost, choice, round(k * acceptance), propose_ms=1.0 + draft_ms_per_token * k,
             verify_ms=verify_ms * (1 + 0.05 * k))
    return ks


def test_adaptive_k_grows_when_drafts_are_accepted_and_cheap():
    assert _drive(acceptance=1.0, draft_ms_per_token=0.0, verify_ms=50)[-10:] == [8] * 10


def test_adaptive_k_turns_speculation_off_when_it_cannot_pay_and_keeps_probing():
    tail = _drive(acceptance=0.0, draft_ms_per_token=8.0, verify_ms=50)[-32:]
    assert tail.count(0) >= 24  # mostly target-only
    assert 1 in tail  # but still probing


def _costly_draft(count_catch_up: bool) -> list[int]:
    """K per round for the target's own low-precision copy as the draft: always right, a draft token
    costs ~0.6 of a target step, and each call first catches up on the tokens the draft missed (a
    multi-token forward, ~6 ms per token: the prompt at first, then the rounds it sat out).
    count_catch_up: report those calls as steady ones (what the policy once did)."""
    policy, cost, d = Policy(PolicyConfig(max_k=8, probe_every=8)), TierCost(), draft()
    step, token = 42.0, 25.0  # target step, draft token (ms)
    ks, lag = [], 400
    for _ in range(80):
        choice = policy.choose([d], ask(cost))
        k = choice.k if choice else 0
        ks.append(k)
        play([d], cost, choice, k, propose_ms=1.0 + token * k + 6.0 * lag, verify_ms=step * (1 + 0.1 * k),
             catch_up=0 if count_catch_up else lag)
        lag = 2 if k else lag + 1  # the last draft and the bonus
    return ks


def test_a_costly_draft_that_pays_when_drafting_every_round_keeps_being_asked():
    """Catch-up calls are one-off costs and stay out of its time ratio; counted, they make the draft look
    dearer the less it is asked, until it is never asked (the adaptive self-draft ran at 0.75x the target
    alone that way; 1.12x without, docs/performance.md)."""
    ks = _costly_draft(count_catch_up=False)
    assert min(ks[-20:]) >= 4, ks  # long blocks, every round
    old = _costly_draft(count_catch_up=True)
    assert old[-20:].count(0) >= 15, old  # the trap: mostly target-only


def test_a_free_local_chain_beats_the_draft_round_trip():
    # lookup: E(K) / verify(K) = 1.5/56, 1.75/59, 1.875/62, 1.9375/65: K = 3 is best and beats the
    # draft's best (1.75 / 70 at K = 2) and K = 0 (1 / 53)
    lookup = offering(PROMPT_LOOKUP, [5, 6, 7, 8])
    assert chosen(Policy(PolicyConfig()).choose([lookup, draft()], ask())) == (PROMPT_LOOKUP, 3)


def test_the_draft_is_asked_only_when_its_rate_wins():
    policy, cost, d = Policy(PolicyConfig()), TierCost(), draft()
    nothing = [offering(SUFFIX, []), offering(PROMPT_LOOKUP, [])]
    assert chosen(policy.choose(nothing + [d], ask(cost))) == (DRAFT_MODEL, 2)  # 1.75/70 > 1.05/53
    assert policy.choose(nothing, ask(cost)) is None
    for _ in range(20):  # a draft that is measured to be rarely right is not asked
        play([d], cost, policy.choose([d], ask(cost)), 0, propose_ms=11.0, verify_ms=56.0)
    assert Policy(PolicyConfig()).choose(nothing + [d], ask(cost)) is None


def test_the_suffix_trees_probabilities_set_k():
    # E(K) = 1 + sum(probs[:K]): 2/56, 3/59, 4/62, 4.1/65, ...: K = 3
    suffix = offering(SUFFIX, [1, 2, 3, 4, 5, 6], [1.0, 1.0, 1.0, 0.1, 0.02, 0.004])
    assert chosen(Policy(PolicyConfig()).choose([suffix, draft()], ask())) == (SUFFIX, 3)
    lookup = offering(PROMPT_LOOKUP, [1, 2, 3, 4, 5, 6])  # the same chain at the prior acceptance: worth less
    assert chosen(Policy(PolicyConfig()).choose([suffix, lookup], ask())) == (SUFFIX, 3)


def test_a_suffix_tree_that_is_too_confident_is_discounted():
    policy, cost = Policy(PolicyConfig()), TierCost()
    suffix, lookup = offering(SUFFIX, [9, 9, 9, 9], [1.0] * 4), offering(PROMPT_LOOKUP, [1, 2, 3, 4])
    assert policy.choose([suffix, lookup], ask(cost)).by is suffix
    for _ in range(10):  # the tree promised 4 accepted tokens a round, the target took none (its token: 1)
        play([suffix, lookup], cost, policy.choose([suffix, lookup], ask(cost)), 0, accepted=[1])
    assert suffix.calibration(1.0) < 0.1  # drafts it called certain: right 1 time in 10 or less
    assert chosen(policy.choose([suffix, lookup], ask(cost)))[0] == PROMPT_LOOKUP  # judged right every round


def test_calibration_multiplies_calibrated_conditionals_down_each_path():
    """probs are running products: r = p / p_parent. Untaught, each r is read at its level's middle; a chain's
    chances are products along it, a tree's along each node's parents."""
    c = Calibration(0.9)
    mid = dict(zip(range(5), Calibration.middles()))  # 0.125, 0.375, 0.625, 0.85, 0.975
    assert c.chances([1.0, 1.0, 0.5]) == pytest.approx([mid[4], mid[4] ** 2, mid[4] ** 2 * mid[2]])  # r: 1, 1, 0.5
    tree = c.chances([0.6, 0.3, 0.6], parents=[-1, -1, 0])  # two children of the root (0.6, 0.3), one below the first
    assert tree == pytest.approx([mid[2], mid[1], mid[2] * mid[4]])


def test_calibration_learns_per_level_from_drafts_whose_parent_was_right():
    """Drafts the offer called certain (r = 1, a continuation seen once) that were right 1 time in 4, and
    drafts at r = 0.8 (a branch well trodden) right 4 times in 5: each level learns its own rate; a draft below
    a miss is not counted (it was never tried)."""
    c = Calibration(1.0)
    for right in ({0}, set(), set(), set()):  # a chain of 3 certain drafts: the first right once, then a miss
        c.observe([1.0, 1.0, 1.0], (), right)
    assert c(1.0) == pytest.approx((2 * 0.975 + 1) / (2 + 5))  # 4 first drafts and the one below the right one
    for right in ({0}, {0}, {0}, {0}, set()):
        c.observe([0.8], (), right)
    assert c(0.8) == pytest.approx((2 * 0.85 + 4) / (2 + 5)) and c(0.8) > 1.5 * c(1.0)
    tree = Calibration(1.0)
    tree.observe([0.6, 0.3, 0.6], [-1, -1, 0], {1})  # the second child held: the first missed, the one below it unseen
    assert tree.observations == 2 and tree(0.3) > Calibration.middles()[1] and tree(0.6) < Calibration.middles()[2]


def test_every_round_judges_the_offers_not_chosen():
    lookup, suffix = offering(PROMPT_LOOKUP, [5, 6, 7]), offering(SUFFIX, [9, 9], [1.0, 1.0])
    Policy(PolicyConfig()).choose([lookup, suffix], ask())  # the round's offers
    chosen_one = Proposal(PROMPT_LOOKUP, [5, 6, 7])
    for s in (lookup, suffix):
        s.observe(Outcome(chosen_one, [5, 6, 7, 8], range(3), 50.0))
    assert lookup.acceptance.value == pytest.approx((0.45 + 3) / (0.9 + 3))  # its own round: 3 of 3
    assert suffix.acceptance.value == pytest.approx(0.45 / 1.9)  # 0 of 2: one failed attempt
    assert suffix.calibration(1.0) == pytest.approx(0.9 * 2 * 0.975 / (0.9 * 2 + 1))  # its first draft missed (the second: not reached)
    Policy(PolicyConfig()).choose([lookup, suffix], ask())
    lookup.observe(Outcome(Proposal(PROMPT_LOOKUP, []), [5], (), 50.0))  # a target-only round: judged on its token
    assert lookup.acceptance.value == pytest.approx((3.45 * 0.9 + 1) / (3.9 * 0.9 + 1))
    sampled = offering(PROMPT_LOOKUP, [5, 6, 7], greedy=False)
    Policy(PolicyConfig()).choose([sampled], ask())
    sampled.observe(Outcome(Proposal(SUFFIX, [1]), [5, 6], range(1), 50.0))
    assert sampled.acceptance.attempts == 2  # sampled too: a one-hot offer matched with its acceptance's law


def test_a_cold_session_watches_its_offers_before_it_drafts():
    """With no taught prior a session's model-free strategy (greedy or sampled) judges `watch` drafts against
    the committed tokens (free) before it drafts; taught by earlier sessions, or asked for a fixed K, it drafts
    from the first round. The configs' default watch reaches the strategies."""
    target_only = Proposal(PROMPT_LOOKUP, [])
    lookup = offering(PROMPT_LOOKUP, [5, 6, 7], watch=2)
    for judged in (1, 2):
        assert lookup.predict(ask()) == []  # offered (to be judged), not drafted
        lookup.observe(Outcome(target_only, [5], (), 50.0))  # the target's token: its first draft right
        assert lookup.acceptance.attempts == judged
    assert [p.k for p in lookup.predict(ask())] == [1, 2, 3]  # two drafts judged: it drafts
    wrong = offering(PROMPT_LOOKUP, [5, 6, 7], watch=2)
    wrong.predict(ask())
    wrong.observe(Outcome(target_only, [4], (), 50.0))  # its first draft wrong: one attempt, a failure
    assert wrong.predict(ask()) == [] and wrong.acceptance.value < 0.5
    priors = SharedPriors()
    priors.learn(PROMPT_LOOKUP, True, acceptance=0.6)
    assert offering(PROMPT_LOOKUP, [5, 6, 7], watch=2, priors=priors).predict(ask())  # taught: no watch
    assert offering(PROMPT_LOOKUP, [5, 6, 7], watch=2, greedy=False).predict(ask()) == []  # sampled: watches too
    assert offering(PROMPT_LOOKUP, [5, 6, 7], watch=2).predict(ask(fixed=True))  # the request's own K
    cold = started(LookupStrategy(LookupConfig(min_ngram=1), [1, 2, 3, 1, 2]))
    assert cold.predict(ask()) == [] and cold._offer.tokens == [3, 1, 2]
    assert SuffixStrategy(SuffixConfig(), None).watch == LookupConfig().watch == 2


def test_a_fixed_k():
    policy, cost = Policy(PolicyConfig()), TierCost()
    for _ in range(20):  # target-only the better rate: it must not be chosen with a fixed K
        cost.observe(0, 0, 0.0, 60.0 + 20.0 * (_ % 4), drafts=_ % 4)
    lookup = offering(PROMPT_LOOKUP, [5, 6])
    assert chosen(policy.choose([lookup], ask(cost, 5, fixed=True))) == (PROMPT_LOOKUP, 2)  # all it has
    assert chosen(policy.choose([offering(PROMPT_LOOKUP, []), draft()], ask(cost, 5, fixed=True))) == (DRAFT_MODEL, 5)
    assert policy.choose([offering(PROMPT_LOOKUP, [])], ask(cost, 5, fixed=True)) is None
    assert policy.choose([lookup, draft()], ask(cost, 0, fixed=True)) is None


def test_sessions_start_from_what_earlier_sessions_learnt():
    """SharedPriors: a session's acceptance and ratio start where the coordinator's earlier sessions left
    them, kept apart for greedy and sampled sessions; a session that judged too few drafts teaches nothing."""
    priors, cost = SharedPriors(), TierCost()

    def session(greedy: bool = True):
        return [offering(SUFFIX, [1, 2, 3, 4], [1.0] * 4, greedy=greedy, priors=priors),
                offering(PROMPT_LOOKUP, [1, 2, 3, 4], greedy=greedy, priors=priors)]

    fresh = session()
    assert fresh[0].acceptance.value == 0.5 and fresh[0].calibration.values == Calibration.middles()  # nothing learnt yet
    assert chosen(Policy(PolicyConfig()).choose(fresh, ask(cost))) == (SUFFIX, 4)
    brief = session()
    play(brief, cost, Policy(PolicyConfig(max_k=1)).choose(brief, ask(cost, 1)), 0, accepted=[9])
    asyncio.run(close(brief))  # one judged draft each: below MIN_ATTEMPTS
    assert priors.get(SUFFIX, True, "calibration") is None
    for _ in range(3):  # sessions of open chat: the chains fail
        chat = session()
        for _ in range(6):
            play(chat, cost, Policy(PolicyConfig()).choose(chat, ask(cost)), 0, accepted=[9])
        asyncio.run(close(chat))
    assert priors.get(SUFFIX, True, "calibration")[-1] < 0.15 and priors.get(PROMPT_LOOKUP, True, "acceptance") < 0.15
    assert priors.get(SUFFIX, False, "calibration") is None  # sampled sessions: apart
    wary = session()  # (priced with nothing measured: verify(K) = 53 + 3K)
    assert Policy(PolicyConfig()).choose(wary, ask()) is None  # target only
    for _ in range(3):  # its own rounds outweigh the prior: the chains are right this time
        Policy(PolicyConfig()).choose(wary, ask())
        for s in wary:
            s.observe(outcome(Proposal(SUFFIX, []), 0, [1]))
    assert Policy(PolicyConfig()).choose(wary, ask()) is not None
    assert chosen(Policy(PolicyConfig()).choose(session(greedy=False), ask())) == (SUFFIX, 4)


async def close(strategies) -> None:
    for s in strategies:
        await s.close()
