"""The coordinator service: its configuration, the connections to the tiers (Pipeline), the public gRPC API
(a thin servicer over coordinator.frontend) and build(), which assembles them."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import CollectorRegistry

from coordinator.adaptive import AdaptiveConfig, TierLoad
from coordinator.admission import AdmissionConfig
from coordinator.frontend import Frontend, deadline_from
from coordinator.lookup import LookupConfig
from coordinator.proposers import HYBRID
from coordinator.suffix import SuffixCache, SuffixConfig
from coordinator.routing import RoutingConfig, probe_ring_hash
from coordinator.tiers import TierClient
from specdec.models import load_tokenizer, served_model_name, tokenizer_fingerprint
from specdec.proto import common_pb2, draft_pb2, generate_pb2_grpc, target_pb2
from specdec.wire.metrics import RpcMetricsInterceptor
from specdec.wire.server import (BearerTokenInterceptor, RequestError, Service, ServerConfig, create_server, handle_errors,
                                 read_pem)

if TYPE_CHECKING:
    from coordinator.http_server import HttpServer

log = logging.getLogger(__name__)

SERVICE_NAME = "specdec.v1.Generation"
# The tiers' services, by full name: what the channels' health checks ask each replica about.
TARGET_SERVICE = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name
DRAFT_SERVICE = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


@dataclass(frozen=True)
class CoordinatorConfig:
    # The tiers, as gRPC targets: host:port, or a name with many replicas behind it, e.g.
    # dns:///specdec-target.ns.svc.cluster.local:50062 (a headless Service; coordinator.routing).
    target_address: str  # the target tier
    draft_address: str | None  # the draft tier; None = target-only decoding
    tokenizer: str  # model path / hub id whose tokenizer the coordinator uses (same as the tiers')
    server: ServerConfig = ServerConfig()
    default_max_new_tokens: int = 128  # when a request leaves max_new_tokens unset
    max_new_tokens_cap: int = 4096  # larger requests are rejected
    max_prompt_tokens: int = 8192  # longer prompts are rejected
    default_num_speculative_tokens: int | None = None  # K when a request leaves it unset; None = adaptive
    max_num_speculative_tokens: int = 16  # larger K is rejected
    default_proposer: str = HYBRID  # draft_model | prompt_lookup | suffix | hybrid, when a request leaves it unset
    adaptive: AdaptiveConfig = AdaptiveConfig()  # adaptive-K controller settings
    lookup: LookupConfig = LookupConfig()  # prompt-lookup n-gram sizes
    suffix: SuffixConfig = SuffixConfig()  # suffix decoding: tree depth, proposal length, shared-tree bounds
    overlap: bool = False  # pre-draft round r+1 while the target verifies round r
    tier_retry_s: float = 30.0  # retry an unreachable target this long when the client set no deadline
    admission: AdmissionConfig = AdmissionConfig()  # concurrency and request-rate limits
    rpc_timeout_s: float = 60.0  # deadline of each internal rpc
    connect_timeout_s: float = 300.0  # how long to wait at start-up for the tiers to answer
    # --- security (README, Security) ---
    tier_ca: str | None = None  # PEM CA that signed the tiers' certs; set = TLS to the tiers (else plaintext)
    tier_client_cert: str | None = None  # PEM client cert chain presented to the tiers (mutual TLS); needs tier_ca
    tier_client_key: str | None = None  # PEM private key of tier_client_cert
    tier_server_name: str | None = None  # name to verify in the tiers' certs instead of the address's host
    auth_token: str | None = field(default=None, repr=False)  # set = public API needs 'authorization: Bearer <it>'
    served_model_name: str | None = None  # OpenAI model id and metrics label; None = specdec.models.served_model_name(target's model)
    routing: RoutingConfig = RoutingConfig()  # how sessions reach the replicas of each tier (coordinator.routing)


class PipelineMismatch(RuntimeError):
    """The draft and target (or the coordinator's tokenizer) do not belong together."""


class Pipeline:
    """Connections to the tiers (one channel per tier, to all its replicas: coordinator.routing) plus what
    was learnt from them at start-up."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        opts = [# Reconnect quickly to a tier that restarts (gRPC's default back-off grows to 120 s).
                ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
                ("grpc.max_receive_message_length", config.server.max_message_bytes),
                ("grpc.max_send_message_length", config.server.max_message_bytes)]
        credentials = self._tier_credentials(config)  # raises on unusable settings, before any channel exists
        if credentials is not None and config.tier_server_name:
            opts.append(("grpc.ssl_target_name_override", config.tier_server_name))

        def channel(address: str, service: str) -> grpc.aio.Channel:
            options = opts + config.routing.channel_options(health_service=service)
            if credentials is None:
                return grpc.aio.insecure_channel(address, options=options)
            return grpc.aio.secure_channel(address, credentials, options=options)

        self._channels = [channel(config.target_address, TARGET_SERVICE)]
        self.target = TierClient.target(self._channels[0], config.target_address, config.rpc_timeout_s, config.routing)
        self.draft = None
        if config.draft_address:
            self._channels.append(channel(config.draft_address, DRAFT_SERVICE))
            self.draft = TierClient.draft(self._channels[1], config.draft_address, config.rpc_timeout_s, config.routing)
        self._cleanup: set[asyncio.Task] = set()  # in-flight session clean-ups
        self.target_load = TierLoad()  # the target's batching, learnt from every Verify response
        self.suffix_cache = SuffixCache(config.suffix)  # recent outputs of all sessions, for suffix decoding
        self.tokenizer = None
        self.tokenizer_fingerprint = ""  # the coordinator's; every replica checks it on a session's first request
        self.target_info: common_pb2.ModelInfo | None = None
        self.draft_info: common_pb2.ModelInfo | None = None

    @staticmethod
    def _tier_credentials(config: CoordinatorConfig) -> grpc.ChannelCredentials | None:
        """TLS (mutual TLS with a client cert) credentials for the tier channels, or None for plaintext."""
        if not config.tier_ca:
            extra = [n for n in ("tier_client_cert", "tier_client_key", "tier_server_name") if getattr(config, n)]
            if extra:
                raise ValueError(f"{' and '.join(extra)} {'needs' if len(extra) == 1 else 'need'} tier_ca (TLS to the tiers)")
            return None
        if bool(config.tier_client_cert) != bool(config.tier_client_key):
            raise ValueError("tier_client_cert and tier_client_key must be given together")
        ca = read_pem(config.tier_ca, "tier CA")
        cert = read_pem(config.tier_client_cert, "tier client certificate") if config.tier_client_cert else None
        key = read_pem(config.tier_client_key, "tier client key") if config.tier_client_key else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    async def connect(self) -> None:
        """Check that grpcio routes by session (RoutingUnsupported otherwise), wait for the tiers, load the
        tokenizer, and refuse mismatched models. Only one replica per tier answers here; each of the
        others checks the tokenizer when it first serves a session (SessionContext.tokenizer_fingerprint)."""
        await probe_ring_hash(self.config.routing)
        loop = asyncio.get_running_loop()
        tokenizer_task = loop.run_in_executor(None, load_tokenizer, self.config.tokenizer)
        self.target_info = await self._wait_info(self.target, "target")
        if self.draft is not None:
            self.draft_info = await self._wait_info(self.draft, "draft")
        self.tokenizer = await tokenizer_task
        fingerprint = await loop.run_in_executor(None, tokenizer_fingerprint, self.tokenizer)
        self.tokenizer_fingerprint = fingerprint
        if self.target_info.tokenizer_fingerprint != fingerprint:
            raise PipelineMismatch(f"the target's tokenizer ({self.target_info.model}) differs from the coordinator's ({self.config.tokenizer})")
        if self.draft_info is not None and self.draft_info.tokenizer_fingerprint != self.target_info.tokenizer_fingerprint:
            raise PipelineMismatch(f"draft tokenizer ({self.draft_info.model}) differs from target tokenizer ({self.target_info.model}); refusing to start")
        log.info("pipeline: target %s at %s, draft %s", self.target_info.model, self.config.target_address,
                 f"{self.draft_info.model} at {self.config.draft_address}" if self.draft_info else "none (target-only)")

    async def _wait_info(self, client, name: str) -> common_pb2.ModelInfo:
        deadline = asyncio.get_running_loop().time() + self.config.connect_timeout_s
        while True:
            try:
                return await client.model_info()
            except grpc.aio.AioRpcError as e:
                if asyncio.get_running_loop().time() > deadline:
                    raise ConnectionError(f"{name} service at {client.address} did not answer: {e.details()}") from None
                await asyncio.sleep(0.5)

    def run_cleanup(self, coro) -> None:
        """Run a session clean-up in the background; close() waits for it."""
        task = asyncio.ensure_future(coro)
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

    async def settle(self, timeout_s: float = 5.0) -> None:
        """Wait for pending session clean-ups (EndSession on the tiers, outputs into the shared tree)."""
        if self._cleanup:
            await asyncio.wait(list(self._cleanup), timeout=timeout_s)

    async def close(self, cleanup_timeout_s: float = 5.0) -> None:
        """Finish pending session clean-ups, then close the channels."""
        await self.settle(cleanup_timeout_s)
        for ch in self._channels:
            await ch.close()


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    """The public gRPC API: thin handlers over the Frontend's one generation path."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    async def Generate(self, request, context):
        events = self.frontend.generate(request, deadline=deadline_from(context.time_remaining()), api="grpc")
        try:
            async for event in events:
                yield event
        except RequestError as e:
            await context.abort(e.code, e.message)
        finally:
            await events.aclose()

    @handle_errors
    async def GetInfo(self, request, context):
        return self.frontend.info()


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

    async def start_http(self, address: str) -> "HttpServer":
        """Serve the OpenAI-compatible API on address (port 0 = any free port); stop it with .stop()."""
        from coordinator.http_server import HttpServer
        from coordinator.openai_api import create_app

        config = self.pipeline.config
        http = HttpServer(create_app(self.frontend, config.auth_token), address, grace_s=config.server.grace_s,
                          tls=config.server)
        await http.start()
        return http


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
    return Coordinator(server, port, health, pipeline, frontend, registry)
