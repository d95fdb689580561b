"""Pushed proposals (--draft-push, with --overlap): the draft tier sends each next round its speculation cache
pre-drafted, unasked, tagged with the committed prefix it holds for; the coordinator uses one only when that
is exactly its committed prefix after the verdict. Output is unchanged, greedy and sampled; a stale push is
dropped; a draft that dies mid-push costs only its rounds (prompt lookup stands in)."""

import queue

import grpc
import pytest

from coordinator.tiers.pushes import PushedProposals
from specdec.client import Client
from specdec.core.prefix import PrefixHashes
from specdec.proto import common_pb2, draft_pb2, draft_pb2_grpc
from tests.helpers import Cluster, reference_greedy

pytestmark = pytest.mark.servers  # in-process servers (make test, not make test-fast)

PROMPT = [1, 504, 3937, 282, 4193, 314, 30, 2600, 28]
PUSH = {"overlap": True, "draft_push": True}


@pytest.fixture(scope="module")
def push_cluster(tiny_target):
    cluster = Cluster(tiny_target, tiny_target, coordinator_overrides=PUSH)
    yield cluster
    cluster.close()


def pushed(length: int, fingerprint: int, tokens: list[int]) -> draft_pb2.ProposeResponse:
    return draft_pb2.ProposeResponse(tokens=tokens, pushed=True, pushed_prefix_len=length, pushed_prefix_hash=fingerprint)


def test_a_push_is_taken_only_for_its_own_prefix_and_stale_ones_are_dropped():
    committed = PROMPT + [7, 8]
    hashes = PrefixHashes(committed)
    other = PrefixHashes(PROMPT + [7, 9])
    pushes = PushedProposals()
    pushes.add(pushed(len(committed), other.at(len(committed)), [1]))  # the same length, another outcome
    pushes.add(pushed(len(committed) + 1, hashes.extended([5]).at(len(committed) + 1), [2]))  # a longer outcome
    assert pushes.take(len(committed), hashes.at(len(committed))) is None
    assert pushes.dropped == 2 and pushes.received == 2
    pushes.add(pushed(len(committed), hashes.at(len(committed)), [3]))
    pushes.add(pushed(len(committed), other.at(len(committed)), [4]))
    assert list(pushes.take(len(committed), hashes.at(len(committed))).tokens) == [3]
    assert pushes.take(len(committed), other.at(len(committed))) is None  # dropped with the round: never applied later
    assert pushes.dropped == 3


def test_the_draft_pushes_its_prepared_rounds_and_a_request_for_one_gets_the_same(self_draft_cluster, tiny_target_model):
    """On the wire, with no race: after its reply the draft tier pushes the rounds it pre-drafted; the push for
    the outcome the target then has (the target is its own draft: every draft accepted, then its argmax) is
    the proposal a request over that prefix is answered with, from the cache."""
    greedy = reference_greedy(tiny_target_model, PROMPT, 8, [2])
    shape = dict(num_tokens=3, tree_nodes=3, tree_depth=3, tree_branching=1, speculate=4, push=True,
                 sampling=common_pb2.SamplingParams(), seed=11)
    requests: queue.Queue = queue.Queue()
    with grpc.insecure_channel(f"127.0.0.1:{self_draft_cluster.draft_port}") as ch:
        replies = draft_pb2_grpc.DraftServiceStub(ch).ProposeStream(iter(requests.get, None), timeout=60)
        try:
            requests.put(draft_pb2.ProposeRequest(context=common_pb2.SessionContext(session_id="push-wire", new_tokens=PROMPT),
                                                  **shape))
            first = next(replies)
            assert not first.pushed and list(first.tokens) == greedy[:3]
            outcome = PROMPT + greedy[:4]
            fingerprint = PrefixHashes(outcome).at(len(outcome))
            seen = []
            while not seen or (seen[-1].pushed_prefix_len, seen[-1].pushed_prefix_hash) != (len(outcome), fingerprint):
                seen.append(next(replies))
                assert seen[-1].pushed and len(seen) <= shape["speculate"]
            push = seen[-1]
            assert push.speculated and list(push.tokens) == greedy[4:7]
            requests.put(draft_pb2.ProposeRequest(context=common_pb2.SessionContext(
                session_id="push-wire", prefix_len=len(PROMPT), prefix_hash=PrefixHashes(PROMPT).at(len(PROMPT)),
                new_tokens=greedy[:4]), **shape))
            reply = next(r for r in replies if not r.pushed)  # pushes of the first round may still come first
            assert reply.speculated and list(reply.tokens) == list(push.tokens)
        finally:
            requests.put(None)
            replies.cancel()


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_with_pushes_equals_target_generate(push_cluster, tiny_target_model, k):
    expected = reference_greedy(tiny_target_model, PROMPT, 40, [2])
    with Client(push_cluster.address) as c:
        out = c.generate(token_ids=PROMPT, max_new_tokens=40, num_speculative_tokens=k, proposer="draft")
    assert out.token_ids == expected
    s = out.stats
    assert s["pushed_rounds"] <= s["overlapped_rounds"] <= s["rounds"]  # a pushed round is a pre-drafted one


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=0.05, top_k=20)])
def test_sampled_output_with_pushes_equals_sequential(self_draft_cluster, push_cluster, sampling):
    """Seeded: the same tokens as sequential drafting, draw for draw, so the same law (whose exactness
    tests/test_distribution.py proves by chi-square)."""
    kw = dict(token_ids=PROMPT, max_new_tokens=40, num_speculative_tokens=3, proposer="draft", seed=4242, **sampling)
    with Client(self_draft_cluster.address) as c:
        sequential = c.generate(**kw)
    with Client(push_cluster.address) as c:
        pushed_run = c.generate(**kw)
    assert pushed_run.token_ids == sequential.token_ids


def test_a_draft_that_dies_mid_push_costs_only_its_rounds(tiny_target, tiny_target_model):
    expected = reference_greedy(tiny_target_model, PROMPT, 30, [2])
    cluster = Cluster(tiny_target, tiny_target, coordinator_overrides=PUSH)
    try:
        with Client(cluster.address) as c:
            tokens = []
            for i, event in enumerate(c.stream(token_ids=PROMPT, max_new_tokens=30, num_speculative_tokens=3,
                                               proposer="draft")):
                if event.HasField("chunk"):
                    tokens.extend(event.chunk.token_ids)
                if i == 1:
                    cluster.stop_draft()  # with pushes in flight on its stream
            assert tokens == expected
            after = c.generate(token_ids=PROMPT, max_new_tokens=30, num_speculative_tokens=3, proposer="draft")
            assert after.token_ids == expected and after.stats["pushed_rounds"] == 0
    finally:
        cluster.close()
