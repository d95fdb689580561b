"""Prefix reuse across requests, end to end through real servers (tiny random models):

- a three-turn conversation gives the same output, token for token, greedy and seeded sampling, on tiers with
  the prefix cache (turns 2 and 3 start from the slots turn 1 and 2 left) and on tiers without it; the greedy
  turns equal the target's own generate();
- a second agent call with a shared 200-token system prompt has exactly those 200 tokens supplied by the
  prefix cache on both tiers, and the target feeds exactly 200 fewer tokens than without the cache;
- under memory pressure (3 slots, a small token budget, 6 concurrent sessions) retained prefixes are dropped and
  sessions evicted between rounds, and every output is still the one without a cache;
- with two replicas per tier, calls sharing a long prefix or a prompt_cache_key meet on one replica, which
  reuses it; when that replica dies, the conversation goes on on the other one with the same output.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from specdec.serving.routing import RoutingConfig
from specdec.client import Client
from specdec.engine.sessions import SessionStoreConfig
from tests.helpers import Cluster, reference_greedy
from tests.replicas import ReplicaCluster

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

VOCAB = 49152
MAX_NEW = 16


def tokens(seed: int, n: int) -> list[int]:
    return [(1000 + 7919 * seed + 104729 * j) % (VOCAB - 10) + 3 for j in range(n)]


SYSTEM = [1] + tokens(0, 199)  # a 200-token system prompt


def conversation(client: Client, turns: int, **kw) -> list[list[int]]:
    """Each turn's prompt is the last one, its output and a new user message; returns the outputs."""
    prompt, outputs = list(SYSTEM), []
    for turn in range(turns):
        prompt = prompt + tokens(100 + turn, 24)
        out = client.generate(token_ids=prompt, max_new_tokens=MAX_NEW, ignore_eos=True, **kw).token_ids
        outputs.append(out)
        prompt = prompt + out
    return outputs


GREEDY = dict(proposer="draft", num_speculative_tokens=3)
SAMPLED = dict(proposer="draft", num_speculative_tokens=3, temperature=0.8, top_p=0.95, seed=7)


@pytest.fixture(scope="module")
def warm(tiny_target, tiny_random_draft):
    cluster = Cluster(tiny_target, tiny_random_draft)
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def cold(tiny_target, tiny_random_draft):
    cluster = Cluster(tiny_target, tiny_random_draft, sessions=SessionStoreConfig(prefix_cache=False))
    yield cluster
    cluster.close()


