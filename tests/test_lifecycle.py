"""Session lifecycle through the real servers: eviction never loses data, and many finished or
cancelled generations leave nothing behind.

1. Tiers with tight session stores (one session at a time, 40 cached tokens, or a 0.1 ms idle TTL)
   evict the sessions of concurrent generations all the time. A tier that lost a session answers
   FAILED_PRECONDITION and the coordinator resends the whole sequence, so the output must not
   change: greedy output stays the target's own, and seeded sampled output stays the same as on a
   cluster with room to spare (the draws depend on the seed and the position only).
2. 1,000 short generations (greedy and sampled, the three proposers, one in ten cancelled by the
   client after its first chunk, one in twenty given a deadline of a few milliseconds) leave zero
   sessions and zero cached tokens on both tiers, and the process's memory (the servers run in this
   process) back near where it was after a warm-up.
3. A client deadline that expires on a healthy cluster ends the stream with DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import ctypes
import gc
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from specdec.proto import generate_pb2, generate_pb2_grpc
from specdec.engine.sessions import SessionStoreConfig
from tests.helpers import Cluster, reference_greedy

pytestmark = pytest.mark.slow

EOS = 2
VOCAB = 49152
RPC_TIMEOUT = 60
MAX_NEW = 24
K = 3


def prompt(i: int, n: int = 20) -> list[int]:
    """A deterministic ~20-token prompt, different for each i."""
    return [1] + [(1000 + 7919 * i + 104729 * j) % (VOCAB - 10) + 3 for j in range(n - 1)]


PROMPTS = [prompt(i) for i in range(4)]

# Tier store bounds that force evictions between the rounds of concurrent generations.
TIGHT = {
    "max_sessions_1": SessionStoreConfig(max_sessions=1, max_cached_tokens=10_000, idle_ttl_s=600),
    "max_cached_tokens_40": SessionStoreConfig(max_sessions=256, max_cached_tokens=40, idle_ttl_s=600),
    "idle_ttl_0.1ms": SessionStoreConfig(max_sessions=256, max_cached_tokens=1_000_000, idle_ttl_s=0.0001),
}


@pytest.fixture(scope="module", params=list(TIGHT))
def tight_cluster(request, tiny_target, tiny_random_draft):
    cluster = Cluster(tiny_target, tiny_random_draft, sessions=TIGHT[request.param])
    yield cluster
    cluster.close()


def request_for(prompt_ids: list[int], max_new: int, **fields) -> generate_pb2.GenerateRequest:
    req = generate_pb2.GenerateRequest(max_new_tokens=max_new, **fields)
    req.token_ids.ids.extend(prompt_ids)
    return req


def generate(stub, req: generate_pb2.GenerateRequest, timeout: float = RPC_TIMEOUT) -> tuple[list[int], generate_pb2.GenerationResult]:
    events = list(stub.Generate(req, timeout=timeout))
    assert events and events[-1].HasField("result"), "the stream must end with a result"
    assert all(e.HasField("chunk") for e in events[:-1])
    ids = [t for e in events[:-1] for t in e.chunk.token_ids]
    assert events[-1].result.stats.generated_tokens == len(ids)
    return ids, events[-1].result


def run_concurrently(address: str, requests: list[generate_pb2.GenerateRequest]) -> list[list[int]]:
    """All requests at once, one thread each, released together."""
    barrier = threading.Barrier(len(requests))
    with grpc.insecure_channel(address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)

        def one(req):
            barrier.wait(timeout=30)
            return generate(stub, req)[0]

        with ThreadPoolExecutor(len(requests)) as pool:
            return list(pool.map(one, requests))


# --- 1. eviction never loses data -----------------------------------------------------------------


def greedy_requests() -> list[generate_pb2.GenerateRequest]:
    return [request_for(p, MAX_NEW, num_speculative_tokens=K, proposer=generate_pb2.PROPOSER_DRAFT_MODEL) for p in PROMPTS]


def sampled_requests() -> list[generate_pb2.GenerateRequest]:
    return [request_for(p, MAX_NEW, num_speculative_tokens=K, proposer=generate_pb2.PROPOSER_DRAFT_MODEL,
                        temperature=0.8, top_k=50, seed=1000 + i) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def expected_outputs(tiny_target_model, random_draft_cluster) -> list[list[int]]:
    """The target's greedy outputs, then the seeded sampled outputs on a cluster that keeps every
    session (random_draft_cluster: the same models, default store bounds)."""
    greedy = [reference_greedy(tiny_target_model, p, MAX_NEW, [EOS]) for p in PROMPTS]
    with grpc.insecure_channel(random_draft_cluster.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        sampled = [generate(stub, r)[0] for r in sampled_requests()]
    return greedy + sampled


def test_eviction_never_changes_output(tight_cluster, expected_outputs):
    """Four greedy and four seeded sampled generations at once (K=3, the draft model) on tiers that
    keep evicting each other's sessions: every output is exactly what it is without eviction (greedy:
    the target's own; sampled: draws depend on the seed and the position only)."""
    before_t, before_d = tight_cluster.status("target").evictions, tight_cluster.status("draft").evictions
    t0 = time.perf_counter()
    outs = run_concurrently(tight_cluster.address, greedy_requests() + sampled_requests())
    elapsed = time.perf_counter() - t0
    for i, (out, exp) in enumerate(zip(outs, expected_outputs)):
        kind = "greedy" if i < len(PROMPTS) else "seeded sampled"
        assert out == exp, f"{kind} generation {i % len(PROMPTS)}: output under eviction {out} != {exp} without eviction"
    target, draft = tight_cluster.status("target"), tight_cluster.status("draft")
    print(f"\n{len(outs)} concurrent generations ({sum(map(len, outs))} tokens) under eviction in {elapsed:.2f}s: "
          f"evictions target +{target.evictions - before_t}, draft +{draft.evictions - before_d}")
    assert target.evictions > before_t, "the target never evicted a session: the test exercised nothing"
    assert draft.evictions > before_d, "the draft never evicted a session: the test exercised nothing"
    tight_cluster.wait_no_sessions(5.0)


