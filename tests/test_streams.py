"""The per-session streams (the target's VerifyStream, the draft's ProposeStream) through the real servers:
a stream answers exactly what the unary rpc answers, the tier drops a stream's sessions when it ends, and a
draining replica ends its streams at their next request with UNAVAILABLE (so sessions move at once). A
status the replica chose says so in its trailing metadata; the coordinator reads one without it as the
connection failing."""

from __future__ import annotations

import queue

import grpc
import pytest

from coordinator.tiers.client import stream_status
from specdec.core.errors import TIER_STATUS_METADATA
from specdec.proto import common_pb2, draft_pb2, target_pb2
from specdec.core.prefix import PrefixHashes
from specdec.serving.tier import DRAINING

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 30, 2, 198]
TIMEOUT = 30


def context(session_id: str, tokens: list[int], prefix: int) -> common_pb2.SessionContext:
    return common_pb2.SessionContext(session_id=session_id, prefix_len=prefix, prefix_hash=PrefixHashes(tokens).at(prefix),
                                     new_tokens=tokens[prefix:])


def verify_requests(session_id: str, drafts_per_round: list[list[int]]):
    """A generator of VerifyRequests that follows the replies it is sent (send() each reply)."""
    seq, prefix = list(PROMPT), 0
    for drafts in drafts_per_round:
        reply = yield target_pb2.VerifyRequest(context=context(session_id, seq, prefix), draft_tokens=drafts,
                                               sampling=common_pb2.SamplingParams(temperature=0.8), seed=len(seq))
        prefix = reply.cached_len
        seq = seq + drafts[: reply.num_accepted] + [reply.next_token]


class Stream:
    """A raw bidirectional stream driven one request at a time from the test's thread."""

    def __init__(self, method) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._responses = method(iter(self._requests.get, None), timeout=TIMEOUT)

    def call(self, request):
        self._requests.put(request)
        return next(self._responses)

    def close(self) -> None:
        self._requests.put(None)
        self._responses.cancel()


def first_request(tier: str, target_stub, draft_stub, session_id: str, tokens: list[int]):
    """A new stream on `tier` (the target's VerifyStream, the draft's ProposeStream) and a first request over
    `tokens` for it."""
    if tier == "target":
        return (Stream(target_stub.VerifyStream),
                target_pb2.VerifyRequest(context=context(session_id, tokens, 0), draft_tokens=[5]))
    return Stream(draft_stub.ProposeStream), draft_pb2.ProposeRequest(context=context(session_id, tokens, 0), num_tokens=2)


def run_rounds(call, session_id: str) -> list[tuple[int, int, int]]:
    rounds = [[5, 6, 7], [], [8], [9, 10]]
    gen = verify_requests(session_id, rounds)
    request, out = next(gen), []
    while True:
        reply = call(request)
        out.append((reply.num_accepted, reply.next_token, reply.cached_len))
        try:
            request = gen.send(reply)
        except StopIteration:
            return out


def test_verify_stream_answers_what_unary_verify_answers(cluster, target_stub):
    unary = run_rounds(lambda r: target_stub.Verify(r, timeout=TIMEOUT), "unary-session")
    stream = Stream(target_stub.VerifyStream)
    try:
        streamed = run_rounds(stream.call, "stream-session")
    finally:
        stream.close()
    assert streamed == unary
    target_stub.EndSession(common_pb2.EndSessionRequest(session_id="unary-session"), timeout=TIMEOUT)


@pytest.mark.parametrize("tier", ["target", "draft"])
def test_a_stream_that_ends_drops_its_sessions(cluster, target_stub, draft_stub, tier):
    cluster.wait_no_sessions()
    stream, request = first_request(tier, target_stub, draft_stub, "s-drop", PROMPT)
    assert stream.call(request).cached_len > 0
    assert cluster.status(tier).num_sessions == 1
    stream.close()
    cluster.wait_no_sessions()  # raises if the session stays


