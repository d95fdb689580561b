"""Batching inside the tiers changes no session's output.

1. Through real servers: 16 concurrent generations with different prompt lengths, K (0, 1, 4,
   adaptive), proposers and temperatures (greedy, and seeded sampling at T = 0.7 with top-p) give
   exactly what each gives alone (adaptive K with greedy sessions only: see SESSIONS), and the greedy ones equal the target's own generate(). The tiers'
   step counters prove the work really was batched (fewer target steps than verify rounds).
2. In the engine itself, deterministically (the step loop starts after every work is queued): one
   step holding eight sessions, one with a wrong prefix fingerprint and one whose caller cancelled,
   settles those two alone and gives the other six exactly their solo results.
3. Chunked prefill: a long prompt is fed over several steps while a short session finishes in the
   first; the long one's output is unchanged.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from specdec.client import Client
from specdec.engine.config import BatchConfig, TierConfig
from specdec.engine.engine import Engine
from specdec.engine.verify import VerifyWork
from specdec.math.params import SamplingParams
from specdec.models import ModelConfig, TokenizerSource, load_model, load_tokenizer
from specdec.proto import common_pb2, target_pb2, target_pb2_grpc
from specdec.serving import draft_probs
from specdec.core.prefix import PrefixHashes
from specdec.core.errors import RequestError
from tests.helpers import Cluster, device_model, reference_greedy

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

VOCAB = 49152
MAX_NEW = 24


def prompt(i: int, n: int) -> list[int]:
    return [1] + [(1000 + 7919 * i + 104729 * j) % (VOCAB - 10) + 3 for j in range(n - 1)]


# 16 sessions: prompt lengths 4..49, and every mix of K, proposer and temperature. Adaptive K picks K
# from measured times, so a seeded sampled run with adaptive K draws differently from one run to the
# next (its distribution is still exact): the sampled sessions use fixed K, the greedy ones all four.
GREEDY_KS = [0, 1, 4, None]
SAMPLED_KS = [0, 1, 4]
PROPOSERS = ["draft", "lookup", "hybrid"]
SESSIONS = [
    dict(token_ids=prompt(i, 4 + 3 * i), max_new_tokens=MAX_NEW, proposer=PROPOSERS[i % 3], ignore_eos=True,
         **(dict(num_speculative_tokens=GREEDY_KS[(i // 2) % 4]) if i % 2 == 0 else
            dict(num_speculative_tokens=SAMPLED_KS[(i // 2) % 3], temperature=0.7, top_p=0.9, seed=100 + i)))
    for i in range(16)
]


def logit_gap_report(model, prompt_ids: list[int], a: list[int], b: list[int]) -> str:
    """Where two greedy outputs part, how far apart the target's top two logits are there."""
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt_ids + a[:at]])).logits[0, -1]
    top = torch.topk(logits, 2).values
    return f"outputs differ at token {at}: top-2 logit gap there {float(top[0] - top[1]):.3g}"


@pytest.fixture(scope="module")
def batch_cluster(tiny_target, tiny_random_draft):
    cluster = Cluster(tiny_target, tiny_random_draft)
    yield cluster
    cluster.close()


def test_sixteen_concurrent_sessions_equal_their_solo_runs(batch_cluster, tiny_target_model):
    with Client(batch_cluster.address) as client:
        solo = [client.generate(**s) for s in SESSIONS]
        steps_before = batch_cluster.status("target").steps
        with ThreadPoolExecutor(16) as pool:
            together = list(pool.map(lambda s: client.generate(**s), SESSIONS))
        steps = batch_cluster.status("target").steps - steps_before
    rounds = sum(o.stats["rounds"] for o in together)
    assert steps < rounds, f"{steps} target steps for {rounds} verify rounds: nothing was batched"
    for s, alone, batched in zip(SESSIONS, solo, together):
        if "temperature" not in s:
            expected = reference_greedy(tiny_target_model, s["token_ids"], MAX_NEW, None)
            assert alone.token_ids == expected, logit_gap_report(tiny_target_model, s["token_ids"], alone.token_ids, expected)
        assert batched.token_ids == alone.token_ids, (
            s, logit_gap_report(tiny_target_model, s["token_ids"], batched.token_ids, alone.token_ids))
    status = batch_cluster.status("target")
    assert status.kv_capacity_bytes > 0 and status.kv_capacity_tokens > 0
    assert status.step_tokens >= status.steps > 0