# --- 2. 1,000 generations leave nothing behind ----------------------------------------------------


def rss_mb(field: str = "VmRSS") -> float:
    """This process's resident memory (or another /proc/self/status field), in MB, after a garbage
    collection and handing free heap pages back to the OS, so that the figure tracks live memory."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


PROPOSERS = [generate_pb2.PROPOSER_DRAFT_MODEL, generate_pb2.PROPOSER_HYBRID, generate_pb2.PROPOSER_PROMPT_LOOKUP]
N_WARMUP, N_RUN, N_THREADS = 50, 1000, 2  # (more threads only contend for the GIL with the in-process servers)
RSS_BOUND_MB = 150


def workload(i: int) -> tuple[generate_pb2.GenerateRequest, str]:
    """Generation i of the mix: (request, how it ends: "done", "cancel" after the first chunk, or
    "deadline": a client deadline so short that it usually expires mid-generation)."""
    a, b = 100 + i % 97, 5000 + i % 89
    ids = [1, a, b, 7, a, b]  # a repeated bigram: prompt lookup finds matches
    fields = dict(proposer=PROPOSERS[i % 3])
    if i % 5:
        fields["num_speculative_tokens"] = (i // 3) % 4  # else adaptive K
    if (i // 3) % 2:
        fields.update(temperature=0.9, seed=i)  # (no top_p: a nucleus over a flat tiny model sorts the vocabulary)
    if i % 10 == 7:  # long enough to still be running when the client walks away
        return request_for(ids, 48, ignore_eos=True, **fields), "cancel"
    if i % 20 == 13:
        return request_for(ids, 48, ignore_eos=True, **fields), "deadline"
    max_new = 2 if i % 4 else 3 + i % 8 // 4  # mostly 2 tokens (cheap), some 3 and 4
    return request_for(ids, max_new, **fields), "done"


def run_one(stub, i: int) -> str:
    req, how = workload(i)
    if how == "done":
        ids, _ = generate(stub, req)
        assert 1 <= len(ids) <= req.max_new_tokens
        return "done"
    if how == "deadline":
        try:
            generate(stub, req, timeout=0.003 + 0.002 * (i % 7))
        except grpc.RpcError as e:
            # The right code is DEADLINE_EXCEEDED; the coordinator sometimes answers UNAVAILABLE, which
            # test_expired_client_deadline_is_deadline_exceeded pins. Here only the cleanup matters.
            assert e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE), f"{e.code().name}: {e.details()}"
            return "deadline"
        return "done"
    call = stub.Generate(req, timeout=RPC_TIMEOUT)
    first = next(call)
    assert first.HasField("chunk")
    call.cancel()
    try:
        rest = list(call)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.CANCELLED, f"{e.code().name}: {e.details()}"
        return "cancelled"
    assert rest and rest[-1].HasField("result")  # it finished before the cancel arrived
    return "done"


def test_thousand_generations_leave_no_sessions_and_no_memory(random_draft_cluster):
    cluster = random_draft_cluster
    with grpc.insecure_channel(cluster.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        with ThreadPoolExecutor(N_THREADS) as pool:
            t0 = time.perf_counter()
            list(pool.map(lambda i: run_one(stub, i), range(N_WARMUP)))
            warmup_s = time.perf_counter() - t0
            cluster.wait_no_sessions(5.0)
            rss_before = rss_mb()
            t0 = time.perf_counter()
            outcomes = list(pool.map(lambda i: run_one(stub, N_WARMUP + i), range(N_RUN)))
            run_s = time.perf_counter() - t0
    target, draft = cluster.wait_no_sessions(5.0)
    rss_after, peak = rss_mb(), rss_mb("VmHWM")
    cancelled, expired = outcomes.count("cancelled"), outcomes.count("deadline")
    print(f"\n{N_WARMUP} warm-up generations in {warmup_s:.1f}s; {N_RUN} generations ({cancelled} cancelled after their "
          f"first chunk, {expired} past a tiny deadline) in {run_s:.1f}s "
          f"({N_RUN / run_s:.0f}/s, {N_THREADS} threads); RSS {rss_before:.1f} MB -> {rss_after:.1f} MB "
          f"({rss_after - rss_before:+.1f} MB, peak {peak:.1f} MB); tiers after: target {target.num_sessions} sessions / {target.cached_tokens} "
          f"tokens, draft {draft.num_sessions} / {draft.cached_tokens}")
    assert len(outcomes) == N_RUN
    assert cancelled >= N_RUN // 20, f"only {cancelled} generations were cancelled mid-stream"
    assert rss_after - rss_before < RSS_BOUND_MB, f"RSS grew by {rss_after - rss_before:.1f} MB over {N_RUN} generations"


# --- 3. a client deadline that expires is DEADLINE_EXCEEDED -----------------------------------------


N_DEADLINES = 60


def test_expired_client_deadline_is_deadline_exceeded(random_draft_cluster):
    """A client deadline too short for the request, on a healthy cluster, must end the stream with
    DEADLINE_EXCEEDED (gRPC's code for exactly that), never UNAVAILABLE, which tells the client the
    service is down and invites an immediate retry. A ~1,000-token prompt makes the first Verify (its
    prefill) long, and the deadlines are spread over 20-60% of the time a whole generation takes, so
    that many of them expire while the coordinator waits for that Verify (where the wrong code shows,
    in about one attempt in four on a 2-core machine). Sessions are freed all the same."""
    req = request_for([1] + [(7 + 104729 * j) % (VOCAB - 10) + 3 for j in range(999)], 8, num_speculative_tokens=0)
    outcomes: dict[str, int] = {}
    with grpc.insecure_channel(random_draft_cluster.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        t0 = time.perf_counter()
        generate(stub, req)
        full_s = time.perf_counter() - t0
        wrong = []
        for i in range(N_DEADLINES):
            deadline = full_s * (0.2 + 0.4 * i / N_DEADLINES)
            try:
                generate(stub, req, timeout=deadline)
                outcome = "OK"
            except grpc.RpcError as e:
                outcome = e.code().name
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    wrong.append(f"deadline {deadline * 1e3:.1f} ms: {e.code().name}: {e.details()}")
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"\nwhole generation {full_s * 1e3:.1f} ms; outcomes with shorter deadlines: {outcomes}")
    random_draft_cluster.wait_no_sessions(5.0)
    assert not wrong, f"{len(wrong)} of {N_DEADLINES} expired deadlines were not DEADLINE_EXCEEDED:\n" + "\n".join(wrong[:5])