@pytest.mark.parametrize("kw", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_conversation_with_a_warm_prefix_equals_one_without(warm, cold, tiny_target_model, kw):
    with Client(cold.address) as c:
        reference = conversation(c, 3, **kw)
    hits_before = warm.status("target").prefix_cache_hits, warm.status("draft").prefix_cache_hits
    with Client(warm.address) as c:
        assert conversation(c, 3, **kw) == reference
    # Turns 2 and 3 started from what turns 1 and 2 left (at least their prompts) on both tiers.
    at_least = (200 + 24) + (200 + 24 + MAX_NEW + 24)
    assert warm.status("target").prefix_cache_hits - hits_before[0] >= at_least
    assert warm.status("draft").prefix_cache_hits - hits_before[1] >= at_least
    assert cold.status("target").prefix_cache_hits == cold.status("draft").prefix_cache_hits == 0
    if kw is GREEDY:
        prompt = list(SYSTEM)
        for turn, out in enumerate(reference):
            prompt = prompt + tokens(100 + turn, 24)
            assert out == reference_greedy(tiny_target_model, prompt, MAX_NEW, None), f"turn {turn + 1}"
            prompt = prompt + out


def test_a_shared_system_prompt_is_prefilled_once(warm, cold):
    first, second = SYSTEM + tokens(200, 8), SYSTEM + tokens(201, 8)
    assert first[200] != second[200]
    outputs, fed = {}, {}
    for name, cluster in (("warm", warm), ("cold", cold)):
        with Client(cluster.address) as c:
            c.generate(token_ids=first, max_new_tokens=4, ignore_eos=True, **GREEDY)
            before = {t: cluster.status(t) for t in ("target", "draft")}
            outputs[name] = c.generate(token_ids=second, max_new_tokens=4, ignore_eos=True, **GREEDY).token_ids
            after = {t: cluster.status(t) for t in ("target", "draft")}
        for t in ("target", "draft"):
            hits = after[t].prefix_cache_hits - before[t].prefix_cache_hits
            assert hits == (200 if name == "warm" else 0), (name, t, hits)
        fed[name] = after["target"].step_tokens - before["target"].step_tokens
    assert outputs["warm"] == outputs["cold"]
    assert fed["cold"] - fed["warm"] == 200, fed  # the same rounds, less the shared prompt


def test_memory_pressure_only_makes_the_cache_miss(tiny_target, tiny_random_draft, cold):
    calls = [dict(token_ids=SYSTEM[:100] + tokens(300 + i, 12), max_new_tokens=MAX_NEW, ignore_eos=True,
                  **(GREEDY if i % 2 else SAMPLED)) for i in range(6)]
    with Client(cold.address) as c:
        reference = [c.generate(**kw).token_ids for kw in calls]
    tight = Cluster(tiny_target, tiny_random_draft, sessions=SessionStoreConfig(max_sessions=3, max_cached_tokens=300))
    try:
        with Client(tight.address) as c, ThreadPoolExecutor(6) as pool:
            for _ in range(2):
                assert list(pool.map(lambda kw: c.generate(**kw).token_ids, calls)) == reference
        target, draft = tight.wait_no_sessions()
        assert target.prefix_cache_hits > 0 and draft.prefix_cache_hits > 0  # some calls did start from a cached prefix
        assert target.prefix_cache_tokens <= 300 and draft.prefix_cache_tokens <= 300  # retained slots obey the budget
    finally:
        tight.close()


def test_routing_keys():
    config = RoutingConfig(prefix_tokens=64)
    long_a, long_b = SYSTEM + tokens(1, 5), SYSTEM + tokens(2, 9)
    assert config.routing_key("s1", long_a) == config.routing_key("s2", long_b) != "s1"
    assert config.routing_key("s1", tokens(3, 64) + SYSTEM) != config.routing_key("s1", long_a)
    assert config.routing_key("s1", SYSTEM[:64]) == "s1"  # not longer than prefix_tokens: its own session
    assert config.routing_key("s1", long_a, "conv-9") == config.routing_key("s2", tokens(4, 3), "conv-9") == "key:conv-9"
    assert RoutingConfig(prefix_tokens=0).routing_key("s1", long_a) == "s1"


TARGETS, DRAFTS = ["127.0.0.2", "127.0.0.3"], ["127.0.0.4", "127.0.0.5"]


def test_replicas_shared_prefixes_meet_on_one_replica_and_survive_its_death(tiny_target, tiny_random_draft,
                                                                             tiny_target_model):
    cluster = ReplicaCluster(tiny_target, tiny_random_draft, target_addresses=TARGETS, draft_addresses=DRAFTS)
    try:
        address = cluster.coordinator(routing=RoutingConfig(min_resolution_interval_s=0.2, prefix_tokens=128))
        targets = cluster.replicas["target"]
        # Agent calls: a shared 200-token prompt routes them all to one target replica, which reuses it.
        with Client(address) as c:
            for i in range(6):
                c.generate(token_ids=SYSTEM + tokens(400 + i, 6), max_new_tokens=4, ignore_eos=True, **GREEDY)
        served = [a for a, r in targets.items() if r.status().steps > 0]
        assert len(served) == 1, served
        assert targets[served[0]].status().prefix_cache_hits >= 5 * 200
        # A conversation with a key: every turn on one replica, turns 2+ from its prefix cache.
        key = "conv-1"
        steps = {a: r.status().steps for a, r in targets.items()}
        hits = {a: r.status().prefix_cache_hits for a, r in targets.items()}
        prompt, outputs = list(SYSTEM), []
        with Client(address) as c:
            for turn in range(2):
                prompt = prompt + tokens(500 + turn, 24)
                outputs.append(c.generate(token_ids=prompt, max_new_tokens=MAX_NEW, ignore_eos=True,
                                          prompt_cache_key=key, **GREEDY).token_ids)
                prompt = prompt + outputs[-1]
        used = [a for a, r in targets.items() if r.status().steps > steps[a]]
        assert len(used) == 1, used
        holder = used[0]
        assert targets[holder].status().prefix_cache_hits - hits[holder] >= 200 + 24  # turn 2: all of turn 1's prompt
        # The holder dies: turn 3 goes on on the other replica, and every turn is the target's own output.
        cluster.stop("target", holder)
        other = next(a for a in targets if a != holder)
        before = targets[other].status().steps
        with Client(address) as c:
            prompt = prompt + tokens(502, 24)
            outputs.append(c.generate(token_ids=prompt, max_new_tokens=MAX_NEW, ignore_eos=True,
                                      prompt_cache_key=key, **GREEDY).token_ids)
        assert targets[other].status().steps > before
        prompt = list(SYSTEM)
        for turn, out in enumerate(outputs):
            prompt = prompt + tokens(500 + turn, 24)
            assert out == reference_greedy(tiny_target_model, prompt, MAX_NEW, None), f"turn {turn + 1}"
            prompt = prompt + out
    finally:
        cluster.close()


def test_the_cache_key_fields_and_the_counters(warm):
    """OpenAI's prompt_cache_key (or user) becomes the request's key; a key too long is refused naming its
    field, before any token; the tiers export the prefix cache's counters under vLLM's names."""
    import grpc
    from prometheus_client import generate_latest

    from coordinator.api.openai_schema import BadRequest, ChatCompletionRequest

    base = dict(model="m", messages=[{"role": "user", "content": "hi"}])
    assert ChatCompletionRequest(**base, prompt_cache_key="conv-1", user="u").to_generate_requests()[0].prompt_cache_key == "conv-1"
    assert ChatCompletionRequest(**base, user="u").to_generate_requests()[0].prompt_cache_key == "u"
    assert ChatCompletionRequest(**base).to_generate_requests()[0].prompt_cache_key == ""
    for name in ("prompt_cache_key", "user"):
        with pytest.raises(BadRequest, match=name):
            ChatCompletionRequest(**base, **{name: "k" * 129}).to_generate_requests()[0]
    with Client(warm.address) as c, pytest.raises(grpc.RpcError) as e:
        c.generate(token_ids=[1, 2, 3], max_new_tokens=2, prompt_cache_key="k" * 129)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_cache_key" in e.value.details()
    status = warm.status("target")
    text = generate_latest(warm.tier_registries["TargetConfig"]).decode()
    for name, value in (("vllm:prefix_cache_hits_total", status.prefix_cache_hits),
                        ("vllm:prefix_cache_queries_total", status.prefix_cache_queries)):
        line = next(l for l in text.splitlines() if l.startswith(name + "{"))
        assert float(line.split()[-1]) == value > 0, line
