"""The round trace, the coordinator's side: where each round's time goes across the three processes.

Each tier's response carries a TierTrace (common.proto: its servicer, queue, steps, the hop back to the
event loop, the encoding; durations on the replica's clock, specdec.serving.tier_trace). The coordinator
knows each rpc's round trip; the round trip less the replica's parts is the wire (both gRPC stacks,
loopback or network). A generation sums them per tier (GenerationStats.trace, which bench.overhead
prints per round), and with an OTLP endpoint set (--otlp-endpoint) every round is also exported as
OpenTelemetry spans: a "round" span, an "<tier>.rpc" span per rpc, and inside it the replica's parts
(placed after half the wire time, since only durations cross processes). Off by default; when off nothing
is imported and a round costs one list check.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

from specdec.proto import common_pb2, generate_pb2

PARTS = ("decode", "queue", "step", "wake", "encode")  # TierTrace's, in the order they happen


@dataclass
class TierTotals:
    """One tier's rpcs of a generation, summed (milliseconds)."""

    calls: int = 0
    rpc_ms: float = 0.0
    decode_ms: float = 0.0
    queue_ms: float = 0.0
    step_ms: float = 0.0
    wake_ms: float = 0.0
    encode_ms: float = 0.0
    wire_ms: float = 0.0

    def add(self, wall_ms: float, trace: common_pb2.TierTrace | None) -> None:
        self.calls += 1
        self.rpc_ms += wall_ms
        inside = 0.0
        if trace is not None:
            for part in PARTS:
                ms = getattr(trace, part + "_us") / 1e3
                setattr(self, part + "_ms", getattr(self, part + "_ms") + ms)
                inside += ms
        self.wire_ms += max(0.0, wall_ms - inside)

    def message(self) -> generate_pb2.TierTraceTotals:
        return generate_pb2.TierTraceTotals(**{f.name: getattr(self, f.name) for f in fields(self)})


class OtlpRounds:
    """Rounds as OpenTelemetry spans, batched to an OTLP/gRPC collector (or to span_exporter, for tests)."""

    def __init__(self, endpoint: str = "", span_exporter=None, service_name: str = "specdec-coordinator") -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if span_exporter is None:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https")))
        else:
            processor = SimpleSpanProcessor(span_exporter)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("specdec.coordinator")
        self._epoch_ns = time.time_ns() - int(time.perf_counter() * 1e9)  # perf_counter -> epoch

    def _ns(self, t: float) -> int:
        return self._epoch_ns + int(t * 1e9)

    def round(self, session_id: str, index: int, started: float, ended: float, rpcs: list, attributes: dict) -> None:
        """rpcs: (tier, started, wall_ms, TierTrace | None) of the round, perf_counter seconds."""
        from opentelemetry import trace

        root = self.tracer.start_span("round", start_time=self._ns(started),
                                      attributes={"specdec.session_id": session_id, "specdec.round": index, **attributes})
        context = trace.set_span_in_context(root)
        for tier, t0, wall_ms, tier_trace in rpcs:
            rpc = self.tracer.start_span(f"{tier}.rpc", context=context, start_time=self._ns(t0))
            if tier_trace is not None:
                parts = [(part, getattr(tier_trace, part + "_us") / 1e6) for part in PARTS]
                at = t0 + max(0.0, wall_ms / 1e3 - sum(s for _, s in parts)) / 2  # half the wire before the replica
                inner = trace.set_span_in_context(rpc)
                for part, seconds in parts:
                    self.tracer.start_span(f"{tier}.{part}", context=inner, start_time=self._ns(at)).end(self._ns(at + seconds))
                    at += seconds
            rpc.end(self._ns(t0 + wall_ms / 1e3))
        root.end(self._ns(ended))

    def shutdown(self) -> None:
        self.provider.shutdown()


class RoundTrace:
    """One generation's round trace: per-tier totals, and its rounds as spans when `spans` is set."""

    def __init__(self, spans: OtlpRounds | None = None, session_id: str = "") -> None:
        self.tiers = {"draft": TierTotals(), "target": TierTotals()}
        self.spans = spans
        self.session_id = session_id
        self._rpcs: list | None = [] if spans is not None else None  # the round's rpcs, only when exporting

    def observe(self, tier: str, started: float, wall_ms: float, trace: common_pb2.TierTrace | None) -> None:
        """One rpc that succeeded: its start (perf_counter seconds), round trip and the replica's TierTrace."""
        self.tiers[tier].add(wall_ms, trace)
        if self._rpcs is not None:
            self._rpcs.append((tier, started, wall_ms, trace))

    def end_round(self, index: int, started: float, ended: float, **attributes) -> None:
        if self._rpcs is not None:
            self.spans.round(self.session_id, index, started, ended, self._rpcs, attributes)
            self._rpcs = []

    def totals(self) -> generate_pb2.RoundTraceTotals:
        return generate_pb2.RoundTraceTotals(draft=self.tiers["draft"].message(), target=self.tiers["target"].message())
