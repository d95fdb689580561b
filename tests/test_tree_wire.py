"""Token trees on the wire (target.proto: draft_parents, tree_scheme, accepted_path), through a real target
server: a greedy tree is walked along the target's argmax and the next round continues from the accepted
path; a malformed tree gets INVALID_ARGUMENT naming its field while the concurrent valid requests of its
batch answer exactly as they do alone; a request without parents is a chain, as before."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specdec.core.prefix import PrefixHashes
from specdec.proto import common_pb2, target_pb2, target_pb2_grpc
from specdec.serving import draft_probs
from tests.helpers import Cluster, reference_greedy
from tests.test_batching import prompt

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

PARENTS = [-1, -1, 1, 1, 3, 3]


@pytest.fixture(scope="module")
def target_cluster(tiny_target):
    cluster = Cluster(tiny_target, None)
    yield cluster
    cluster.close()


def request(sid: str, ids: list[int], drafts: list[int], parents: list[int] = (), *, prefix: list[int] = (),
            temperature: float = 0.0, seed: int = 0, q=(), scheme: int = 0) -> target_pb2.VerifyRequest:
    ctx = common_pb2.SessionContext(session_id=sid, prefix_len=len(prefix), new_tokens=ids,
                                    prefix_hash=PrefixHashes(list(prefix)).at(len(prefix)) if prefix else 0)
    return target_pb2.VerifyRequest(context=ctx, draft_tokens=drafts, draft_parents=parents, q=q,
                                    sampling=common_pb2.SamplingParams(temperature=temperature), seed=seed,
                                    tree_scheme=scheme)


def call(cluster, requests):
    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cluster.target_port}") as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            return await asyncio.gather(*(stub.Verify(r) for r in requests), return_exceptions=True)
    return asyncio.run(run())


def test_a_greedy_tree_follows_the_argmax_and_the_next_round_continues(target_cluster, tiny_target_model):
    ids = prompt(500, 10)
    g = reference_greedy(tiny_target_model, ids, 6, None)
    wrong = [(t + 29) % 40000 + 3 for t in g]
    tree = [wrong[0], g[0], wrong[1], g[1], g[2], wrong[2]]
    (r,) = call(target_cluster, [request("wire-greedy", ids, tree, PARENTS)])
    assert (list(r.accepted_path), r.num_accepted, r.next_token, r.cached_len) == ([1, 3, 4], 3, g[3], len(ids) + 3)
    committed = ids + g[:4]
    (nxt,) = call(target_cluster, [request("wire-greedy", [g[3]], [g[4]], prefix=committed[:-1])])
    assert (nxt.num_accepted, nxt.next_token, list(nxt.accepted_path)) == (1, g[5], [])


BAD = [  # (parents, scheme, q rows?, temperature, the message's start)
    ([-1, 0, 9, 1, -1, 2], 0, False, 0.0, "draft_parents: session 0 node 2 has parent 9, out of range"),
    ([-1, 0, 2, 1, -1, 2], 0, False, 0.0, "draft_parents: session 0 has a cycle through node 2"),
    ([-1, 3, 0, 0, -1, 2], 0, False, 0.0, "draft_parents: session 0 node 1 has parent 3; a parent must come before"),
    ([-1, 0, 1], 0, False, 0.0, "draft_parents has 3 entries but draft_tokens has 6"),
    ([-1, -1, -1, -1, -1, -1], target_pb2.TREE_SCHEME_WITHOUT_REPLACEMENT, True, 1.0, "draft_tokens: session 0 nodes"),
    (PARENTS, target_pb2.TREE_SCHEME_CANDIDATES, True, 1.0, "tree_scheme TREE_SCHEME_CANDIDATES: candidates take no q"),
    (PARENTS, target_pb2.TREE_SCHEME_IID, False, 1.0, "tree_scheme TREE_SCHEME_IID: sampled draft trees need q"),
]


@pytest.mark.parametrize("parents,scheme,with_q,temperature,message", BAD)
def test_a_malformed_tree_fails_alone_among_concurrent_verifies(target_cluster, parents, scheme, with_q, temperature,
                                                                message):
    drafts = [11, 11, 12, 13, 14, 15]
    q = [draft_probs.row([11, 12], [0.5, 0.5]) for _ in drafts] if with_q else []

    def good(i: int) -> target_pb2.VerifyRequest:
        qs = [draft_probs.row([d, d + 1], [0.6, 0.4]) for d in drafts] if i % 2 else []
        return request(f"ok-{i}", prompt(600 + i, 8), drafts, PARENTS, temperature=0.9 * (i % 3 > 0), seed=i, q=qs)

    alone = [call(target_cluster, [good(i)])[0] for i in range(5)]
    bad = request("bad", prompt(700, 8), drafts, parents, temperature=temperature, q=q, scheme=scheme)
    together = call(target_cluster, [good(0), good(1), bad, good(2), good(3), good(4)])
    error = together.pop(2)
    assert isinstance(error, grpc.aio.AioRpcError), error
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith(message), error.details()
    for a, t in zip(alone, together):
        assert (list(t.accepted_path), t.next_token) == (list(a.accepted_path), a.next_token)


def test_a_tree_reports_the_logprobs_of_its_accepted_path_as_a_chain_would(target_cluster, tiny_target_model):
    ids = prompt(510, 10)
    g = reference_greedy(tiny_target_model, ids, 4, None)
    tree = [(g[0] + 31) % 40000 + 3, g[0], g[1] + 1, g[1], g[2], g[2] + 1]
    as_tree = request("lp-tree", ids, tree, PARENTS)
    as_tree.logprobs, as_tree.top_logprobs = True, 3
    as_chain = request("lp-chain", ids, g[:3])
    as_chain.logprobs, as_chain.top_logprobs = True, 3
    t, c = call(target_cluster, [as_tree, as_chain])
    assert (t.num_accepted, t.next_token) == (c.num_accepted, c.next_token) == (3, g[3])
    assert [x.token_id for x in t.logprobs] == [x.token_id for x in c.logprobs] == g[:4]
    for x, y in zip(t.logprobs, c.logprobs):
        assert list(x.top_token_ids) == list(y.top_token_ids)
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)


def test_a_tree_with_logit_bias_follows_the_biased_argmax_and_a_penalised_tree_is_refused(target_cluster):
    ids = prompt(520, 10)
    biased = request("bias-tree", ids, [7, 9, 9, 8, 7, 7], PARENTS)
    biased.sampling.logit_bias[9] = 100.0  # token 9 wins every position
    penalised = request("penal-tree", ids, [7, 9, 9, 8, 7, 7], PARENTS)
    penalised.sampling.presence_penalty = 0.5
    b, p = call(target_cluster, [biased, penalised])
    assert (list(b.accepted_path), b.next_token) == ([1, 2], 9)  # 9 (node 1), then 9 (node 2, its child), then 9
    assert isinstance(p, grpc.aio.AioRpcError) and p.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert p.details().startswith("draft_parents: token trees take no presence"), p.details()
