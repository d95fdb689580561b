"""Direct rounds (--direct-rounds): the draft tier runs a session's rounds itself (DraftService.Drive), sending
each proposal to the target and taking the verdict with no hop through the coordinator. Output is unchanged,
greedy (the target's own) and sampled (the coordinator's rounds' tokens, draw for draw, with the same seed);
a draft tier that cannot drive, or dies while driving, costs only its rounds; bad Drive requests get a clear
status; the tiers keep no session after the Drive ends."""

import time

import grpc
import pytest

from specdec.client import Client
from specdec.proto import common_pb2, draft_pb2, draft_pb2_grpc
from tests.helpers import Cluster, reference_greedy

pytestmark = pytest.mark.servers  # in-process servers (make test, not make test-fast)

PROMPT = [1, 504, 3937, 282, 4193, 314, 30, 2600, 28]


@pytest.fixture(scope="module")
def direct_cluster(tiny_target, tiny_random_draft):
    cluster = Cluster(tiny_target, tiny_random_draft, direct=True)
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def direct_self_cluster(tiny_target):
    """The target as its own draft: every draft accepted, so each round commits K + 1 tokens."""
    cluster = Cluster(tiny_target, tiny_target, direct=True)
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def direct_overlap_cluster(tiny_target, tiny_random_draft):
    """Direct rounds with the draft's speculation cache (--overlap): each chain asked as a tree of branching 1."""
    cluster = Cluster(tiny_target, tiny_random_draft, direct=True, coordinator_overrides={"overlap": True})
    yield cluster
    cluster.close()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_direct_rounds_give_the_targets_own_output(direct_cluster, direct_overlap_cluster, direct_self_cluster,
                                                          tiny_target_model, k):
    expected = reference_greedy(tiny_target_model, PROMPT, 40, [2])
    for cluster in (direct_cluster, direct_overlap_cluster, direct_self_cluster):
        with Client(cluster.address) as c:
            out = c.generate(token_ids=PROMPT, max_new_tokens=40, num_speculative_tokens=k, proposer="draft")
        assert out.token_ids == expected
        s = out.stats
        assert s["direct_rounds"] == s["rounds"] > 0
    # With every draft accepted a round commits K + 1 tokens, so the rounds count shows the drafts were used.
    assert s["rounds"] <= -(-len(expected) // (k + 1)) + 1 and s["accepted_tokens"] == s["draft_tokens"] > 0


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9),
                                      dict(temperature=0.8, repetition_penalty=1.3)])
def test_sampled_direct_rounds_give_the_coordinators_rounds_tokens(random_draft_cluster, direct_cluster,
                                                                   direct_overlap_cluster, sampling):
    """Seeded: the same tokens as the coordinator's own rounds, draw for draw, so the same law (whose exactness
    tests/test_distribution.py proves by chi-square); with the speculation cache too."""
    kw = dict(token_ids=PROMPT, max_new_tokens=40, num_speculative_tokens=3, proposer="draft", seed=777, **sampling)
    with Client(random_draft_cluster.address) as c:
        own = c.generate(**kw)
    assert own.stats["direct_rounds"] == 0
    for cluster in (direct_cluster, direct_overlap_cluster):
        with Client(cluster.address) as c:
            direct = c.generate(**kw)
        assert direct.token_ids == own.token_ids
        assert direct.stats["direct_rounds"] == direct.stats["rounds"]


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.1, seed=5), dict(temperature=0.3, top_k=8, seed=6)])
def test_drafting_ahead_gives_the_coordinators_rounds_tokens(self_draft_cluster, tiny_target, sampling):
    """--overlap: while the target verifies, the draft drafts on for the outcome it predicts; with the target as its
    own draft that outcome is often the verdict, and the rounds it starts with a ready proposal commit the
    tokens the coordinator's own rounds commit, greedy and seeded."""
    kw = dict(token_ids=PROMPT, max_new_tokens=48, num_speculative_tokens=3, proposer="draft", **sampling)
    with Client(self_draft_cluster.address) as c:
        own = c.generate(**kw)
    cluster = Cluster(tiny_target, tiny_target, direct=True, coordinator_overrides={"overlap": True})
    try:
        with Client(cluster.address) as c:
            ahead = c.generate(**kw)
    finally:
        cluster.close()
    assert ahead.token_ids == own.token_ids
    s = ahead.stats
    assert s["direct_rounds"] == s["rounds"] and 0 < s["overlapped_rounds"] < s["rounds"]


