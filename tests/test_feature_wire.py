"""Features on the wire (target.proto: VerifyRequest.feature_layers, VerifyResponse.features / features_start),
through a real target server: every verdict of a session that asks carries the features of exactly the positions it
added to the session's cache (the committed tokens it fed, then the accepted drafts, or a tree's accepted path),
so over its rounds the rows cover the committed sequence once, equal to one plain forward's layer outputs; a long
prompt's prefill chunks all return theirs; such a request takes nothing from the prefix cache; bad layer ids, and
more positions than one response can carry, get INVALID_ARGUMENT naming the field while the server stays healthy;
a request without layers gets no bytes."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from specdec.core.prefix import PrefixHashes
from specdec.engine.eagle3_features import from_bytes, target_features
from specdec.proto import common_pb2, target_pb2, target_pb2_grpc
from specdec.serving.server import ServerConfig
from target_service.service import TargetConfig
from target_service.service import build as build_target
from tests.helpers import reference_greedy
from tests.test_batching import prompt
from tests.test_feature_taps import assert_bf16_close
from tests.test_tree_wire import PARENTS, target_cluster  # noqa: F401 (the target-only cluster fixture, per module)

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

LAYERS = [1, 0]  # the tiny target's two decoder layers, last first


def request(sid: str, ids: list[int], drafts: list[int] = (), parents: list[int] = (), *, prefix: list[int] = (),
            layers: list[int] = LAYERS) -> target_pb2.VerifyRequest:
    ctx = common_pb2.SessionContext(session_id=sid, prefix_len=len(prefix), new_tokens=ids,
                                    prefix_hash=PrefixHashes(list(prefix)).at(len(prefix)) if prefix else 0)
    return target_pb2.VerifyRequest(context=ctx, draft_tokens=drafts, draft_parents=parents,
                                    sampling=common_pb2.SamplingParams(temperature=0.0), feature_layers=layers)


def call(cluster, requests, port: int | None = None):
    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port or cluster.target_port}") as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            return await asyncio.gather(*(stub.Verify(r, timeout=60) for r in requests), return_exceptions=True)
    return asyncio.run(run())


def features(r: target_pb2.VerifyResponse, model, layers=LAYERS) -> torch.Tensor:
    """The response's rows, [cached_len - features_start, layers x hidden]; the count checked against its positions."""
    rows = from_bytes(r.features, len(layers) * model.config.hidden_size)
    assert len(rows) == r.cached_len - r.features_start, (len(rows), r.features_start, r.cached_len)
    return rows


def plain_features(model, ids: list[int], layers=LAYERS) -> torch.Tensor:
    """One plain forward's features over the whole sequence: [len(ids), layers x hidden] bfloat16."""
    with torch.inference_mode():
        out, _ = target_features(model, torch.tensor([ids], device=model.device), layers)
    return out[0]


def wrong(t: int) -> int:
    return (t + 29) % 40000 + 3


def test_chain_rounds_cover_the_committed_sequence_once(target_cluster, tiny_target_model):
    """A prompt with all drafts accepted, a round with a rejection, a plain step, a round with none accepted: the
    rows come back for exactly features_start .. cached_len - 1 each round, and together they are the committed
    sequence's features from one plain forward."""
    ids = prompt(700, 12)
    g = reference_greedy(tiny_target_model, ids, 10, None)
    rounds = [  # (new committed tokens, drafts, accepted)
        (ids, g[0:3], 3),
        ([g[3]], [g[4], wrong(g[5]), g[6]], 1),
        ([g[5]], [], 0),
        ([g[6]], [wrong(g[7]), g[8]], 0),
    ]
    committed, rows = [], []
    for new, drafts, accepted in rounds:
        (r,) = call(target_cluster, [request("feat-chain", new, drafts, prefix=committed)])
        assert (r.num_accepted, r.features_start, r.cached_len) == (accepted, len(committed),
                                                                   len(committed) + len(new) + accepted)
        rows.append(features(r, tiny_target_model))
        committed = committed + new + list(drafts[:accepted])
        assert r.next_token == g[len(committed) - len(ids)]
    got = torch.cat(rows)
    assert len(got) == len(committed) == len(ids) + 7
    assert_bf16_close(got, plain_features(tiny_target_model, committed))
    (full,) = call(target_cluster, [request("feat-chain-once", committed)])
    assert_same_tier(target_cluster, got, features(full, tiny_target_model))


def assert_same_tier(cluster, got: torch.Tensor, want: torch.Tensor) -> None:
    """The same tier's features of the same positions, fed in other steps: bitwise equal where its steps run on
    the batch-invariant kernels (packed float32 on an AVX-512 or AVX2 CPU: skinny GEMM, row ops and row attention: a row's
    arithmetic does not depend on what else its step holds), else to one bfloat16 rounding."""
    runner = cluster.target_tier.runner
    if runner.program.skinny and runner.row_attention:
        assert torch.equal(got, want), int((got != want).sum())
    else:
        assert_bf16_close(got, want)


