"""Inline steps (StepConfig.inline_steps): a lone session's small step runs on the submitting event loop's thread
when the engine is idle, instead of being handed to the engine thread and its answer back.

1. In the engine, exactly: greedy and sampled target-only rounds and a run-on, and a draft's proposals, give the
   same results inline as through the engine thread, and each of those requests was one inline step; a prompt
   longer than an inline step is fed by the engine thread.
2. Under load nothing is inline: while a second session holds a slot, every step is the engine thread's, so
   sessions still share steps (batching).
3. Through the real servers, both tiers inline: greedy output is the target's own greedy decode, and the tiers
   did step inline.
4. An EAGLE-3 head's engine: a lone session's proposal inline is bitwise the engine thread's.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from specdec.client import Client
from specdec.core.prefix import PrefixHashes
from specdec.engine.config import StepConfig, TierConfig
from specdec.engine.engine import Engine
from specdec.engine.engine_thread import INLINE_TOKENS
from specdec.engine.propose import ProposeWork
from specdec.engine.verify import VerifyWork
from specdec.math.params import SamplingParams
from specdec.models import ModelConfig, TokenizerSource, load_model, load_tokenizer
from tests.helpers import Cluster, device_model, reference_greedy

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646]
PARAMS = {"greedy": SamplingParams(), "sampled": SamplingParams(temperature=0.9, top_p=0.95)}


@pytest.fixture(scope="module")
def parts(tiny_target):
    return load_model(device_model(tiny_target)), load_tokenizer(tiny_target)


def engine_of(parts, inline: str) -> Engine:
    model, tokenizer = parts
    engine = Engine(TierConfig(ModelConfig("tiny"), step=StepConfig(inline_steps=inline)), model,
                    TokenizerSource.of(tokenizer))
    engine.start()
    return engine


def verify(sid: str, committed: list[int], cached: int, params: SamplingParams, seed: int,
           run_on: int = 0) -> VerifyWork:
    return VerifyWork.create(sid, cached, PrefixHashes(committed).at(cached), committed[cached:], [], None, params,
                             seed, prompt_len=len(PROMPT), run_on_seeds=[seed + 1 + i for i in range(run_on)])


async def target_rounds(engine: Engine, sid: str, params: SamplingParams, prompt: list[int], n: int):
    """n target-only rounds and one that runs on for 5 tokens: every token, and the cache's length after each; then
    the session ends."""
    committed, cached, out = list(prompt), 0, []
    for i in range(n + 1):
        r = await engine.submit(verify(sid, committed, cached, params, seed=1000 + len(committed),
                                       run_on=5 if i == n else 0))
        got = [r.next_token, *r.run_on]
        committed += got
        cached = r.cached_len
        out.append((got, r.cached_len))
    engine.end_session(sid)
    return out


async def proposals(engine: Engine, sid: str, n: int, k: int = 3):
    """n greedy proposals of k drafts, each round committing the first draft and a fixed next token; then the
    session ends."""
    committed, cached, out = list(PROMPT), 0, []
    for i in range(n):
        w = ProposeWork.create(sid, cached, PrefixHashes(committed).at(cached), committed[cached:], k,
                               SamplingParams(), seed=7, top_n=16)
        r = await engine.submit(w)
        out.append(list(r.tokens))
        cached = len(committed)
        committed += [r.tokens[0], 100 + i]
    engine.end_session(sid)
    return out


@pytest.mark.parametrize("name", list(PARAMS))
def test_inline_steps_give_the_engine_threads_results(parts, name):
    results, counts = {}, {}
    for inline in ("off", "on"):
        for what, run in (("target", lambda e: target_rounds(e, "s", PARAMS[name], PROMPT, 6)),
                          ("draft", lambda e: proposals(e, "d", 5))):
            engine = engine_of(parts, inline)  # (one per phase: a sampled run-on ends on the engine thread)
            try:
                results[inline, what] = asyncio.run(run(engine))
                counts[inline, what] = engine.inline_steps
            finally:
                engine.close()
    for what in ("target", "draft"):
        assert results["on", what] == results["off", what]
        assert counts["off", what] == 0
    # Each request of the lone sessions was one inline step: a greedy run-on and the draft's later steps run as
    # one chain within it; a sampled run-on's later steps go on in the engine thread.
    assert counts["on", "target"] == 7 and counts["on", "draft"] == 5


def test_a_prompt_longer_than_an_inline_step_is_fed_by_the_engine_thread(parts):
    engine = engine_of(parts, "on")
    prompt = (PROMPT * 8)[: INLINE_TOKENS + 4]
    try:
        first = asyncio.run(engine.submit(verify("long", prompt, 0, PARAMS["greedy"], seed=1)))
        assert engine.inline_steps == 0  # its 20 tokens: the engine thread's step
        engine.end_session("long")
        out = asyncio.run(target_rounds(engine, "long", PARAMS["greedy"], prompt, 3))
    finally:
        engine.close()
    reference = engine_of(parts, "off")
    try:
        assert asyncio.run(target_rounds(reference, "long", PARAMS["greedy"], prompt, 3)) == out
    finally:
        reference.close()
    assert out[0][0][0] == first.next_token


def test_with_a_second_session_every_step_is_the_engine_threads(parts):
    engine = engine_of(parts, "on")

    async def scenario():
        g = PARAMS["greedy"]
        a1 = await engine.submit(verify("a", PROMPT, 0, g, seed=1))  # alone: inline
        inline_alone = engine.inline_steps
        b1 = await engine.submit(verify("b", PROMPT, 0, g, seed=1))  # "a" still holds its slot
        ca, cb = PROMPT + [a1.next_token], PROMPT + [b1.next_token]
        a2 = await engine.submit(verify("a", ca, a1.cached_len, g, seed=2))  # and "b" holds one
        inline_after = engine.inline_steps
        # Both sessions' next rounds, queued together, share one step of the engine thread.
        steps = engine.steps
        with engine.paused():
            tasks = [asyncio.ensure_future(engine.submit(w)) for w in (
                verify("a", ca + [a2.next_token], a2.cached_len, g, seed=3), verify("b", cb, b1.cached_len, g, seed=2))]
            await asyncio.sleep(0)
        both = await asyncio.gather(*tasks)
        return inline_alone, inline_after, engine.steps - steps, both

    try:
        inline_alone, inline_after, steps, both = asyncio.run(scenario())
    finally:
        engine.close()
    assert inline_alone == 1 and inline_after == 1
    assert steps == 1 and both[0].batch_sessions == 2


@pytest.mark.servers
def test_through_the_servers_both_tiers_inline_change_no_token(tiny_target, self_draft_cluster, tiny_target_model):
    """The target as its own draft (every draft accepted), both tiers stepping inline: greedy at K = 0, 2 and
    adaptive is the target's own; seeded sampling at K = 0, 2 and adaptive one output, the same cluster's stepping
    on its engine threads (the suite's tiers compute on two threads: auto leaves them off)."""
    inline = Cluster(tiny_target, tiny_target, step=StepConfig(inline_steps="on"))
    ids = PROMPT + [30, 31, 32]
    try:
        outs = {}
        for name, cluster in (("inline", inline), ("engine thread", self_draft_cluster)):
            with Client(cluster.address) as client:
                outs[name] = [client.generate(token_ids=ids, max_new_tokens=40, ignore_eos=True, num_speculative_tokens=k,
                                              proposer="draft", **sampling) for k in (0, 2, None)
                              for sampling in ({}, {"temperature": 0.9, "top_p": 0.95, "seed": 77})]
        assert inline.target_tier.inline_steps > 0 and inline.draft_tier.inline_steps > 0
        assert inline.target_tier.status().inline_steps == inline.target_tier.inline_steps  # (metrics read it)
        assert self_draft_cluster.target_tier.inline_steps == self_draft_cluster.draft_tier.inline_steps == 0
    finally:
        inline.close()
    expected = reference_greedy(tiny_target_model, ids, 40, None)
    assert all(out.token_ids == expected for out in outs["inline"][::2])  # the greedy ones
    seeded = [out.token_ids for name in outs for out in outs[name][1::2]]  # a seed's output, whatever K (the race)
    assert seeded == [seeded[0]] * 6 and seeded[0] != expected


def test_an_eagle3_heads_lone_proposal_inline_is_the_engine_threads(tiny_target, tiny_target_model, tmp_path):
    """The head's engine (one pass per proposal) steps a lone session inline too: seeded sampled proposals, bitwise
    the same tokens and q; with a second session holding its cache, on the engine thread."""
    from tests.test_head_engine import small_head_engine

    vocab, out = tiny_target_model.config.vocab_size, {}
    for inline in ("off", "on"):
        engine, one = small_head_engine(tiny_target, tiny_target_model, tmp_path, StepConfig(inline_steps=inline))

        async def run():
            alone = await one("alone", PROMPT, 7)
            counted = engine.inline_steps
            await one("second", PROMPT[:5], 3)  # "alone" still holds its cache: not alone any more
            return alone, counted, engine.inline_steps

        try:
            alone, counted, after = asyncio.run(run())
        finally:
            engine.close()
        out[inline] = (alone.tokens, alone.q.dense(vocab, "cpu"))
        assert (counted, after) == ((1, 1) if inline == "on" else (0, 0))
    assert out["on"][0] == out["off"][0] and torch.equal(out["on"][1], out["off"][1])