def test_stop_strings_logprobs_and_eos_cut_direct_rounds_as_their_own(random_draft_cluster, direct_cluster):
    kw = dict(token_ids=PROMPT, max_new_tokens=30, num_speculative_tokens=2, proposer="draft", logprobs=2)
    with Client(random_draft_cluster.address) as c:
        own = c.generate(**kw)
    with Client(direct_cluster.address) as c:
        direct = c.generate(**kw)
        text = direct.text
        stop = text[len(text) // 2: len(text) // 2 + 3]
        cut = c.generate(stop=[stop], **kw) if stop.strip() else None
    assert direct.token_ids == own.token_ids
    assert [lp.token_id for lp in direct.logprobs] == direct.token_ids
    assert [round(lp.logprob, 4) for lp in direct.logprobs] == [round(lp.logprob, 4) for lp in own.logprobs]
    if cut is not None:
        assert stop not in cut.text and text.startswith(cut.text) and cut.finish_reason == "stop"
    direct_cluster.wait_no_sessions()


def test_requests_that_cannot_use_direct_rounds_run_their_own(direct_cluster, tiny_target_model):
    """Adaptive K, the hybrid proposer and K = 0 are the coordinator's rounds, with the same output."""
    expected = reference_greedy(tiny_target_model, PROMPT, 24, [2])
    with Client(direct_cluster.address) as c:
        for kw in (dict(proposer="draft"), dict(proposer="hybrid", num_speculative_tokens=2),
                   dict(proposer="draft", num_speculative_tokens=0)):
            out = c.generate(token_ids=PROMPT, max_new_tokens=24, **kw)
            assert out.token_ids == expected and out.stats["direct_rounds"] == 0, kw


def test_a_draft_without_a_direct_target_leaves_the_rounds_to_the_coordinator(self_draft_cluster, tiny_target,
                                                                             tiny_target_model):
    """Known at start (its ModelInfo offers no direct rounds), or found out by its Drive's refusal (one replica
    of several, started without --direct-target): the coordinator's own rounds, the same output."""
    expected = reference_greedy(tiny_target_model, PROMPT, 24, [2])
    with Client(self_draft_cluster.address) as c:
        out = c.generate(token_ids=PROMPT, max_new_tokens=24, num_speculative_tokens=3, proposer="draft")
    assert out.token_ids == expected and out.stats["direct_rounds"] == 0 and not self_draft_cluster.pipeline.direct_rounds
    cluster = Cluster(tiny_target, tiny_target, direct=True)
    try:
        assert cluster.pipeline.direct_rounds
        cluster.draft_servicer.target = None  # as a replica started without --direct-target
        with Client(cluster.address) as c:
            out = c.generate(token_ids=PROMPT, max_new_tokens=24, num_speculative_tokens=3, proposer="draft")
        assert out.token_ids == expected
        assert out.stats["direct_rounds"] == 0 and out.stats["rounds"] > 0
    finally:
        cluster.close()


def interrupted_drive(tiny_target, interrupt) -> tuple[list[int], object]:
    """A 300-token greedy generation (~150 direct rounds at K = 1, the target as its own draft) on a fresh cluster,
    interrupt(cluster) called once the first chunk reached the client: the tokens and the result's stats."""
    cluster = Cluster(tiny_target, tiny_target, direct=True)
    try:
        with Client(cluster.address) as c:
            tokens, stats = [], None
            for i, event in enumerate(c.stream(token_ids=PROMPT, max_new_tokens=300, num_speculative_tokens=1,
                                               proposer="draft", ignore_eos=True)):
                if event.HasField("chunk"):
                    tokens.extend(event.chunk.token_ids)
                else:
                    stats = event.result.stats
                if i == 0:
                    interrupt(cluster)
        return tokens, stats
    finally:
        cluster.close()


def test_a_draft_that_dies_while_driving_costs_only_its_rounds(tiny_target, tiny_target_model):
    """The draft replica stops mid-Drive: the coordinator's own rounds (prompt lookup standing in for the draft)
    finish the generation with the same tokens."""
    tokens, stats = interrupted_drive(tiny_target, lambda cluster: cluster.stop_draft())
    assert tokens == reference_greedy(tiny_target_model, PROMPT, 300, [])
    assert 0 < stats.direct_rounds < stats.rounds  # the coordinator ran the rest


def test_a_draining_draft_replica_hands_its_drives_back_at_once(tiny_target, tiny_target_model):
    """On SIGTERM a replica drains: a Drive ends at its next round with UNAVAILABLE (as a session stream does at its
    next request), and the coordinator's own rounds finish the generation with the same tokens."""
    def drain(cluster):
        cluster.draft_servicer.draining = True  # what SIGTERM sets (TierRpcs.drain)

    tokens, stats = interrupted_drive(tiny_target, drain)
    assert tokens == reference_greedy(tiny_target_model, PROMPT, 300, [])
    assert 0 < stats.direct_rounds < stats.rounds


@pytest.mark.parametrize("change, code, words", [
    (dict(max_new_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
    (dict(num_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "num_tokens"),
    (dict(num_tokens=10_000), grpc.StatusCode.INVALID_ARGUMENT, "num_tokens"),
    (dict(context=common_pb2.SessionContext(session_id="d", prefix_len=3, new_tokens=PROMPT)),
     grpc.StatusCode.INVALID_ARGUMENT, "prefix_len"),
    (dict(context=common_pb2.SessionContext(session_id="d", new_tokens=[10 ** 7])), grpc.StatusCode.INVALID_ARGUMENT,
     "vocab"),
])
def test_a_bad_drive_gets_a_clear_status_and_the_replica_stays_healthy(direct_cluster, change, code, words):
    request = dict(context=common_pb2.SessionContext(session_id="d", new_tokens=PROMPT), num_tokens=2,
                   sampling=common_pb2.SamplingParams(), max_new_tokens=8)
    request.update(change)
    with grpc.insecure_channel(f"127.0.0.1:{direct_cluster.draft_port}") as ch:
        stub = draft_pb2_grpc.DraftServiceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Drive(draft_pb2.DriveRequest(**request), timeout=30))
        assert e.value.code() == code and words in e.value.details(), e.value.details()
        good = list(stub.Drive(draft_pb2.DriveRequest(context=common_pb2.SessionContext(session_id="ok", new_tokens=PROMPT),
                                                      num_tokens=2, sampling=common_pb2.SamplingParams(),
                                                      max_new_tokens=8), timeout=30))
    assert sum(e.verdict.num_accepted + 1 for e in good) >= 8
    direct_cluster.wait_no_sessions()


def test_an_expired_deadline_mid_drive_is_deadline_exceeded_and_frees_the_sessions(direct_cluster):
    """The Drive carries the client's deadline: one that expires while the draft replica runs the rounds ends the
    stream with DEADLINE_EXCEEDED (never UNAVAILABLE, never a late answer), and both tiers drop the session."""
    kw = dict(token_ids=PROMPT, max_new_tokens=300, num_speculative_tokens=3, proposer="draft", ignore_eos=True)
    with Client(direct_cluster.address) as c:
        times = []
        for _ in range(2):  # the faster of two: the first may be slower (a warm-up)
            t0 = time.perf_counter()
            whole = c.generate(**kw)
            times.append(time.perf_counter() - t0)
        full_s = min(times)
    assert whole.stats["direct_rounds"] == whole.stats["rounds"]
    outcomes = []
    for i in range(8):
        with Client(direct_cluster.address, timeout_s=full_s * (0.2 + 0.075 * i)) as c:
            try:
                outcomes.append(("OK", c.generate(**kw).token_ids == whole.token_ids))
            except grpc.RpcError as e:
                outcomes.append((e.code().name, True))
    assert all(code in ("OK", "DEADLINE_EXCEEDED") and same for code, same in outcomes), outcomes
    assert any(code == "DEADLINE_EXCEEDED" for code, _ in outcomes), outcomes
    direct_cluster.wait_no_sessions()