def test_a_tree_returns_its_accepted_paths_rows(target_cluster, tiny_target_model):
    ids = prompt(701, 10)
    g = reference_greedy(tiny_target_model, ids, 4, None)
    tree = [wrong(g[0]), g[0], wrong(g[1]), g[1], g[2], wrong(g[2])]  # the argmax path: nodes 1, 3, 4
    (r,) = call(target_cluster, [request("feat-tree", ids, tree, PARENTS)])
    assert (list(r.accepted_path), r.features_start, r.cached_len) == ([1, 3, 4], 0, len(ids) + 3)
    assert_bf16_close(features(r, tiny_target_model), plain_features(tiny_target_model, ids + g[:3]))
    (chain,) = call(target_cluster, [request("feat-tree-as-chain", ids + g[:3])])
    assert_same_tier(target_cluster, features(r, tiny_target_model), features(chain, tiny_target_model))


def test_a_long_prompt_returns_every_chunks_rows(target_cluster, tiny_target_model):
    """300 tokens are fed in three prefill chunks (128 a step): all their rows come back, in order."""
    ids = prompt(702, 300)
    assert target_cluster.target_tier.config.batch.prefill_chunk_tokens < len(ids)
    g = reference_greedy(tiny_target_model, ids, 2, None)
    (r,) = call(target_cluster, [request("feat-long", ids, g[:2])])
    assert (r.num_accepted, r.features_start, r.cached_len) == (2, 0, len(ids) + 2)
    assert_bf16_close(features(r, tiny_target_model), plain_features(tiny_target_model, ids + g[:2]))


def test_features_are_not_served_from_the_prefix_cache(target_cluster, tiny_target_model):
    """A fresh send that asks for features feeds every token, though the prefix cache holds most of them (as a
    send without features shows), and returns them all."""
    ids = prompt(703, 70)
    call(target_cluster, [request("feat-donor", ids, layers=[])])
    plain, tapped = call(target_cluster, [request("feat-reuser", ids, layers=[]), request("feat-fresh", ids)])
    assert plain.prefix_reused > 0 and plain.features == b""
    assert (tapped.prefix_reused, tapped.features_start, tapped.cached_len) == (0, 0, len(ids))
    assert_bf16_close(features(tapped, tiny_target_model), plain_features(tiny_target_model, ids))


def test_one_batch_mixes_tapping_and_plain_requests(target_cluster, tiny_target_model):
    """Sessions asking for different layers, or none, sent together (they share steps): each gets its own layers
    in its order, and the verdicts are those of requests without features."""
    ids = [prompt(704 + i, 8 + 3 * i) for i in range(3)]
    drafts = [reference_greedy(tiny_target_model, p, 3, None) for p in ids]
    layer_sets = [[0], [1, 0, 1], []]
    answers = call(target_cluster, [request(f"feat-mix-{i}", p, d, layers=ls)
                                    for i, (p, d, ls) in enumerate(zip(ids, drafts, layer_sets))])
    alone = call(target_cluster, [request(f"feat-mix-alone-{i}", p, d, layers=[])
                                  for i, (p, d) in enumerate(zip(ids, drafts))])
    for r, a, p, d, ls in zip(answers, alone, ids, drafts, layer_sets):
        assert (r.num_accepted, r.next_token, r.cached_len) == (a.num_accepted, a.next_token, a.cached_len)
        assert (r.num_accepted, r.cached_len) == (3, len(p) + 3)
        if ls:
            assert_bf16_close(features(r, tiny_target_model, ls), plain_features(tiny_target_model, p + d, ls))
        else:
            assert (r.features, r.features_start) == (b"", 0)


@pytest.mark.parametrize("layers, named", [
    (list(range(9)), "at most 8 layer ids, got 9"),
    ([0, 2], "got [2]"),
    ([-1, 1], "got [-1]"),
])
def test_bad_feature_layers_are_refused_and_the_server_stays_healthy(target_cluster, tiny_target_model, layers, named):
    (err,) = call(target_cluster, [request("feat-bad", prompt(705, 6), layers=layers)])
    assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("feature_layers:") and named in err.details(), err.details()
    ids = prompt(706, 6)
    (ok,) = call(target_cluster, [request("feat-after-bad", ids)])
    assert_bf16_close(features(ok, tiny_target_model), plain_features(tiny_target_model, ids))


def test_features_that_would_not_fit_in_a_response_are_refused(target_cluster, tiny_target_model):
    """A server whose messages are at most 96 KiB (64 KiB of it kept for the rest of a response) carries 32 KiB of
    features: 128 positions of two layers (256 bytes each), 256 of one. 200 new tokens with two layers are refused
    before they run, naming the field and the most a request may send; with one layer they are served."""
    engine = target_cluster.target_tier

    async def start():  # on the cluster's event loop, which serves it
        built = build_target(TargetConfig(engine.config, server=ServerConfig(max_message_bytes=96 * 1024)), engine)
        await built.server.start()
        return built

    small = target_cluster._call(start())
    try:
        ids = prompt(707, 200)
        (err,) = call(target_cluster, [request("feat-too-big", ids)], port=small.port)
        assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details().startswith("feature_layers: the features of 200 positions (256 bytes each)"), err.details()
        assert "at most 128 positions a request" in err.details(), err.details()
        (ok,) = call(target_cluster, [request("feat-fits", ids, layers=[0])], port=small.port)
        assert_bf16_close(features(ok, tiny_target_model, [0]), plain_features(tiny_target_model, ids, [0]))
    finally:
        target_cluster._call(small.server.stop(0))
        engine.observers.remove(small.metrics.observe_step)  # the module's cluster serves on alone
