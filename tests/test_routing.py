"""Session-affine routing over many replicas (coordinator/routing.py), in-process: two target and two draft
replicas on 127.0.0.x addresses found through one DNS name per tier that the test serves
(tests/dns_server.py), reached by the coordinator through gRPC's ring hash on the session-id header.

- grpcio honours the policy (the start-up probe), and refuses without the environment variable;
- 16 concurrent generations (greedy and seeded sampling, draft and hybrid proposers) equal their
  single-replica runs, spread over both replicas of each tier, and never re-prefill (every call of a
  session reached the replica holding it);
- a replica with another tokenizer is refused with a clear error when first used: a target replica fails
  its sessions with FAILED_PRECONDITION naming it, a draft replica is not used (prompt lookup instead).

Replicas that die, drain or join: tests/test_replica_faults.py (real processes)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from transformers import AutoTokenizer

from coordinator.tiers.routing import RoutingUnsupported, probe_ring_hash
from specdec.serving.routing import RING_HASH_ENV, RoutingConfig
from specdec.client import Client
from specdec.models import make_tiny_model
from tests.helpers import TOKENIZER_DIR
from tests.replicas import ReplicaCluster

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

TARGETS, DRAFTS = ["127.0.0.2", "127.0.0.3"], ["127.0.0.4", "127.0.0.5"]
N_TOKENS = 24


def test_service_config_is_ring_hash_on_the_session_header_with_health_checks():
    config = RoutingConfig().service_config("specdec.v1.TargetService")
    assert config == {
        "loadBalancingConfig": [{"ring_hash_experimental": {
            "requestHashHeader": "specdec-session-id", "minRingSize": 1024, "maxRingSize": 4096}}],
        "healthCheckConfig": {"serviceName": "specdec.v1.TargetService"},
    }
    assert RoutingConfig().metadata("abc") == (("specdec-session-id", "abc"),)


def test_probe_passes_with_this_grpcio():
    asyncio.run(probe_ring_hash(RoutingConfig()))  # raises RoutingUnsupported otherwise


def test_probe_refuses_when_grpc_ignores_the_header(monkeypatch):
    """Without the variable grpc-core drops requestHashHeader from the config (and then fails every pick):
    the probe says so, naming the variable."""
    monkeypatch.setenv(RING_HASH_ENV, "false")
    with pytest.raises(RoutingUnsupported, match=f"{RING_HASH_ENV}=true.*it is 'false'"):
        asyncio.run(probe_ring_hash(RoutingConfig()))


def requests() -> list[dict]:
    """16 generations: greedy (adaptive K and fixed K) and seeded sampling (fixed K: reproducible)."""
    out = []
    for i in range(16):
        kw = dict(prompt=f"Request {i}: one two three four, one two three", max_new_tokens=N_TOKENS, ignore_eos=True)
        kind = i % 4
        if kind == 0:
            kw.update(proposer="hybrid")  # greedy, adaptive K
        elif kind == 1:
            kw.update(proposer="draft", num_speculative_tokens=3)
        elif kind == 2:
            kw.update(proposer="draft", num_speculative_tokens=2, temperature=0.8, seed=100 + i)
        else:
            kw.update(proposer="hybrid", num_speculative_tokens=3, temperature=1.0, top_p=0.9, seed=100 + i)
        out.append(kw)
    return out


class SessionWatch:
    """Polls GetStatus on every replica while a run goes on; keeps the most sessions each one held."""

    def __init__(self, cluster: ReplicaCluster) -> None:
        self.cluster = cluster
        self.most = {(tier, a): 0 for tier, reps in cluster.replicas.items() for a in reps}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for (tier, address) in self.most:
                n = self.cluster.replicas[tier][address].status().num_sessions
                self.most[(tier, address)] = max(self.most[(tier, address)], n)
            time.sleep(0.02)

    def __enter__(self) -> "SessionWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


def counter(coordinator, name: str, **labels) -> float:
    """Sum of a coordinator counter's samples that carry `labels`."""
    total = 0.0
    for family in coordinator.registry.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def test_sixteen_generations_spread_over_two_replicas_per_tier_and_equal_single_replica_runs(tiny_target, tiny_random_draft):
    cluster = ReplicaCluster(tiny_target, tiny_random_draft, target_addresses=TARGETS, draft_addresses=DRAFTS)
    try:
        # Single-replica runs: a coordinator that reaches one replica per tier, one generation at a time.
        single = cluster.coordinator(target=f"{TARGETS[0]}:{cluster.ports['target']}",
                                     draft=f"{DRAFTS[0]}:{cluster.ports['draft']}")
        with Client(single) as c:
            references = [c.generate(**kw).token_ids for kw in requests()]
        assert all(len(r) == N_TOKENS for r in references)

        address = cluster.coordinator()  # both tiers by DNS name: two replicas each
        many = cluster.coordinators[-1]
        with SessionWatch(cluster) as watch, Client(address) as c, ThreadPoolExecutor(16) as pool:
            outputs = list(pool.map(lambda kw: c.generate(**kw), requests()))
        assert [o.token_ids for o in outputs] == references
        for (tier, replica), most in watch.most.items():
            assert most > 0, f"{tier} replica {replica} never held a session: {watch.most}"
        for tier, replicas in cluster.replicas.items():
            for replica in replicas.values():
                assert replica.status().steps > 0, (tier, replica.address)
        # Affinity: every call of a session reached the replica holding it, so no replica ever lacked one.
        assert counter(many, "specdec_reprefills_total") == 0
        assert counter(many, "specdec_tier_errors_total") == 0
        cluster.wait_no_sessions()  # every session was ended on its own replica
    finally:
        cluster.close()


