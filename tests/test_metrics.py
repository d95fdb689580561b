"""Prometheus metrics, scraped over HTTP from real /metrics endpoints and parsed with
prometheus_client.parser: TierMetrics with a fake load object and its rpc interceptor on a real draft
servicer, and the coordinator's counters after known generations, which must equal the generations' own
statistics exactly."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from draft_service.service import SERVICE_NAME as DRAFT_SERVICE
from draft_service.service import DraftServicer
from specdec.client import Client
from specdec.engine.sessions import SessionStoreConfig
from specdec.proto import common_pb2, draft_pb2, draft_pb2_grpc
from specdec.serving.metrics import TierMetrics, serve_metrics
from specdec.serving.server import Service, ServerConfig, create_server
from tests.helpers import Cluster

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)


def scrape(url: str, token: str | None = None) -> list:
    """Every sample of a real scrape: (name, labels, value). token: the coordinator's bearer token, if set."""
    response = httpx.get(url, timeout=10, headers={"authorization": f"Bearer {token}"} if token else None)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(response.text) for s in family.samples]


def value(samples: list, name: str, **labels) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(v for n, l, v in samples if n == name and all(l.get(k) == str(x) for k, x in labels.items()))


def names(samples: list) -> set[str]:
    return {n for n, _, _ in samples}


# --- TierMetrics ----------------------------------------------------------------------------------


def test_tier_metrics_scrape_reads_the_load_at_scrape_time():
    registry = CollectorRegistry()
    load = SimpleNamespace(num_sessions=3, cached_tokens=120, evictions=2, num_running=2, num_waiting=1,
                           kv_used_bytes=256, kv_capacity_bytes=1024, kv_resident_bytes=512, inline_steps=7)
    tm = TierMetrics(registry, "target", "m1", load=lambda: load)
    tm.observe_step(num_sessions=2, num_tokens=9, seconds=0.004)
    tm.observe_step(num_sessions=4, num_tokens=20, seconds=0.02)
    tm.observe_rpc("Verify", "OK", 0.01)
    tm.observe_rpc("Verify", "FAILED_PRECONDITION", 0.002)
    server = serve_metrics(registry, "127.0.0.1:0")
    try:
        s = scrape(server.url)
        labels = {"model_name": "m1", "tier": "target"}
        assert value(s, "vllm:num_requests_running", **labels) == 2
        assert value(s, "vllm:num_requests_waiting", **labels) == 1
        assert value(s, "vllm:kv_cache_usage_perc", **labels) == 0.25
        assert value(s, "specdec_tier_sessions", **labels) == 3
        assert value(s, "specdec_tier_cached_tokens", **labels) == 120
        assert value(s, "specdec_tier_evictions_total", **labels) == 2
        assert value(s, "specdec_tier_inline_steps_total", **labels) == 7
        assert value(s, "specdec_tier_queue_depth", **labels) == 1
        assert value(s, "specdec_tier_kv_capacity_bytes", **labels) == 1024
        assert value(s, "specdec_tier_kv_resident_bytes", **labels) == 512
        assert value(s, "specdec_tier_batch_size_count", **labels) == 2
        assert value(s, "specdec_tier_batch_size_sum", **labels) == 6
        assert value(s, "specdec_tier_batch_size_bucket", le="2.0", **labels) == 1
        assert value(s, "specdec_tier_batch_tokens_sum", **labels) == 29
        assert value(s, "specdec_tier_step_seconds_sum", **labels) == pytest.approx(0.024)
        assert value(s, "specdec_rpc_duration_seconds_count", rpc="Verify", **labels) == 2
        assert value(s, "specdec_rpc_errors_total", rpc="Verify", **labels) == 1  # OK is not an error
        assert value(s, "specdec_rpc_errors_total", rpc="Verify", code="FAILED_PRECONDITION", **labels) == 1

        load.num_sessions, load.kv_capacity_bytes = 5, 0  # read again at the next scrape; unknown capacity -> 0
        s = scrape(server.url)
        assert value(s, "specdec_tier_sessions", **labels) == 5
        assert value(s, "vllm:kv_cache_usage_perc", **labels) == 0

        def broken():
            raise RuntimeError("engine shutting down")

        tm.set_load(broken)  # a failing callback drops the load series, not the scrape
        s = scrape(server.url)
        assert "specdec_tier_sessions" not in names(s)
        assert value(s, "specdec_tier_batch_size_count", **labels) == 2
    finally:
        server.close()
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url, timeout=2)


