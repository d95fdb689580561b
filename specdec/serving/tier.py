"""What the draft and target servers share: the per-session stream loop, the rpcs every tier serves alike,
the server over a tier's engine, and the entry point's body (run_tier).

Servicers are thin: each validates its request and converts it into an engine work item in one method
(checks shared by both tiers: specdec.serving.tier_checks), submits it and converts the result back.
Nothing here touches torch; the engine is used through its attributes (vocab_size, max_context, config,
eos_token_ids, tokenizer_fingerprint, device) and methods (end_session, status).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import CollectorRegistry

from specdec.core.errors import TIER_STATUS_METADATA, as_request_error
from specdec.models import served_model_name
from specdec.proto import common_pb2
from specdec.serving.flags import write_port_file
from specdec.serving.metrics import TierMetrics, serve_metrics
from specdec.serving.server import Service, ServerConfig, create_server, handle_errors, run_event_loop, serve

def model_info(engine) -> common_pb2.ModelInfo:
    c = engine.config
    return common_pb2.ModelInfo(
        model=c.model.path, vocab_size=engine.vocab_size, tokenizer_fingerprint=engine.tokenizer_fingerprint,
        eos_token_ids=engine.eos_token_ids, max_context=engine.max_context, device=str(engine.device),
        dtype=c.model.dtype, max_draft_tokens=c.max_draft_tokens, max_batch_sessions=c.batch.max_batch_sessions,
        max_batch_tokens=c.batch.max_batch_tokens, feature_layers=getattr(engine, "feature_layers", ()),
        feature_width=getattr(engine, "feature_width", 0))


DRAINING = "replica draining: open a new stream (it reaches another replica)"


async def serve_session_stream(servicer: "TierRpcs", requests: AsyncIterator, context,
                               handle: Callable[[Any], Awaitable[Any]],
                               parts: Callable[[Any], AsyncIterator[Any] | None] | None = None) -> AsyncIterator[Any]:
    """The loop of a per-session bidirectional stream (ProposeStream, VerifyStream): one response per
    request, in order, each from handle(request); or, where parts(request) gives an iterator, its messages
    (partial responses, then the response). A failed request ends the stream with its status (the
    caller opens a new one). The stream pins the sessions it served: when it ends (done, failed,
    cancelled, the coordinator gone) the tier drops them, so a vanished coordinator leaks no KV memory.
    Once the replica drains (SIGTERM), the stream's next request ends it with UNAVAILABLE instead of
    being served, so the session moves to another replica at once rather than when the grace runs out."""
    engine = servicer.engine
    sessions: set[str] = set()
    try:
        async for request in requests:
            if servicer.draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING, TIER_STATUS_METADATA)
            sessions.add(request.context.session_id)
            many = parts(request) if parts is not None else None
            try:
                if many is not None:
                    async for message in many:
                        yield message
                    continue
                response = await handle(request)
            except Exception as e:
                err = as_request_error(e)
                await context.abort(err.code, err.message, TIER_STATUS_METADATA)
            yield response
    finally:
        for sid in sessions:
            engine.end_session(sid)


class TierRpcs:
    """The rpcs every tier serves the same way; servicers mix this in and set self.engine."""

    engine = None
    draining = False  # set when the replica starts draining (serve_session_stream)

    async def drain(self) -> None:
        """The replica is shutting down: streams end at their next request (unary rpcs keep being served)."""
        self.draining = True

    @handle_errors
    async def EndSession(self, request, context):
        return common_pb2.EndSessionResponse(existed=self.engine.end_session(request.session_id))

    @handle_errors
    async def GetModelInfo(self, request, context):
        return model_info(self.engine)

    @handle_errors
    async def GetStatus(self, request, context):
        s = self.engine.status()
        return common_pb2.StatusResponse(
            num_sessions=s.num_sessions, cached_tokens=s.cached_tokens, evictions=s.evictions,
            num_running=s.num_running, num_waiting=s.num_waiting, kv_used_bytes=s.kv_used_bytes,
            kv_capacity_bytes=s.kv_capacity_bytes, kv_capacity_tokens=s.kv_capacity_tokens, steps=s.steps,
            step_tokens=s.step_tokens, kv_resident_bytes=s.kv_resident_bytes, step_mode=s.step_mode,
            compile_seconds=s.compile_s, prefix_cache_sessions=s.prefix_cache_sessions,
            prefix_cache_tokens=s.prefix_cache_tokens,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            cost_curve=[common_pb2.StepCost(sessions=b, tokens=n, ms=ms) for b, n, ms in self.engine.cost_curve],
            feed_cost=[common_pb2.StepCost(sessions=b, tokens=n, ms=ms) for b, n, ms in self.engine.feed_cost])


@dataclass
class TierServer:
    """A tier's gRPC server over its engine, with the tier's own metrics registry."""

    server: grpc.aio.Server
    port: int
    health: health_aio.HealthServicer
    engine: Any
    registry: CollectorRegistry
    metrics: TierMetrics
    servicer: TierRpcs


def cache_info(engine) -> dict[str, str]:
    """The KV cache as vllm:cache_config_info's labels, in vLLM's words where they fit: a KV slot (one
    session's cache) is a block of block_size tokens, num_gpu_blocks of them (on whatever device); the
    capacity as the engine reports it (EngineStatus), and the memory budget it was sized from (0: by slots)."""
    s, cache = engine.status(), engine.cache
    return {"block_size": str(cache.slot_tokens), "num_gpu_blocks": str(cache.num_slots),
            "cache_dtype": engine.config.model.dtype, "kv_capacity_tokens": str(s.kv_capacity_tokens),
            "kv_capacity_bytes": str(s.kv_capacity_bytes), "kv_memory_gib": str(engine.config.sessions.kv_memory_gib)}


def create_tier_server(engine, service: Service, config: ServerConfig, tier: str) -> TierServer:
    """The server for one tier's servicer, with metrics: every rpc (latency, errors by code), every engine
    step (batch size, tokens, time) and, at scrape time, the engine's load (GetStatus's numbers)."""
    registry = CollectorRegistry()
    metrics = TierMetrics(registry, tier, served_model_name(engine.config.model.path), load=engine.status,
                          cache_info=cache_info(engine))
    engine.observers.append(metrics.observe_step)
    server, port, health_servicer = create_server([service], config, interceptors=[metrics.interceptor()])
    return TierServer(server, port, health_servicer, engine, registry, metrics, service.servicer)


def run_tier(label: str, service_name: str, build, config, port_file: str | None, metrics_address: str | None = None) -> None:
    """Entry point body shared by the draft and target services: load, serve (and /metrics) until
    SIGTERM, drain."""
    log = logging.getLogger(f"{label}_service")

    async def run() -> None:
        tier = build(config)
        metrics = serve_metrics(tier.registry, metrics_address)
        log.info("%s service for %s on port %d", label, config.tier.model.path, tier.port)

        def stop() -> None:
            tier.engine.close()
            if metrics is not None:
                metrics.close()

        await serve(tier.server, tier.health, [service_name], config.server,
                    on_started=lambda: write_port_file(port_file, tier.port), on_stop=stop,
                    on_draining=tier.servicer.drain)

    run_event_loop(run(), config.server.event_loop)