def test_direct_rounds_reach_the_target_replica_of_their_session(tiny_target, tiny_random_draft):
    """The draft replicas run the fixed-K sessions' rounds, verifying on the target tier by its DNS name: each
    session's calls reach one target replica (by its routing key, as the coordinator's would), both replicas
    serve some, and the outputs are the single-replica runs' own."""
    cluster = ReplicaCluster(tiny_target, tiny_random_draft, target_addresses=TARGETS, draft_addresses=DRAFTS,
                             direct=True)
    try:
        fixed = [kw for kw in requests() if kw["proposer"] == "draft" and kw.get("num_speculative_tokens")]  # eight
        single = cluster.coordinator(target=f"{TARGETS[0]}:{cluster.ports['target']}",
                                     draft=f"{DRAFTS[0]}:{cluster.ports['draft']}", direct_rounds=False)
        with Client(single) as c:
            references = [c.generate(**kw).token_ids for kw in fixed]
        address = cluster.coordinator()
        many = cluster.coordinators[-1]
        with SessionWatch(cluster) as watch, Client(address) as c, ThreadPoolExecutor(len(fixed)) as pool:
            outputs = list(pool.map(lambda kw: c.generate(**kw), fixed * 2))  # 16 sessions: both replicas serve some
        assert [o.token_ids for o in outputs] == references * 2
        assert all(o.stats["direct_rounds"] == o.stats["rounds"] > 0 for o in outputs)
        for address_ in TARGETS:
            assert watch.most[("target", address_)] > 0, f"target replica {address_} never held a session: {watch.most}"
        # Affinity: the Drive's Verify calls reached the replica holding the session; nothing failed over.
        assert counter(many, "specdec_tier_errors_total") == 0
        cluster.wait_no_sessions()
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def foreign_model(tmp_path_factory) -> str:
    """A tiny model whose tokenizer differs from the SmolLM2 one (one added special token)."""
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    tok.add_special_tokens({"additional_special_tokens": ["<|foreign|>"]})
    return make_tiny_model(tmp_path_factory.mktemp("foreign") / "model", seed=7, tokenizer=tok)


def test_a_replica_with_another_tokenizer_is_refused_when_first_used(tiny_target, foreign_model):
    """The coordinator starts against good replicas; then a foreign target and a foreign draft replica join
    the tiers' names. Sessions hashed to the foreign target fail with FAILED_PRECONDITION naming it and its
    model; sessions hashed to the foreign draft draft by prompt lookup instead, output unchanged."""
    cluster = ReplicaCluster(tiny_target, tiny_target, target_addresses=["127.0.0.2"], draft_addresses=["127.0.0.4"],
                             spare_addresses=["127.0.0.3", "127.0.0.5"])
    try:
        address = cluster.coordinator()
        coordinator = cluster.coordinators[-1]
        kw = dict(prompt="one two three four five", max_new_tokens=12, ignore_eos=True, proposer="draft",
                  num_speculative_tokens=2)
        with Client(address) as c:
            reference = c.generate(**kw).token_ids
        bad_target = cluster.add("target", "127.0.0.3", foreign_model)
        cluster.add("draft", "127.0.0.5", foreign_model)
        refused, served, deadline = [], 0, time.monotonic() + 60
        with Client(address) as c:
            while not (refused and served >= 3 and counter(coordinator, "specdec_tier_errors_total", tier="draft",
                                                             code="FAILED_PRECONDITION") > 0):
                assert time.monotonic() < deadline, f"refused {len(refused)}, served {served}"
                try:
                    out = c.generate(**kw)
                except grpc.RpcError as e:
                    refused.append(e)
                    continue
                assert out.token_ids == reference  # a session on the foreign draft fell back, output unchanged
                served += 1
        for e in refused:
            assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, e
            assert "tokenizer mismatch" in e.details() and foreign_model in e.details(), e.details()
            assert "target" in e.details()
        assert bad_target.status().steps == 0, "the foreign target never computed anything"
    finally:
        cluster.close()