def test_a_bad_q_row_fails_alone_among_concurrent_verifies(batch_cluster):
    """Eight concurrent Verify calls, one with a malformed q row: INVALID_ARGUMENT for it, the
    other seven answer exactly as they do alone."""
    def request(i: int, bad: bool = False) -> target_pb2.VerifyRequest:
        ids = prompt(50 + i, 12)
        q = [draft_probs.row([5, 6], [0.5, 0.5]), draft_probs.row([5, 6], [0.5, 0.7 if bad else 0.5])]
        return target_pb2.VerifyRequest(
            context=common_pb2.SessionContext(session_id=f"qrow-{i}", prefix_len=0, new_tokens=ids),
            draft_tokens=[5, 6], q=q, sampling=common_pb2.SamplingParams(temperature=1.0), seed=7 + i)

    async def run(requests):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{batch_cluster.target_port}") as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            return await asyncio.gather(*(stub.Verify(r) for r in requests), return_exceptions=True)

    alone = [asyncio.run(run([request(i)]))[0] for i in range(8)]
    together = asyncio.run(run([request(i, bad=(i == 3)) for i in range(8)]))
    assert isinstance(together[3], grpc.aio.AioRpcError)
    assert together[3].code() == grpc.StatusCode.INVALID_ARGUMENT and "q[1].probs sum" in together[3].details()
    for i in range(8):
        if i != 3:
            assert (together[i].num_accepted, together[i].next_token) == (alone[i].num_accepted, alone[i].next_token)
    # Each reply names its step: the replies of one step agree on its figures, and counted once per id the steps'
    # sessions add up to the calls (what the coordinator's cost curve relies on); every call alone was a step of its own
    steps = {}
    for r in (together[i] for i in range(8) if i != 3):
        assert r.step_id and steps.setdefault(r.step_id, (r.batch_sessions, r.batch_tokens)) == (r.batch_sessions, r.batch_tokens)
    assert sum(sessions for sessions, _ in steps.values()) == 7
    assert len({r.step_id for r in alone}) == 8 and all(r.batch_sessions == 1 for r in alone)


# --- The engine itself ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_parts(tiny_target):
    return load_model(device_model(tiny_target)), load_tokenizer(tiny_target)


def fresh_engine(parts, **batch) -> Engine:
    model, tokenizer = parts
    return Engine(TierConfig(ModelConfig("tiny"), batch=BatchConfig(**batch)), model, TokenizerSource.of(tokenizer))


def verify_work(session_id: str, new_tokens: list[int], drafts: list[int], *, prefix: list[int] = (), seed: int = 0,
                greedy: bool = False, prefix_hash: int | None = None) -> VerifyWork:
    h = PrefixHashes(list(prefix)).at(len(prefix)) if prefix_hash is None else prefix_hash
    params = SamplingParams() if greedy else SamplingParams(temperature=0.7, top_p=0.9)
    return VerifyWork.create(session_id, len(prefix), h, new_tokens, drafts, None, params, seed)


async def run_batch(engine: Engine, works: list[VerifyWork], cancel: set[int] = frozenset()):
    """Queue every work while the step loop is paused: the next step plans them all together."""
    with engine.paused():
        tasks = [asyncio.ensure_future(engine.submit(w)) for w in works]
        await asyncio.sleep(0)  # each submit has put its work in the inbox
        for i in cancel:
            tasks[i].cancel()
        await asyncio.sleep(0)
    return await asyncio.gather(*tasks, return_exceptions=True)