def test_two_tiers_in_one_process_do_not_collide():
    draft, target = CollectorRegistry(), CollectorRegistry()
    TierMetrics(draft, "draft", "d").observe_step(1, 1, 0.001)
    TierMetrics(target, "target", "t")  # same metric names, own registry: no "Duplicated timeseries"
    with pytest.raises(ValueError, match="tier"):
        TierMetrics(CollectorRegistry(), "coordinator", "x")


def test_rpc_interceptor_on_a_real_draft_servicer(random_draft_cluster):
    """How a tier wires it: TierMetrics.interceptor() in create_server(). Unary, streaming and failing rpcs."""
    cluster = random_draft_cluster
    registry = CollectorRegistry()
    tm = TierMetrics(registry, "draft", "tiny-draft")

    async def start():  # on the cluster's event loop, where the tier's servers run
        server, port, _ = create_server([Service(DraftServicer(cluster.draft_tier, 64),
                                                 draft_pb2_grpc.add_DraftServiceServicer_to_server, DRAFT_SERVICE)],
                                        ServerConfig(), interceptors=[tm.interceptor()])
        await server.start()
        return server, port

    server, port = cluster._call(start())
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = draft_pb2_grpc.DraftServiceStub(ch)
            stub.GetStatus(common_pb2.StatusRequest(), timeout=10)
            ctx = common_pb2.SessionContext(session_id="metrics-test", prefix_len=0, new_tokens=[1, 2, 3])
            good = draft_pb2.ProposeRequest(context=ctx, num_tokens=2, sampling=common_pb2.SamplingParams(), seed=1)
            assert len(list(stub.ProposeStream(iter([good]), timeout=10))[0].tokens) == 2
            with pytest.raises(grpc.RpcError) as e:
                stub.Propose(draft_pb2.ProposeRequest(context=ctx, num_tokens=-1), timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            stub.EndSession(common_pb2.EndSessionRequest(session_id="metrics-test"), timeout=10)
    finally:
        cluster._call(server.stop(0))
    s = [(n, l, v) for f in registry.collect() for n, l, v, *_ in f.samples]
    labels = {"model_name": "tiny-draft", "tier": "draft"}
    for rpc in ("GetStatus", "ProposeStream", "Propose", "EndSession"):
        assert value(s, "specdec_rpc_duration_seconds_count", rpc=rpc, **labels) == 1, rpc
    assert value(s, "specdec_rpc_errors_total", **labels) == 1
    assert value(s, "specdec_rpc_errors_total", rpc="Propose", code="INVALID_ARGUMENT", **labels) == 1


def test_tier_metrics_as_the_tiers_serve_them(tiny_target, tiny_random_draft):
    """The tiers' own registries (as `python -m target_service --metrics-address` serves them), scraped
    over HTTP after concurrent generations: every engine step observed, the load read from the engine
    equals GetStatus, and every rpc counted."""
    cluster = Cluster(tiny_target, tiny_random_draft)
    servers = []
    try:
        with Client(cluster.address) as client, ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: client.generate(token_ids=[1, 5 + i, 9, 13], max_new_tokens=12, num_speculative_tokens=2,
                                                   proposer="draft"), range(4)))
        cluster.wait_no_sessions()  # the generations' clean-ups are done: nothing changes under the reads below
        for tier, config_name in (("target", "TargetConfig"), ("draft", "DraftConfig")):
            server = serve_metrics(cluster.tier_registries[config_name], "127.0.0.1:0")
            servers.append(server)
            status = cluster.status(tier)
            s = scrape(server.url)
            labels = {"tier": tier}
            assert value(s, "specdec_tier_step_seconds_count", **labels) == status.steps > 0
            assert value(s, "specdec_tier_batch_tokens_sum", **labels) == status.step_tokens
            assert value(s, "specdec_tier_batch_size_sum", **labels) >= status.steps
            assert value(s, "specdec_tier_kv_capacity_bytes", **labels) == status.kv_capacity_bytes > 0
            assert value(s, "specdec_tier_kv_used_bytes", **labels) == status.kv_used_bytes
            assert value(s, "vllm:num_requests_running", **labels) == 0
            rpc = "VerifyStream" if tier == "target" else "ProposeStream"
            assert value(s, "specdec_rpc_duration_seconds_count", rpc=rpc, **labels) >= 4
            # the sessions ended with their streams: a finished generation costs the tier no EndSession
            assert value(s, "specdec_rpc_duration_seconds_count", rpc="EndSession", **labels) == 0
    finally:
        for server in servers:
            server.close()
        cluster.close()


