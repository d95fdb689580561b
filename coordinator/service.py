"""The coordinator service: build() connects the Pipeline to the tiers and assembles the public gRPC API
(coordinator.api.grpc_api) over the Frontend; Coordinator.start_http() adds the OpenAI-compatible API."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from coordinator.api.frontend import Frontend
from coordinator.api.grpc_api import SERVICE_NAME, GenerationServicer
from coordinator.api.http_server import HttpServer
from coordinator.api.openai_api import create_app
from coordinator.config import CoordinatorConfig
from coordinator.pipeline import Pipeline
from specdec.models import served_model_name
from specdec.proto import generate_pb2_grpc
from specdec.serving.auth import BearerTokenInterceptor
from specdec.serving.metrics import MetricsServer, RpcMetricsInterceptor, serve_metrics
from specdec.serving.server import Service, create_server


@dataclass
class Coordinator:
    """A built coordinator: its gRPC server (not started), the connected pipeline, the generation path
    and the metrics registry. start_http() adds the OpenAI-compatible API on its own port."""

    server: grpc.aio.Server
    port: int
    health: Any  # grpc_health's aio HealthServicer
    pipeline: Pipeline
    frontend: Frontend
    registry: CollectorRegistry

    async def start_http(self, address: str) -> HttpServer:
        """Serve the OpenAI-compatible API on address (port 0 = any free port); stop it with .stop()."""
        config = self.pipeline.config
        app = create_app(self.frontend, config.auth_token, max_body_bytes=config.max_body_bytes,
                         metrics_public=config.metrics_public)
        http = HttpServer(app, address, grace_s=config.server.grace_s, tls=config.server)
        await http.start()
        return http

    def serve_metrics(self, address: str | None) -> MetricsServer | None:
        """The metrics port (None or '' = none), behind the API's token unless metrics_public."""
        config = self.pipeline.config
        return serve_metrics(self.registry, address, token=None if config.metrics_public else config.auth_token)


async def build(config: CoordinatorConfig) -> Coordinator:
    """Connects to the tiers first (raises PipelineMismatch; ConnectionError when a tier does not answer,
    TLS handshake failures included; ValueError / OSError for unusable TLS files)."""
    pipeline = Pipeline(config)
    try:
        await pipeline.connect()
        registry = CollectorRegistry()  # this coordinator's own: several may run in one process
        frontend = Frontend(pipeline, registry, config.served_model_name or served_model_name(pipeline.target_info.model))
        # Metrics first: it also sees the calls the token check refuses.
        interceptors = [RpcMetricsInterceptor(frontend.metrics.rpc.observe)]
        if config.auth_token:
            interceptors.append(BearerTokenInterceptor(config.auth_token))
        server, port, health = create_server(
            [Service(GenerationServicer(frontend), generate_pb2_grpc.add_GenerationServicer_to_server, SERVICE_NAME)],
            config.server, interceptors=interceptors,
        )
    except BaseException:
        await pipeline.close()
        raise

    def follow_the_tiers() -> None:
        """The Generation service's health status (readiness) follows Frontend.serving; the server's own
        ("", liveness) stays as serve() sets it: a target outage must not restart coordinators."""
        status = health_pb2.HealthCheckResponse.SERVING if frontend.serving else health_pb2.HealthCheckResponse.NOT_SERVING
        asyncio.ensure_future(health.set(SERVICE_NAME, status))

    pipeline.on_reachability.append(follow_the_tiers)
    return Coordinator(server, port, health, pipeline, frontend, registry)