def test_a_draining_replica_ends_its_streams_at_the_next_request(cluster, target_stub):
    stream = Stream(target_stub.VerifyStream)
    gen = verify_requests("s-drain", [[5], [6]])
    first = stream.call(next(gen))
    servicer = cluster.target_servicer
    servicer.draining = True
    try:
        with pytest.raises(grpc.RpcError) as err:
            stream.call(gen.send(first))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and err.value.details() == DRAINING
        assert set(TIER_STATUS_METADATA) <= set(err.value.trailing_metadata())
        # unary rpcs are still served while draining (in-flight work finishes)
        assert target_stub.GetStatus(common_pb2.StatusRequest(), timeout=TIMEOUT).num_waiting == 0
    finally:
        servicer.draining = False
        stream.close()
    cluster.wait_no_sessions()
    # and a new stream works again once the replica serves
    stream = Stream(target_stub.VerifyStream)
    try:
        assert stream.call(next(verify_requests("s-after", [[5]]))).cached_len >= len(PROMPT)
    finally:
        stream.close()
    cluster.wait_no_sessions()


@pytest.mark.parametrize("tier", ["target", "draft"])
def test_a_refused_request_ends_the_stream_with_the_tiers_own_status(cluster, target_stub, draft_stub, tier):
    bad = [*PROMPT, 10**7]  # a token id outside the vocabulary
    stream, request = first_request(tier, target_stub, draft_stub, "s-bad", bad)
    try:
        with pytest.raises(grpc.RpcError) as err:
            stream.call(request)
    finally:
        stream.close()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in err.value.details()
    assert set(TIER_STATUS_METADATA) <= set(err.value.trailing_metadata())
    assert stream_status(err.value.code(), err.value.details(), err.value.trailing_metadata())[0] == grpc.StatusCode.INVALID_ARGUMENT


def test_the_coordinator_reads_an_unmarked_internal_status_as_the_connection_failing():
    """gRPC core reports a replica that died under a call as UNAVAILABLE, or at times as INTERNAL ("Internal
    error from Core"): without the tier's mark that is the connection, retried like UNAVAILABLE; with it,
    the tier's own verdict stands."""
    internal, unknown, unavailable = grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE
    assert stream_status(internal, "Internal error from Core", ()) == (
        unavailable, "connection lost (INTERNAL: Internal error from Core)")
    assert stream_status(unknown, "Stream removed", None) == (unavailable, "connection lost (UNKNOWN: Stream removed)")
    assert stream_status(internal, "forward failed: boom", TIER_STATUS_METADATA) == (internal, "forward failed: boom")
    assert stream_status(unavailable, "Socket closed", ()) == (unavailable, "Socket closed")
    assert stream_status(grpc.StatusCode.INVALID_ARGUMENT, "bad", ()) == (grpc.StatusCode.INVALID_ARGUMENT, "bad")


def test_generation_stats_split_the_round_into_its_parts(cluster, generation_stub):
    """network_ms excludes the tiers' own time: compute (draft_ms, verify_ms) and the rest of it (tier_ms)."""
    from specdec.proto import generate_pb2

    result = None
    for event in generation_stub.Generate(generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=PROMPT), max_new_tokens=12, num_speculative_tokens=2,
            proposer=generate_pb2.PROPOSER_DRAFT_MODEL, ignore_eos=True), timeout=TIMEOUT):
        if event.HasField("result"):
            result = event.result
    s = result.stats
    assert s.rounds > 0 and s.draft_ms > 0 and s.verify_ms > 0
    assert s.tier_ms > 0  # every request spends some time in its engine outside the forward
    assert s.network_ms > 0
    parts = s.draft_ms + s.verify_ms + s.tier_ms + s.network_ms + s.coordinator_ms
    assert parts == pytest.approx(s.elapsed_s * 1e3, rel=0.02)
