"""Draft-model token trees through the real servers: the draft grows a tree level by level, the target
verifies it in one forward, and the greedy output equals the target's own generate() for every tree shape
and budget, batched with chains, model-free trees and penalised (chain) requests; the draft's speculation
cache changes no output (greedy and seeded sampling, on and off); bad tree fields get INVALID_ARGUMENT naming
the field while the rest of the batch completes. The draft really sent trees (counted from its servicer)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from specdec.client import Client
from specdec.core.prefix import PrefixHashes
from specdec.proto import common_pb2, draft_pb2, draft_pb2_grpc
from tests.helpers import Cluster, reference_greedy

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

PROMPTS = [[1, 504, 3937, 282, 4193, 314, 30, 504, 3937, 282, 611, 314, 30, 504],
           [1, 9038, 2115, 253, 1345, 9038, 2115, 253, 700, 9038, 2115], [1, 2115, 253, 9038, 30, 4193, 77]]
MAX_NEW = 30


def spy(cluster: Cluster) -> Cluster:
    """Record the shape of every work the draft servicer makes (the real servicer does the work)."""
    cluster.shapes = []
    to_work = cluster.draft_servicer.to_work

    def recording(request):
        work = to_work(request)
        cluster.shapes.append(getattr(work, "shape", None))
        return work

    cluster.draft_servicer.to_work = recording
    return cluster


@pytest.fixture(scope="module")
def random_tree_cluster(tiny_target, tiny_random_draft):
    """A random draft (its trees mostly rejected), trees of up to 16 nodes, model-free trees too."""
    cluster = spy(Cluster(tiny_target, tiny_random_draft, coordinator_overrides={"draft_tree_nodes": 16, "tree_nodes": 8}))
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def self_tree_cluster(tiny_target):
    """The target as its own draft (its trees' first branch always accepted), branching 3, IID siblings,
    with the speculation cache (overlap)."""
    cluster = spy(Cluster(tiny_target, tiny_target, coordinator_overrides={
        "draft_tree_nodes": 12, "draft_tree_branching": 3, "draft_tree_scheme": "iid", "overlap": True}))
    yield cluster
    cluster.close()


@pytest.mark.parametrize("k", [1, 2, 3, 5, None])
def test_greedy_draft_trees_equal_target_generate(random_tree_cluster, self_tree_cluster, tiny_target_model, k):
    """K is the tree's depth (its nodes N(K) = b + b^2 (K - 1), capped by the budget); None: the policy."""
    for cluster, budget in ((random_tree_cluster, 16), (self_tree_cluster, 12)):
        del cluster.shapes[:]
        with Client(cluster.address) as client:
            for prompt in PROMPTS[:2]:
                out = client.generate(token_ids=prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=k, proposer="draft")
                assert out.token_ids == reference_greedy(tiny_target_model, prompt, MAX_NEW, [2])
        trees = [s for s in cluster.shapes if s is not None and s.branching > 1]
        if k is not None and k < budget:
            assert trees and max(s.depth for s in trees) == k, cluster.shapes
            assert all(s.nodes <= budget for s in trees)


def test_batched_trees_chains_model_free_and_penalised(random_tree_cluster, self_tree_cluster, tiny_target_model):
    """Draft trees, draft chains (K adaptive), prompt-lookup trees, hybrid and penalised requests (chains) at
    once: every greedy output is the target's own; the penalised one equals its own run alone."""
    cases = [dict(proposer="draft", num_speculative_tokens=3), dict(proposer="draft", num_speculative_tokens=None),
             dict(proposer="lookup", num_speculative_tokens=4), dict(proposer="hybrid", num_speculative_tokens=None),
             dict(proposer="draft", num_speculative_tokens=2, presence_penalty=0.5)]
    for cluster in (random_tree_cluster, self_tree_cluster):
        def one(i):
            prompt = PROMPTS[i % len(PROMPTS)]
            with Client(cluster.address) as client:
                return prompt, client.generate(token_ids=prompt, max_new_tokens=MAX_NEW, **cases[i % len(cases)]).token_ids
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(10)))
        for i, (prompt, ids) in enumerate(results):
            if i % len(cases) == 4:
                assert ids == one(i)[1]
            else:
                assert ids == reference_greedy(tiny_target_model, prompt, MAX_NEW, [2])


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_k=20), dict(temperature=0.05)])
def test_the_speculation_cache_changes_no_output(self_tree_cluster, tiny_target, sampling):
    """The same seeded requests with the speculation cache on (self_tree_cluster) and off: equal outputs,
    for trees (K = 1: 3 siblings; K = 2: 12 nodes)."""
    off = Cluster(tiny_target, tiny_target, coordinator_overrides={
        "draft_tree_nodes": 12, "draft_tree_branching": 3, "draft_tree_scheme": "iid"})
    try:
        hits = 0
        for k in (1, 2):
            kw = dict(token_ids=PROMPTS[0], max_new_tokens=MAX_NEW, num_speculative_tokens=k, proposer="draft", seed=77,
                      ignore_eos=True, **sampling)
            with Client(self_tree_cluster.address) as c:
                on_out = c.generate(**kw)
            with Client(off.address) as c:
                off_out = c.generate(**kw)
            assert on_out.token_ids == off_out.token_ids
            assert off_out.stats["overlapped_rounds"] == 0
            hits += on_out.stats["overlapped_rounds"]
        if sampling["temperature"] < 0.5:  # nearly greedy: the draft's guesses hold
            assert hits > 0
    finally:
        off.close()


