"""Run-on (VerifyRequest.run_on_seeds): a target-only round that decodes several tokens in one request is,
token for token, the target-only rounds it replaces.

1. In the engine, exactly: greedy, seeded sampling, and sampling with penalties and logprobs, one request that
   runs on for 11 tokens gives the tokens, log-probabilities and cache of 12 target-only rounds sent one by
   one with the same seeds; the session then goes on from there as if it had run them. Two run-on sessions
   batched with a verify of drafts give each one its solo result.
2. It stops after an EOS token and where the session's context is full, without error.
3. Through the real servers: a sampled, seeded generation at K = 0 streams the same tokens whatever the
   coordinator's run-on setting (PolicyConfig.run_on), the rounds fewer with it on; greedy equals the target's
   own generate(). (Bad requests: tests/test_bad_input_verify.py, run_on_*.)
4. In parts (VerifyRequest.run_on_part, PolicyConfig.run_on_part): the engine pushes each part ahead of its result,
   which is unchanged; the round loop emits each part's tokens; through the servers a stream gets exactly the
   chunks its parts make, and the same tokens.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from coordinator.proposers.policy import PolicyConfig
from specdec.client import Client
from specdec.core.prefix import PrefixHashes
from specdec.engine.config import StepConfig, TierConfig
from specdec.engine.engine import Engine
from specdec.engine.sessions import SessionStoreConfig
from specdec.engine.verify import CANDIDATES, VerifyWork
from specdec.math.params import SamplingParams
from specdec.math.seeds import TARGET_STREAM, derive_seed
from specdec.models import ModelConfig, TokenizerSource, load_model, load_tokenizer
from tests.helpers import Cluster, device_model, reference_greedy

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646]
SEED = 4242
PARAMS = {
    "greedy": SamplingParams(),
    "sampled": SamplingParams(temperature=0.9, top_p=0.95),
    "penalised": SamplingParams(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
}


@pytest.fixture(scope="module")
def parts(tiny_target):
    return load_model(device_model(tiny_target)), load_tokenizer(tiny_target)


def engine_of(parts, run_on_chain: bool = True, **sessions) -> Engine:
    model, tokenizer = parts
    engine = Engine(TierConfig(ModelConfig("tiny"), sessions=SessionStoreConfig(**sessions),
                               step=StepConfig(run_on_chain=run_on_chain)), model, TokenizerSource.of(tokenizer))
    engine.start()
    return engine


def seed_at(length: int) -> int:
    """The seed of the target-only round after `length` committed tokens, as the coordinator derives it."""
    return derive_seed(SEED, length, TARGET_STREAM)


def work(sid: str, committed: list[int], cached: int, params: SamplingParams, run_on: int = 0,
         logprobs: int = -1, drafts: list[int] = ()) -> VerifyWork:
    """The request after `committed`, of which the tier caches the first `cached`."""
    return VerifyWork.create(sid, cached, PrefixHashes(committed).at(cached), committed[cached:], list(drafts), None,
                             params, seed_at(len(committed)), prompt_len=len(PROMPT), logprobs=logprobs,
                             run_on_seeds=[seed_at(len(committed) + i) for i in range(1, run_on + 1)])


async def rounds(engine: Engine, sid: str, params: SamplingParams, n: int, logprobs: int = -1):
    """n target-only rounds, one request each: (tokens, logprobs, cached_len after each)."""
    committed, cached, tokens, reported, lengths = list(PROMPT), 0, [], [], []
    for _ in range(n):
        r = await engine.submit(work(sid, committed, cached, params, logprobs=logprobs))
        tokens.append(r.next_token)
        reported += r.logprobs
        committed.append(r.next_token)
        cached = r.cached_len
        lengths.append(r.cached_len)
    return tokens, reported, lengths


@pytest.mark.parametrize("chain", [True, False], ids=["chain", "steps"])
@pytest.mark.parametrize("name", list(PARAMS))
def test_one_request_that_runs_on_is_the_target_only_rounds_it_replaces(parts, name, chain):
    """(A greedy session stepping alone runs on as one chain on the device, StepConfig.run_on_chain: the same
    tokens and cache; the others, and every session with the chain off, step by step.)"""
    params, logprobs = PARAMS[name], 3 if name == "penalised" else -1
    engine = engine_of(parts, run_on_chain=chain)
    chains, wall = [], []

    async def scenario():
        expected, expected_lp, lengths = await rounds(engine, "one-by-one", params, 13, logprobs)
        chains.append(engine.chains)
        t0 = time.perf_counter()
        r = await engine.submit(work("run-on", list(PROMPT), 0, params, run_on=11, logprobs=logprobs))
        wall.append((time.perf_counter() - t0) * 1e3)
        chains.append(engine.chains)
        got = [r.next_token, *r.run_on]
        # The session goes on from where the run-on left it, as it would after the rounds.
        committed = PROMPT + got
        after = await engine.submit(work("run-on", committed, r.cached_len, params, logprobs=logprobs))
        return expected, expected_lp, lengths, r, got + [after.next_token], r.logprobs + after.logprobs

    try:
        expected, expected_lp, lengths, r, got, got_lp = asyncio.run(scenario())
    finally:
        engine.close()
    assert got == expected
    assert chains[1] - chains[0] == (1 if chain and name == "greedy" else 0)
    assert r.cached_len == lengths[11] == len(PROMPT) + 11  # every token but the last fed
    assert r.num_accepted == 0 and len(r.run_on) == 11
    # What it reports: its forwards within its own wall time, its step one forward (the policy prices a step from it)
    assert r.queue_ms >= 0 and r.step_ms <= r.compute_ms <= wall[0] + 0.01
    if logprobs >= 0:
        assert [(x.token_id, x.logprob, x.top_ids) for x in got_lp] == \
               [(x.token_id, x.logprob, x.top_ids) for x in expected_lp]
        assert len(got_lp) == 13
    else:
        assert got_lp == []


@pytest.mark.parametrize("name", ["greedy", "sampled"])
def test_a_run_on_in_parts_pushes_each_part_ahead_and_changes_no_token(parts, name):
    """run_on_part = 4: the work pushes the round's tokens known so far each time 4 more are and more are to come
    (next_token and 3, then 7 run-on tokens), ahead of its result, which is the one without parts; it steps one
    token at a time (no chain, even greedy and alone)."""
    params = PARAMS[name]
    engine = engine_of(parts)
    pushed = []

    async def scenario():
        plain = await engine.submit(work("plain", list(PROMPT), 0, params, run_on=11))
        w = work("parted", list(PROMPT), 0, params, run_on=11)
        w.part, w.on_push = 4, pushed.extend
        chains = engine.chains
        r = await engine.submit(w)
        return plain, r, engine.chains - chains

    try:
        plain, r, chains = asyncio.run(scenario())
    finally:
        engine.close()
    tokens = [r.next_token, *r.run_on]
    assert tokens == [plain.next_token, *plain.run_on] and len(tokens) == 12 and r.cached_len == plain.cached_len
    assert [[p.next_token, *p.run_on] for p in pushed] == [tokens[:4], tokens[:8]]
    assert all(p.num_accepted == 0 for p in pushed) and chains == 0


def test_a_run_on_in_parts_streams_each_part_and_runs_on_as_a_whole_result_does():
    """PolicyConfig.run_on_part = 4: a stream's rounds run on up to run_on_whole (32), and a round of more than 4
    tokens is emitted a part at a time as the target sends them (here: 40 tokens in rounds of 1, 2, 4, 8, 16, 9, in
    12 chunks), the tokens the target's own; with a stop string the stream's cap (8) and its parts, cut at the stop
    inside a part, the round's rest not emitted. (The round loop with a fake target: tests/test_round_loop.py's.)"""
    from tests.test_round_loop import FR, FakeTarget, Tokenizer, generation, run, tokens, truth

    cont = truth()
    target = FakeTarget(cont)
    chunks, result = run(generation(target, k=0, max_new=40, policy=PolicyConfig(max_k=8, run_on_part=4)))
    assert tokens(chunks) == cont[:40] and result.stats.rounds == 6
    assert target.run_ons == [0, 1, 3, 7, 15, 8]
    assert [len(c.token_ids) for c in chunks] == [1, 2, 4, 4, 4, 4, 4, 4, 4, 4, 4, 1]

    text = Tokenizer().decode(cont)
    target = FakeTarget(truth())
    chunks, result = run(generation(target, k=0, max_new=30, stop=[text[9:11]],  # inside the 4th round's first part
                                    policy=PolicyConfig(max_k=8, run_on_part=4)))
    assert target.run_ons == [0, 1, 3, 7]  # the stream's cap: the run-on of a stop-string request stays short
    assert tokens(chunks) == cont[:11] and result.finish_reason == FR.FINISH_REASON_STOP
    assert [len(c.token_ids) for c in chunks] == [1, 2, 4, 4]  # the part that held the stop, then nothing


def test_round_parts_yield_each_token_once_and_only_what_extends_them():
    """coordinator.tiers.target.RoundParts: parts repeat the earlier parts' tokens, and a retried call (another
    replica) sends its parts from the start again: each token is yielded once; a part that does not extend what was
    given (a replica that decoded otherwise) yields nothing; the verdict comes after every part delivered before it."""
    from coordinator.tiers.target import RoundParts, Verdict

    async def scenario():
        parts = RoundParts(2)
        verdict = Verdict(0, 5, wall_ms=1.0, run_on=(6, 7, 8, 9, 10))

        async def target():
            for tokens in ([5, 6], [5, 6, 7, 8], [5, 6], [5, 6, 7, 8], [5, 1, 2, 3, 4, 0], [5, 6, 7, 8, 9, 10]):
                parts.add(tokens)  # the second call from [5, 6] again; then a disagreeing part; then one more token
                await asyncio.sleep(0)
            return verdict

        got = [tokens async for tokens in parts.until(target())]
        return got, parts

    got, parts = asyncio.run(scenario())
    assert got == [[5, 6], [7, 8], [9, 10]] and parts.given == [5, 6, 7, 8, 9, 10]
    assert parts.verdict is not None and [5, *parts.verdict.run_on] == parts.given


def verify_then(sid: str, committed: list[int], cached: int, params: SamplingParams, drafts: list[int],
                parents: list[int] | None, seeds: list[int], logprobs: int = -1) -> VerifyWork:
    """A verify of drafts (a chain, or a tree of candidates) after `committed` that runs on with `seeds`."""
    return VerifyWork.create(sid, cached, PrefixHashes(committed).at(cached), committed[cached:], drafts, None, params,
                             seed_at(len(committed)), prompt_len=len(PROMPT), logprobs=logprobs, parents=parents,
                             scheme=CANDIDATES if parents else "", run_on_seeds=seeds)


@pytest.mark.parametrize("name,shape", [(n, s) for n in PARAMS for s in ("chain", "tree")
                                        if not (s == "tree" and PARAMS[n].penalized)])  # (trees take no penalties)
def test_a_verify_that_runs_on_is_its_verdict_then_the_target_only_rounds(parts, name, shape):
    """A drafting round may run on too: its verdict on the drafts (a tree's path moved into place), then one
    target-only round per seed, exactly as if each were its own request, logprobs and cache included."""
    params, logprobs = PARAMS[name], 3 if name == "penalised" else -1
    engine = engine_of(parts)

    async def scenario():
        greedy, _, _ = await rounds(engine, "greedy", PARAMS["greedy"], 3)
        wrong = (greedy[2] + 1) % 1000
        if shape == "chain":  # two right (greedily), the third wrong
            drafts, parents = [greedy[0], greedy[1], wrong], None
        else:  # the root's right child is the second; below it the right token second again
            drafts, parents = [wrong, greedy[0], wrong, greedy[1]], [-1, -1, 1, 1]
        seeds = [seed_at(len(PROMPT)) + 1000 + i for i in range(5)]
        # Apart: the verify alone, then a target-only round per seed
        first = await engine.submit(verify_then("apart", list(PROMPT), 0, params, drafts, parents, [], logprobs))
        kept = [drafts[j] for j in (first.path if parents else range(first.num_accepted))]
        committed, cached, tokens, reported = PROMPT + kept + [first.next_token], first.cached_len, [], list(first.logprobs)
        for s in seeds:
            r = await engine.submit(VerifyWork.create("apart", cached, PrefixHashes(committed).at(cached),
                                                      committed[cached:], [], None, params, s, prompt_len=len(PROMPT),
                                                      logprobs=logprobs))
            tokens.append(r.next_token)
            reported += r.logprobs
            committed, cached = committed + [r.next_token], r.cached_len
        # Together: one request
        both = await engine.submit(verify_then("together", list(PROMPT), 0, params, drafts, parents, seeds, logprobs))
        after = [await engine.submit(work(sid, c, n, params)) for sid, c, n in
                 (("apart", committed, cached), ("together", PROMPT + kept + [both.next_token, *both.run_on], both.cached_len))]
        return first, tokens, reported, cached, both, after

    try:
        first, tokens, reported, cached, both, after = asyncio.run(scenario())
    finally:
        engine.close()
    assert (both.num_accepted, both.path, both.tree, both.next_token) == \
           (first.num_accepted, first.path, first.tree, first.next_token)
    assert both.tree == (shape == "tree") and (name != "greedy" or both.num_accepted == 2)
    assert list(both.run_on) == tokens and both.cached_len == cached
    assert [(x.token_id, x.logprob, x.top_ids) for x in both.logprobs] == [(x.token_id, x.logprob, x.top_ids) for x in reported]
    assert after[0].next_token == after[1].next_token  # the session goes on from the same cache


def test_run_on_sessions_batch_with_others_and_keep_their_solo_results(parts):
    solo_engine = engine_of(parts)
    try:
        solo = [asyncio.run(solo_engine.submit(work(f"solo-{name}", list(PROMPT), 0, PARAMS[name], run_on=6)))
                for name in ("greedy", "sampled")]
        verify_alone = asyncio.run(solo_engine.submit(work("solo-drafts", PROMPT[:5], 0, PARAMS["sampled"],
                                                           drafts=[5, 6, 7])))
    finally:
        solo_engine.close()
    engine = engine_of(parts)

    async def together():
        with engine.paused():  # all three in the inbox before the first step
            tasks = [asyncio.ensure_future(engine.submit(w)) for w in (
                work("greedy", list(PROMPT), 0, PARAMS["greedy"], run_on=6),
                work("sampled", list(PROMPT), 0, PARAMS["sampled"], run_on=6),
                work("drafts", PROMPT[:5], 0, PARAMS["sampled"], drafts=[5, 6, 7]))]
            await asyncio.sleep(0)
        return await asyncio.gather(*tasks)

    steps = engine.steps
    try:
        greedy, sampled, drafts = asyncio.run(together())
    finally:
        engine.close()
    for got, alone in zip((greedy, sampled), solo):
        assert (got.next_token, got.run_on, got.cached_len) == (alone.next_token, alone.run_on, alone.cached_len)
    assert (drafts.num_accepted, drafts.next_token) == (verify_alone.num_accepted, verify_alone.next_token)
    assert drafts.batch_sessions == 3, "the verify of drafts shared its step with both run-on sessions"
    assert engine.steps - steps == 7  # the first step for all three, then one step per run-on token
    # Each reply names the step its batch figures describe, the same number for every session that step batched
    assert drafts.step_id == engine.step_base + steps + 1
    assert greedy.step_id == sampled.step_id == engine.step_base + engine.steps != drafts.step_id


def test_run_on_stops_after_eos_and_at_the_end_of_the_context(parts):
    engine = engine_of(parts)
    try:
        tokens, _, _ = asyncio.run(rounds(engine, "reference", PARAMS["greedy"], 10))
        engine.eos_token_ids = {tokens[4]} - set(tokens[:4])  # the 5th token ends the output (if not earlier)
        r = asyncio.run(engine.submit(work("eos", list(PROMPT), 0, PARAMS["greedy"], run_on=9)))
    finally:
        engine.close()
    assert [r.next_token, *r.run_on] == tokens[:5] and r.cached_len == len(PROMPT) + 4
    assert engine.chains == 1  # greedy and alone: one chain of 9, its tokens after the EOS dropped

    engine = engine_of(parts, max_session_tokens=len(PROMPT) + 6)
    try:
        r = asyncio.run(engine.submit(work("full", list(PROMPT), 0, PARAMS["greedy"], run_on=20)))
    finally:
        engine.close()
    # The context holds 6 more tokens; the last one decoded needs no room (it is not fed).
    assert [r.next_token, *r.run_on] == tokens[:6] and r.cached_len == len(PROMPT) + 5
    assert engine.chains == 1  # one chain of the 5 forwards the context has room for


def target_only(tiny_target, **policy):
    """A target-only pipeline whose coordinator's policy is PolicyConfig(**policy), for a fixture to yield from."""
    cluster = Cluster(tiny_target, None, coordinator_overrides={"adaptive": PolicyConfig(**policy)})
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def run_on_off(tiny_target):
    """A target-only pipeline whose coordinator never lets the target run on."""
    yield from target_only(tiny_target, run_on=0)


@pytest.mark.servers
def test_through_the_servers_run_on_changes_no_token_only_the_rounds(self_draft_cluster, run_on_off, tiny_target_model):
    on, off = self_draft_cluster, run_on_off  # the run-on at its default (the draft tier is not asked at K = 0)
    ids = PROMPT + [30, 31, 32]
    request = dict(token_ids=ids, max_new_tokens=40, ignore_eos=True, num_speculative_tokens=0)
    sampled = dict(request, temperature=0.9, top_p=0.95, seed=77)
    outs = {}
    for name, cluster in (("on", on), ("off", off)):
        with Client(cluster.address) as client:
            outs[name] = (client.generate(**request), client.generate(**sampled))
    (greedy_on, sampled_on), (greedy_off, sampled_off) = outs["on"], outs["off"]
    assert greedy_on.token_ids == greedy_off.token_ids == reference_greedy(tiny_target_model, ids, 40, None)
    assert sampled_on.token_ids == sampled_off.token_ids
    assert greedy_off.stats["rounds"] == greedy_off.stats["target_forwards"] == 40
    assert greedy_on.stats["target_forwards"] == 40 and greedy_on.stats["mean_tokens_per_forward"] == 1.0
    assert greedy_on.stats["rounds"] == sampled_on.stats["rounds"] == 7  # 1 + 2 + 4 + 8 + 9 + 9 + 7 tokens: the run-on
    #                                     grows 0, 1, 3, 7 up to the default cap, 8, and the last round is cut to the budget


@pytest.fixture(scope="module")
def probing_on_schedule(tiny_target, tiny_random_draft):
    """An unrelated random draft, and a policy that probes it on its schedule alone (a budget of all the time)."""
    cluster = Cluster(tiny_target, tiny_random_draft, coordinator_overrides={"adaptive": PolicyConfig(probe_budget=1.0)})
    yield cluster
    cluster.close()


@pytest.mark.servers
def test_through_the_servers_a_drafting_round_runs_on_and_changes_no_token(probing_on_schedule, tiny_target_model):
    """The draft model alone, adaptive, a draft the target never agrees with: K = 0 wins, its rounds run on 1, 2,
    4, 8 then 9 tokens (51 in 8 rounds), then the policy probes a K = 1, which runs on as the K = 0 round it
    stands in for would (9 tokens: 1 + 8, its draft rejected), and the ramp goes on: 60 tokens left, 7 rounds. 16
    rounds in all (17 had the probe committed one token); greedy, the target's own output. (Whether the default
    budget, PolicyConfig.probe_budget, covers this probe depends on the machine's timings: tests/test_policy.py
    checks the budget with set prices.)"""
    ids = PROMPT + [30, 31, 32]
    with Client(probing_on_schedule.address) as client:
        out = client.generate(token_ids=ids, max_new_tokens=120, ignore_eos=True, proposer="draft")
    assert out.token_ids == reference_greedy(tiny_target_model, ids, 120, None)
    assert (out.stats["draft_tokens"], out.stats["accepted_tokens"], out.stats["target_forwards"]) == (1, 0, 120)
    assert out.stats["rounds"] == 16


@pytest.mark.servers
def test_a_whole_result_request_runs_on_further_and_changes_no_token(self_draft_cluster, tiny_target_model):
    """GenerateRequest.whole_result (OpenAI's stream false): no reader waits on the rounds, so the run-on grows to
    PolicyConfig.run_on_whole (32) instead of run_on (8): 40 tokens in 6 rounds (1 + 2 + 4 + 8 + 16 + 9) instead
    of 7, greedy and seeded sampling giving the same tokens."""
    ids = PROMPT + [30, 31, 32]
    request = dict(token_ids=ids, max_new_tokens=40, ignore_eos=True, num_speculative_tokens=0)
    outs = {}
    with Client(self_draft_cluster.address) as client:
        for whole in (False, True):
            outs[whole] = [client.generate(**request, whole_result=whole, **sampling)
                           for sampling in ({}, {"temperature": 0.9, "top_p": 0.95, "seed": 77})]
    assert outs[True][0].token_ids == outs[False][0].token_ids == reference_greedy(tiny_target_model, ids, 40, None)
    assert outs[True][1].token_ids == outs[False][1].token_ids
    assert [o.stats["rounds"] for o in outs[False]] == [7, 7] and [o.stats["rounds"] for o in outs[True]] == [6, 6]
    assert outs[True][0].stats["target_forwards"] == 40
    # With a stop string (here one the output never holds) the run-on stays the stream's: past a stop string, which
    # only the coordinator sees, a long run-on would be steps wasted.
    with Client(self_draft_cluster.address) as client:
        stopped = client.generate(**request, whole_result=True, stop=["never in this output"])
    assert stopped.token_ids == outs[False][0].token_ids and stopped.stats["rounds"] == 7


@pytest.fixture(scope="module")
def run_on_in_parts(tiny_target):
    """A target-only pipeline whose streams get their run-on in parts of 4 tokens (so it grows to run_on_whole)."""
    yield from target_only(tiny_target, run_on_part=4)


@pytest.mark.servers
def test_a_stream_gets_its_run_on_in_parts_and_no_token_changes(run_on_in_parts, run_on_off, tiny_target_model):
    """With parts of 4 a stream's run-on grows as a whole result's does (32 at most: 40 tokens in rounds of 1, 2, 4,
    8, 16 and 9), and every round of more than 4 tokens reaches the client in parts as the target decodes them:
    the round of 8 in 2 chunks, of 16 in 4, of 9 in 3; 12 chunks for 6 rounds. Greedy and seeded sampling give the
    tokens of one-token rounds; asked for logprobs a stream gets no parts, and its run-on stays the stream's (8)."""
    ids = PROMPT + [30, 31, 32]
    request = dict(token_ids=ids, max_new_tokens=40, ignore_eos=True, num_speculative_tokens=0)
    with Client(run_on_off.address) as client:
        reference = [client.generate(**request, **sampling).token_ids
                     for sampling in ({}, {"temperature": 0.9, "top_p": 0.95, "seed": 77})]
    assert reference[0] == reference_greedy(tiny_target_model, ids, 40, None)
    with Client(run_on_in_parts.address) as client:
        for sampling, want in zip(({}, {"temperature": 0.9, "top_p": 0.95, "seed": 77}), reference):
            events = list(client.stream(**request, **sampling))
            chunks = [list(e.chunk.token_ids) for e in events if e.HasField("chunk") and e.chunk.token_ids]
            stats = events[-1].result.stats
            assert [t for c in chunks for t in c] == want
            assert (stats.rounds, len(chunks)) == (6, 12)
            assert [len(c) for c in chunks] == [1, 2, 4, 4, 4, 4, 4, 4, 4, 4, 4, 1]
        logged = client.generate(**request, logprobs=True)
    assert logged.token_ids == reference[0] and logged.stats["rounds"] == 7


def test_the_openai_apis_unstreamed_requests_are_whole_results_and_run_ons_are_bounded():
    from coordinator.api.openai_schema import ChatCompletionRequest, CompletionRequest

    chat = dict(model="m", messages=[{"role": "user", "content": "hi"}])
    assert [ChatCompletionRequest(**chat, stream=s).to_generate_requests()[0].whole_result for s in (False, True)] == \
           [True, False]
    assert [CompletionRequest(model="m", prompt="hi", stream=s).to_generate_requests()[0].whole_result
            for s in (False, True)] == [True, False]
    for name in ("run_on", "run_on_whole"):
        with pytest.raises(ValueError, match=name):
            PolicyConfig(**{name: 65})  # past the target's limit (specdec.core.limits.MAX_RUN_ON)
        assert getattr(PolicyConfig(**{name: 64}), name) == 64
