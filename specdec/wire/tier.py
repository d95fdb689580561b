"""What the draft and target servicers share: request checks and the rpcs every tier serves alike.

Servicers are thin: they validate a request here, convert it into an engine work item, submit it and
convert the result back. Nothing here touches torch; the engine is used through its attributes
(vocab_size, max_context, config, eos_token_ids, tokenizer_fingerprint, device) and methods
(end_session, status).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import CollectorRegistry

from specdec.math.params import SamplingParams
from specdec.models import served_model_name
from specdec.proto import common_pb2
from specdec.wire.metrics import TierMetrics
from specdec.wire.server import (RequestError, Service, ServerConfig, as_request_error, check_token_ids, create_server,
                                 handle_errors, invalid_argument)

MAX_SESSION_ID_LEN = 128


def check_context(engine, ctx: common_pb2.SessionContext, extra_tokens: int) -> None:
    """Validate a SessionContext; extra_tokens = tokens the request adds beyond new_tokens."""
    if not ctx.session_id:
        raise invalid_argument("context.session_id is required")
    if len(ctx.session_id) > MAX_SESSION_ID_LEN:
        raise invalid_argument(f"context.session_id is longer than {MAX_SESSION_ID_LEN} characters")
    if ctx.prefix_len < 0:
        raise invalid_argument(f"context.prefix_len must be >= 0, got {ctx.prefix_len}")
    if not ctx.new_tokens:
        raise invalid_argument("context.new_tokens must hold at least one token")
    check_token_ids(ctx.new_tokens, engine.vocab_size, "context.new_tokens")
    total = ctx.prefix_len + len(ctx.new_tokens) + extra_tokens
    if total > engine.max_context:
        raise invalid_argument(f"context: {total} tokens exceed the model's context of {engine.max_context}")
    if ctx.tokenizer_fingerprint and ctx.tokenizer_fingerprint != engine.tokenizer_fingerprint:
        raise tokenizer_mismatch(engine, ctx.tokenizer_fingerprint)


def tokenizer_mismatch(engine, theirs: str) -> RequestError:
    """FAILED_PRECONDITION for a request made with another tokenizer: this replica must not serve it.
    Names the replica (its host name: the pod's name on Kubernetes) and its model, for the operator."""
    return RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                        f"tokenizer mismatch: replica {socket.gethostname()} serves {engine.config.model.path} whose "
                        f"tokenizer fingerprint is {engine.tokenizer_fingerprint[:16]}, the request's is {theirs[:16]}; "
                        f"this replica belongs to another model pair: fix its --model")


def check_num_tokens(engine, k: int, field_name: str, minimum: int) -> None:
    cap = engine.config.max_draft_tokens
    if not minimum <= k <= cap:
        raise invalid_argument(f"{field_name} must be in [{minimum}, {cap}], got {k}")


def sampling_params(msg: common_pb2.SamplingParams) -> SamplingParams:
    params = SamplingParams(temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p if msg.top_p != 0 else 1.0)
    try:
        params.validate()
    except ValueError as e:
        raise invalid_argument(f"sampling.{e}") from None
    return params


def model_info(engine) -> common_pb2.ModelInfo:
    c = engine.config
    return common_pb2.ModelInfo(
        model=c.model.path, vocab_size=engine.vocab_size, tokenizer_fingerprint=engine.tokenizer_fingerprint,
        eos_token_ids=engine.eos_token_ids, max_context=engine.max_context, device=str(engine.device),
        dtype=c.model.dtype, max_draft_tokens=c.max_draft_tokens, max_batch_sessions=c.batch.max_batch_sessions,
        max_batch_tokens=c.batch.max_batch_tokens)


DRAINING = "replica draining: open a new stream (it reaches another replica)"


async def serve_session_stream(servicer: "TierRpcs", requests: AsyncIterator, context,
                               handle: Callable[[Any], Awaitable[Any]]) -> AsyncIterator[Any]:
    """The loop of a per-session bidirectional stream (ProposeStream, VerifyStream): one response per
    request, in order, each from handle(request). A failed request ends the stream with its status (the
    caller opens a new one). The stream pins the sessions it served: when it ends (done, failed,
    cancelled, the coordinator gone) the tier drops them, so a vanished coordinator leaks no KV memory.
    Once the replica drains (SIGTERM), the stream's next request ends it with UNAVAILABLE instead of
    being served, so the session moves to another replica at once rather than when the grace runs out."""
    engine = servicer.engine
    sessions: set[str] = set()
    try:
        async for request in requests:
            if servicer.draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
            sessions.add(request.context.session_id)
            try:
                response = await handle(request)
            except Exception as e:
                err = as_request_error(e)
                await context.abort(err.code, err.message)
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
            step_tokens=s.step_tokens)


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