# --- the coordinator after known generations ---------------------------------------------------------


def test_counters_equal_the_generation_statistics_all_accepted(self_draft_cluster):
    """The target drafts for itself, so every draft is accepted: with K=3 and 10 tokens the rounds are
    3+1, 3+1 and (K clamped to the last token's budget) 1+1 tokens."""
    c = self_draft_cluster
    model = c.coordinator.frontend.model_name
    before = scrape(c.metrics_url)
    with Client(c.address) as client:
        out = client.generate(prompt="The quick brown fox", max_new_tokens=10, num_speculative_tokens=3,
                              proposer="draft", ignore_eos=True)
    after = scrape(c.metrics_url)

    def delta(name, **labels):
        return value(after, name, model_name=model, **labels) - value(before, name, model_name=model, **labels)

    st = out.stats
    assert (st["rounds"], st["draft_tokens"], st["accepted_tokens"], st["generated_tokens"]) == (3, 7, 7, 10)
    assert delta("vllm:spec_decode_num_drafts_total") == 3
    assert delta("vllm:spec_decode_num_draft_tokens_total") == st["draft_tokens"]
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == st["accepted_tokens"]
    per_pos = [delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=i) for i in range(5)]
    assert per_pos == [3, 2, 2, 0, 0]
    assert delta("vllm:prompt_tokens_total") == st["prompt_tokens"]
    assert delta("vllm:generation_tokens_total") == st["generated_tokens"] == 10
    assert delta("specdec_rounds_total", proposer="draft_model") == 3
    assert delta("specdec_num_speculative_tokens_sum", proposer="draft_model") == 7


def test_counters_equal_the_generation_statistics_mixed(self_draft_cluster):
    """Hybrid proposer, K=4, sampling at temperature 1 (the draft's q truncated to its top 64 tokens):
    rounds from a local proposer (suffix or prompt lookup, as the policy picks) and from the draft model, partly accepted. The per-round log records
    (DEBUG) are the generation's own per-round statistics; the counters must add up to exactly them."""
    c = self_draft_cluster
    model = c.coordinator.frontend.model_name
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.getMessage() == "round":
                records.append(record)

    logger = logging.getLogger("coordinator.api.frontend")
    handler, level = Keep(level=logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    before = scrape(c.metrics_url)
    try:
        with Client(c.address) as client:
            out = client.generate(prompt="one two three four five one two three four five one two three four five one two",
                                  max_new_tokens=40, proposer="hybrid", ignore_eos=True, temperature=1.0, seed=3,
                                  num_speculative_tokens=4)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    after = scrape(c.metrics_url)

    def delta(name, **labels):
        return value(after, name, model_name=model, **labels) - value(before, name, model_name=model, **labels)

    st = out.stats
    session = {r.session_id for r in records}
    assert len(session) == 1 and len(records) == st["rounds"]
    drafted = [r for r in records if r.drafts > 0]
    assert sum(r.drafts for r in records) == st["draft_tokens"]
    assert sum(r.accepted for r in records) == st["accepted_tokens"]
    assert 0 < st["accepted_tokens"] < st["draft_tokens"], "the case must mix accepted and rejected drafts"
    used = {r.proposer for r in drafted}
    assert "draft_model" in used and used & {"prompt_lookup", "suffix"}, f"the draft model and a local proposer: {used}"
    assert delta("vllm:spec_decode_num_drafts_total") == len(drafted)
    assert delta("vllm:spec_decode_num_draft_tokens_total") == st["draft_tokens"]
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == st["accepted_tokens"]
    for i in range(8):
        assert delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=i) == sum(r.accepted > i for r in records), i
    assert delta("vllm:prompt_tokens_total") == st["prompt_tokens"]
    assert delta("vllm:generation_tokens_total") == st["generated_tokens"]
    for proposer in ("draft_model", "prompt_lookup", "suffix"):
        assert delta("specdec_rounds_total", proposer=proposer) == sum(r.proposer == proposer for r in records)
        assert delta("specdec_num_speculative_tokens_sum", proposer=proposer) == sum(r.k for r in records if r.proposer == proposer)
        assert delta("specdec_proposer_draft_tokens_total", proposer=proposer) == sum(
            r.drafts for r in records if r.proposer == proposer) == st["by_proposer"].get(proposer, {}).get("draft_tokens", 0)
        assert delta("specdec_proposer_accepted_tokens_total", proposer=proposer) == sum(
            r.accepted for r in records if r.proposer == proposer) == st["by_proposer"].get(proposer, {}).get("accepted_tokens", 0)
    for part in ("draft", "verify", "tier", "network", "coordinator"):
        assert delta("specdec_round_seconds_count", part=part) == st["rounds"]
    assert delta("specdec_round_seconds_sum", part="verify") * 1e3 == pytest.approx(st["verify_ms"], rel=1e-6)
    # one TTFT per request; one inter-token latency per streamed output after the first (every round streams)
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == st["rounds"] - 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert value(after, "vllm:num_requests_running", model_name=model) == 0
    assert value(after, "vllm:num_requests_waiting", model_name=model) == 0


