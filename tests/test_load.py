"""Load and admission control: 32 concurrent clients against one coordinator, and limits that answer
RESOURCE_EXHAUSTED instead of queueing without bound."""

import threading
import time

import grpc
import pytest

from coordinator.api.admission import AdmissionConfig
from specdec.client import Client
from tests.helpers import Cluster

pytestmark = pytest.mark.slow


def rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def test_32_concurrent_clients_match_their_single_client_runs(random_draft_cluster):
    cluster = random_draft_cluster
    prompts = [[1, 100 + i, 2000 + 7 * i, 333, 4000 + i] for i in range(32)]
    kw = dict(max_new_tokens=100, ignore_eos=True, num_speculative_tokens=3, proposer="hybrid")
    with Client(cluster.address) as c:
        solo = [c.generate(token_ids=p, **kw).token_ids for p in prompts[:4]]  # spot references
    rss_before = rss_mb()
    outputs, errors = [None] * 32, []

    def client(i):
        try:
            with Client(cluster.address, timeout_s=300) as c:
                outputs[i] = c.generate(token_ids=prompts[i], **kw).token_ids
        except Exception as e:
            errors.append(e)

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    elapsed = time.monotonic() - t0
    rss_after = rss_mb()
    print(f"\n32 clients x 100 tokens: {elapsed:.1f}s, {3200 / elapsed:.0f} tokens/s aggregate, "
          f"RSS {rss_before:.0f} -> {rss_after:.0f} MB")
    assert errors == []
    assert all(len(o) == 100 for o in outputs)
    assert outputs[:4] == solo
    # every other output equals its own single-client run too
    with Client(cluster.address) as c:
        for i in range(4, 32, 7):
            assert outputs[i] == c.generate(token_ids=prompts[i], **kw).token_ids
    assert rss_after - rss_before < 300, "memory grew without bound under load"


@pytest.fixture(scope="module")
def limited_cluster(tiny_target, tiny_random_draft):
    cluster = Cluster(tiny_target, tiny_random_draft, coordinator_overrides={
        "admission": AdmissionConfig(max_concurrency=2, max_requests_per_s=0.0)})
    yield cluster
    cluster.close()


def test_concurrency_limit_answers_resource_exhausted(limited_cluster):
    results, lock = [], threading.Lock()
    start = threading.Barrier(6)

    def client():
        start.wait()
        try:
            with Client(limited_cluster.address, timeout_s=120) as c:
                out = c.generate(token_ids=[1, 2, 3, 4], max_new_tokens=300, ignore_eos=True, num_speculative_tokens=2, proposer="draft")
            with lock:
                results.append(("ok", len(out.token_ids)))
        except grpc.RpcError as e:
            with lock:
                results.append((e.code(), e.details()))

    threads = [threading.Thread(target=client) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    oks = [r for r in results if r[0] == "ok"]
    busy = [r for r in results if r[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert len(oks) + len(busy) == 6, results
    assert 1 <= len(oks) and len(busy) >= 1
    assert all(n == 300 for _, n in oks)
    assert all("max_concurrency=2" in msg for _, msg in busy)
    # and once the load is gone, requests are admitted again
    with Client(limited_cluster.address) as c:
        assert len(c.generate(token_ids=[1, 2, 3], max_new_tokens=5, num_speculative_tokens=2).token_ids) == 5


def test_rate_limit_answers_resource_exhausted(tiny_target, tiny_random_draft):
    cluster = Cluster(tiny_target, tiny_random_draft, coordinator_overrides={
        "admission": AdmissionConfig(max_concurrency=0, max_requests_per_s=2.0, max_queue_wait_s=0.05)})
    try:
        codes = []
        with Client(cluster.address) as c:
            for _ in range(6):  # a burst, well above 2 per second
                try:
                    c.generate(token_ids=[1, 2, 3], max_new_tokens=1)
                    codes.append("ok")
                except grpc.RpcError as e:
                    codes.append(e.code())
                    assert "max_requests_per_s" in e.details()
        assert codes[:2] == ["ok", "ok"]
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
        time.sleep(1.1)
        with Client(cluster.address) as c:
            assert len(c.generate(token_ids=[1, 2, 3], max_new_tokens=1).token_ids) == 1
    finally:
        cluster.close()