def test_greedy_speculation_cache_hits_with_trees(self_tree_cluster):
    with Client(self_tree_cluster.address) as c:
        out = c.generate(token_ids=PROMPTS[1], max_new_tokens=MAX_NEW, num_speculative_tokens=2, proposer="draft",
                         ignore_eos=True)
    assert out.stats["overlapped_rounds"] >= out.stats["rounds"] - 2 > 0, out.stats


@pytest.mark.parametrize("field,value,message", [
    ("tree_nodes", 99, "tree_nodes must be in"), ("tree_depth", 9, "tree_depth must be in"),
    ("tree_branching", -1, "tree_branching must be in"), ("tree_scheme", 7, "tree_scheme 7"),
    ("speculate", 40, "speculate must be in")])
def test_bad_tree_fields_are_invalid_argument_and_the_batch_completes(random_tree_cluster, field, value, message):
    """A bad field in one request answers INVALID_ARGUMENT naming it; a good tree request of another session
    sent at the same time completes; a penalised tree is refused."""
    channel = grpc.insecure_channel(f"127.0.0.1:{random_tree_cluster.draft_port}")
    stub = draft_pb2_grpc.DraftServiceStub(channel)
    tokens = PROMPTS[0]

    def request(session, **tree):
        ctx = common_pb2.SessionContext(session_id=session, prefix_len=0, prefix_hash=PrefixHashes(tokens).at(0),
                                        new_tokens=tokens)
        return draft_pb2.ProposeRequest(context=ctx, num_tokens=1, seed=3, **tree)

    good = dict(tree_nodes=6, tree_depth=3, tree_branching=2)
    bad = dict(good, **{field: value})
    with ThreadPoolExecutor(2) as pool:
        bad_call = pool.submit(stub.Propose, request("bad", **bad))
        good_call = pool.submit(stub.Propose, request("good", **good))
        with pytest.raises(grpc.RpcError) as e:
            bad_call.result()
        reply = good_call.result()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details()
    assert len(reply.tokens) == 6 and len(reply.parents) == 6
    penalised = request("pen", **good)
    penalised.sampling.temperature, penalised.sampling.presence_penalty = 0.7, 0.5
    with pytest.raises(grpc.RpcError) as e:
        stub.Propose(penalised)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tree_nodes: penalised" in e.value.details()
    channel.close()


def test_a_request_sets_its_own_tree_budget(random_draft_cluster, random_tree_cluster, tiny_target_model):
    """num_speculative_nodes asks for trees on a server whose default is chains (the draft model's and prompt
    lookup's), and for chains (0) on one whose default is trees: the greedy output is the target's own either
    way, and the rounds proposed what was asked (a tree of depth 3 holds more than 3 nodes; a chain at most 3)."""
    k = 3
    for cluster, nodes, trees in ((random_draft_cluster, 8, True), (random_tree_cluster, 0, False)):
        with Client(cluster.address) as client:
            for proposer in ("draft", "lookup"):
                for prompt in PROMPTS[:2]:
                    out = client.generate(token_ids=prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=k,
                                          num_speculative_nodes=nodes, proposer=proposer)
                    assert out.token_ids == reference_greedy(tiny_target_model, prompt, MAX_NEW, [2])
                    per_round = out.stats["mean_num_speculative_tokens"]
                    if proposer == "draft":
                        assert per_round > k if trees else per_round <= k, (cluster, per_round)