def test_grpc_errors_by_rpc_and_code(random_draft_cluster):
    c = random_draft_cluster
    model = c.coordinator.frontend.model_name
    before = scrape(c.metrics_url)
    with Client(c.address) as client:
        with pytest.raises(grpc.RpcError) as e:
            client.generate(prompt="x", max_new_tokens=0)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        client.info()
    after = scrape(c.metrics_url)

    def delta(name, **labels):
        return value(after, name, model_name=model, **labels) - value(before, name, model_name=model, **labels)

    assert delta("specdec_rpc_errors_total", rpc="Generate", code="INVALID_ARGUMENT") == 1
    assert delta("specdec_rpc_errors_total") == 1
    assert delta("specdec_rpc_duration_seconds_count", rpc="Generate") == 1
    assert delta("specdec_rpc_duration_seconds_count", rpc="GetInfo") == 1
    assert delta("vllm:request_success_total") == 0  # refused before it started: not a processed request


def test_reprefills_and_lookup_fallbacks(tiny_target):
    """A target that holds one session (two concurrent generations evict each other, so the coordinator
    resends the committed tokens), then a dead draft (rounds fall back to prompt lookup)."""
    c = Cluster(tiny_target, tiny_target, sessions=SessionStoreConfig(max_sessions=1))
    try:
        model = c.coordinator.frontend.model_name
        before = scrape(c.metrics_url)
        with Client(c.address) as client, ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda i: client.generate(prompt=f"{i} one two three one two three", max_new_tokens=24,
                                                           num_speculative_tokens=2, proposer="lookup", ignore_eos=True),
                                 range(2)))
        mid = scrape(c.metrics_url)

        def delta(a, b, name, **labels):
            return value(b, name, model_name=model, **labels) - value(a, name, model_name=model, **labels)

        lost = delta(before, mid, "specdec_tier_errors_total", tier="target", rpc="VerifyStream", code="FAILED_PRECONDITION")
        assert lost > 0, "the two sessions must have evicted each other"
        assert delta(before, mid, "specdec_reprefills_total", tier="target") == lost  # one full resend per loss
        assert all(o.stats["generated_tokens"] == 24 for o in outs)

        records = []

        class Keep(logging.Handler):
            def emit(self, record):
                if record.getMessage() == "round":
                    records.append(record)

        logger, handler = logging.getLogger("coordinator.api.frontend"), Keep(logging.DEBUG)
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        c.stop_draft()
        try:
            with Client(c.address) as client:
                out = client.generate(prompt="one two three one two three", max_new_tokens=12, num_speculative_tokens=2,
                                      proposer="draft", ignore_eos=True)
        finally:
            logger.removeHandler(handler)
            logger.setLevel(logging.NOTSET)
        after = scrape(c.metrics_url)
        fallbacks = sum(r.fallback for r in records)
        assert len(records) == out.stats["rounds"] and fallbacks >= out.stats["rounds"] - 1 > 0
        assert delta(mid, after, "specdec_lookup_fallbacks_total") == fallbacks
        lookup_rounds = sum(r.proposer == "prompt_lookup" for r in records)  # all but a last round without budget
        assert delta(mid, after, "specdec_rounds_total", proposer="prompt_lookup") == lookup_rounds >= out.stats["rounds"] - 1
        # The loss is seen either by a failed ProposeStream (counted) or first by the health probe (no call made);
        # either way the probe ends with the draft marked unreachable.
        assert value(mid, "specdec_tier_reachable", model_name=model, tier="draft") == 1
        deadline = time.monotonic() + 10
        while value(after, "specdec_tier_reachable", model_name=model, tier="draft") != 0 and time.monotonic() < deadline:
            time.sleep(0.1)
            after = scrape(c.metrics_url)
        assert value(after, "specdec_tier_reachable", model_name=model, tier="draft") == 0
        assert value(after, "specdec_tier_reachable", model_name=model, tier="target") == 1
    finally:
        c.close()
