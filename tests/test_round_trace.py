"""The round trace: each tier's TierTrace in its responses, summed into GenerationStats.trace through real
servers, and exported as OpenTelemetry spans to a real OTLP/gRPC collector when an endpoint is set."""

import asyncio
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from coordinator.trace import PARTS, OtlpRounds, RoundTrace
from specdec.client import Client
from specdec.core.prefix import PrefixHashes
from specdec.engine.config import TierConfig
from specdec.engine.engine import Engine
from specdec.engine.verify import VerifyWork
from specdec.math.params import SamplingParams
from specdec.models import ModelConfig, TokenizerSource, load_model, load_tokenizer
from specdec.proto import common_pb2
from tests.helpers import Cluster, device_model

PROMPT = [1, 9038, 2115, 253, 1345]


def test_tier_parts_lie_inside_the_round_trip():
    trace = RoundTrace()
    trace.observe("target", 0.0, 2.0, common_pb2.TierTrace(decode_us=100, queue_us=200, step_us=500, wake_us=50, encode_us=50))
    trace.observe("target", 1.0, 1.0, None)  # a reply without a trace (an older replica): all of it counts as wire
    t = trace.totals().target
    assert t.calls == 2 and t.rpc_ms == pytest.approx(3.0)
    assert (t.decode_ms, t.queue_ms, t.step_ms, t.wake_ms, t.encode_ms) == pytest.approx((0.1, 0.2, 0.5, 0.05, 0.05))
    assert t.wire_ms == pytest.approx(3.0 - 0.9)
    assert trace.totals().draft.calls == 0


def test_a_round_as_spans():
    memory = InMemorySpanExporter()
    spans = OtlpRounds(span_exporter=memory)
    trace = RoundTrace(spans, session_id="s1")
    trace.observe("draft", 10.0, 1.0, common_pb2.TierTrace(step_us=400))
    trace.observe("target", 10.001, 2.0, common_pb2.TierTrace(decode_us=100, queue_us=200, step_us=1000, wake_us=100, encode_us=100))
    trace.end_round(0, 9.9995, 10.0035, **{"specdec.accepted": 2})
    spans.shutdown()
    got = {s.name: s for s in memory.get_finished_spans()}
    assert set(got) == {"round", "draft.rpc", "target.rpc", *(f"{tier}.{p}" for tier in ("draft", "target") for p in PARTS)}
    root = got["round"]
    assert root.attributes["specdec.session_id"] == "s1" and root.attributes["specdec.accepted"] == 2
    for tier in ("draft", "target"):
        rpc = got[f"{tier}.rpc"]
        assert rpc.parent.span_id == root.context.span_id
        assert root.start_time <= rpc.start_time <= rpc.end_time <= root.end_time
        parts = [got[f"{tier}.{p}"] for p in PARTS]
        for a, b in zip(parts, parts[1:]):
            assert a.end_time == b.start_time  # the replica's parts, in order, back to back
        for part in parts:
            assert part.parent.span_id == rpc.context.span_id
            assert rpc.start_time <= part.start_time <= part.end_time <= rpc.end_time
    step = got["target.step"]
    assert step.end_time - step.start_time == pytest.approx(1_000_000, abs=2)  # 1 ms in ns
    # the target's 1.5 ms inside a 2 ms round trip: after half of the 0.5 ms of wire
    assert got["target.decode"].start_time - got["target.rpc"].start_time == pytest.approx(250_000, abs=2)


class CountingLoop(asyncio.SelectorEventLoop):
    """The standard event loop, counting the wake-ups other threads ask of it."""

    wakeups = 0

    def call_soon_threadsafe(self, *args, **kwargs):
        self.wakeups += 1
        return super().call_soon_threadsafe(*args, **kwargs)


def paused_batch(engine, submits) -> tuple[list, int]:
    """The coroutines `submits` started while `engine` is paused (every work queued before a step or pass looks),
    run to their results on an event loop that counts the wake-ups other threads ask of it; the engine closed
    after. Returns (results, wake-ups)."""

    async def batch():
        with engine.paused():
            tasks = [asyncio.ensure_future(s) for s in submits]
            await asyncio.sleep(0)
        return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    try:
        with asyncio.Runner(loop_factory=CountingLoop) as runner:
            return runner.run(batch()), runner.get_loop().wakeups
    finally:
        engine.close()


def test_one_step_wakes_the_event_loop_once(tiny_target):
    engine = Engine(TierConfig(ModelConfig("tiny")), load_model(device_model(tiny_target)), TokenizerSource.of(load_tokenizer(tiny_target)))
    engine.start()
    works = [VerifyWork.create(f"s{i}", 0, PrefixHashes([]).at(0), [1, 100 + i, 200 + i], [7], None, SamplingParams(), i)
             for i in range(6)]

    results, wakeups = paused_batch(engine, [engine.submit(w) for w in works])  # one step plans them all
    assert [r.batch_sessions for r in results] == [6] * 6, "the six sessions shared one step"
    assert {r.step_id for r in results} == {engine.step_base + engine.steps}, "and each reply names it"
    assert wakeups == 1, "the step's six answers were handed back together"
    for w in works:  # the round trace's timestamps: submitted <= first step <= answered
        assert 0 < w.submitted_at <= w.first_step_at <= w.settled_at
    assert len({w.first_step_at for w in works}) == 1


@pytest.mark.servers
def test_generation_stats_carry_the_trace(self_draft_cluster):
    with Client(self_draft_cluster.address) as client:
        out = client.generate(token_ids=PROMPT, max_new_tokens=12, num_speculative_tokens=2, proposer="draft",
                              ignore_eos=True)
    s, rounds = out.stats, out.stats["rounds"]
    for tier in ("draft", "target"):
        t = s["trace"][tier]
        assert t["calls"] == rounds
        assert t["step_ms"] > 0 and t["queue_ms"] >= 0 and t["wire_ms"] > 0
        inside = sum(t[p + "_ms"] for p in PARTS)
        assert inside + t["wire_ms"] == pytest.approx(t["rpc_ms"], rel=1e-6)


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector: keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans = []

    def Export(self, request, context):
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                self.spans.extend(scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def collector():
    sink = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield sink, port
    server.stop(None)


@pytest.mark.servers
def test_rounds_reach_an_otlp_collector(tiny_target, collector):
    sink, port = collector
    cluster = Cluster(tiny_target, tiny_target, coordinator_overrides={"otlp_endpoint": f"127.0.0.1:{port}"})
    try:
        with Client(cluster.address) as client:
            out = client.generate(token_ids=PROMPT, max_new_tokens=9, num_speculative_tokens=2, proposer="draft",
                                  ignore_eos=True)
    finally:
        cluster.close()  # the coordinator's shutdown flushes its spans
    names = [s.name for s in sink.spans]
    rounds = out.stats["rounds"]
    assert names.count("round") == rounds
    assert names.count("target.rpc") == rounds and names.count("draft.rpc") == rounds
    assert names.count("target.step") == rounds and names.count("target.wake") == rounds
