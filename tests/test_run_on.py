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
from specdec.engine.verify import VerifyWork
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


@pytest.fixture(scope="module")
def run_on_off(tiny_target):
    """A target-only pipeline whose coordinator never lets the target run on."""
    cluster = Cluster(tiny_target, None, coordinator_overrides={"adaptive": PolicyConfig(run_on=0)})
    yield cluster
    cluster.close()


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