def test_one_poisoned_batch_of_eight(engine_parts):
    sessions = [(f"s{i}", prompt(200 + i, 6 + i), [7 + i, 8 + i, 9 + i]) for i in range(8)]
    # The solo results, each on an engine of its own.
    solo = []
    for i, (sid, ids, drafts) in enumerate(sessions):
        engine = fresh_engine(engine_parts)
        engine.start()
        solo.append(asyncio.run(run_batch(engine, [verify_work(sid, ids, drafts, seed=i, greedy=i % 2 == 0)]))[0])
        engine.close()
    engine = fresh_engine(engine_parts)
    engine.start()

    async def scenario():
        # s5 exists with 4 cached tokens, but its next request names a different prefix.
        await engine.submit(verify_work("s5", sessions[5][1][:4], [], greedy=True))
        works = [verify_work(sid, ids, drafts, seed=i, greedy=i % 2 == 0) for i, (sid, ids, drafts) in enumerate(sessions)]
        works[5] = verify_work("s5", sessions[5][1][4:], sessions[5][2], prefix=sessions[5][1][:4], prefix_hash=12345)
        return await run_batch(engine, works, cancel={6})

    results = asyncio.run(scenario())
    engine.close()
    assert isinstance(results[5], RequestError) and results[5].code == grpc.StatusCode.FAILED_PRECONDITION
    assert "fingerprint" in results[5].message
    assert isinstance(results[6], asyncio.CancelledError)
    for i in (0, 1, 2, 3, 4, 7):
        r = results[i]
        assert (r.num_accepted, r.next_token, r.cached_len) == (solo[i].num_accepted, solo[i].next_token, solo[i].cached_len)
        assert r.batch_sessions == 6, "the six good sessions shared one step"
        assert solo[i].batch_sessions == 1


def test_chunked_prefill_spreads_a_long_prompt_and_never_stalls_a_short_one(engine_parts, tiny_target_model):
    long_prompt, short_prompt = prompt(300, 300), prompt(301, 5)
    engine = fresh_engine(engine_parts, prefill_chunk_tokens=32, max_batch_tokens=64)
    steps_before = engine.steps
    order: list[str] = []

    async def scenario():
        long_work = verify_work("long", long_prompt, [], greedy=True)
        short_work = verify_work("short", short_prompt, [], greedy=True)
        engine.start()
        with engine.paused():
            tasks = [asyncio.ensure_future(engine.submit(w)) for w in (long_work, short_work)]
            for name, task in zip(("long", "short"), tasks):
                task.add_done_callback(lambda _, name=name: order.append(name))
            await asyncio.sleep(0)
        return await asyncio.gather(*tasks), long_work

    (long_result, short_result), long_work = asyncio.run(scenario())
    engine.close()
    assert order == ["short", "long"]
    assert short_result.compute_ms < long_result.compute_ms
    assert engine.steps - steps_before == 300 // 32 + 1  # ten chunks; the short session rode in the first
    expected = reference_greedy(tiny_target_model, long_prompt, 1, None)
    assert long_result.next_token == expected[0]
    assert long_result.cached_len == 300


def test_steps_coalesce_sessions_that_come_back_quickly(engine_parts):
    """Two sessions each verify 12 rounds in a loop, sending the next request 1 ms and 20 ms after the
    last answer (as the coordinator does between a session's rounds). With coalescing the engine waits
    for both and runs ~one step per round for the two together; without it the quick one runs alone.
    Outputs are the same either way."""
    sessions = {"a": prompt(400, 6), "b": prompt(401, 9)}

    def run(coalesce_ms: float):
        engine = fresh_engine(engine_parts, coalesce_ms=coalesce_ms)
        engine.start()

        async def loop(sid, ids, pause_s):
            outs, prefix = [], []
            new = list(ids)
            for _ in range(12):
                r = await engine.submit(verify_work(sid, new, [], prefix=prefix, greedy=True))
                outs.append(r.next_token)
                prefix = prefix + new
                new = [r.next_token]
                await asyncio.sleep(pause_s)
            return outs

        async def both():
            return await asyncio.gather(loop("a", sessions["a"], 0.001), loop("b", sessions["b"], 0.020))

        before = engine.steps
        outs = asyncio.run(both())
        steps = engine.steps - before
        engine.close()
        return outs, steps

    coalesced, steps = run(coalesce_ms=500.0)  # far above the return gaps, however slow the machine
    alone, steps_alone = run(coalesce_ms=0.0)
    assert coalesced == alone
    assert steps <= 12 + 2, f"{steps} steps for 2 x 12 rounds (without coalescing {steps_alone}): no shared steps"
