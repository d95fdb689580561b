"""The one gRPC server skeleton every specdec service uses.

create_server() binds the services plus the standard health and reflection services and returns
(server, port); serve() runs it until SIGINT/SIGTERM, then marks it NOT_SERVING and stops it
gracefully. Handlers report bad requests by raising RequestError (specdec.core.errors); @handle_errors
turns that into context.abort(code, message), so every failure leaves the server healthy.

Transport security is optional: with ServerConfig.tls_cert/tls_key the port is TLS, and with
tls_client_ca too it is mutual TLS (clients must present a certificate that CA signed).
specdec.serving.auth adds a shared-secret check on top (the coordinator's public API uses it).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.core.errors import as_request_error
from specdec.core.settings import setting

log = logging.getLogger(__name__)


EVENT_LOOPS = ("asyncio", "uvloop")


def run_event_loop(main, event_loop: str = "asyncio"):
    """asyncio.run(main) on the chosen event loop (ServerConfig.event_loop)."""
    if event_loop == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


@dataclass(frozen=True)
class ServerConfig:
    """The gRPC server."""

    address: str = "127.0.0.1:0"  # host:port to listen on (port 0 = any free port)
    max_message_bytes: int = 8 * 1024 * 1024  # largest gRPC message accepted; larger requests get RESOURCE_EXHAUSTED
    grace_s: float = 5.0  # seconds in-flight rpcs get to finish on SIGTERM
    tls_cert: str | None = None  # PEM certificate chain: serve TLS instead of plaintext (needs --tls-key)
    tls_key: str | None = None  # PEM private key of --tls-cert
    tls_client_ca: str | None = None  # PEM CA bundle: require client certificates it signed (mutual TLS)
    # Seconds before a client connection is closed (GOAWAY), so clients re-resolve the service's name and
    # find replicas that joined (docs/DESIGN.md, Many replicas); 0 = never. In-flight rpcs keep the old connection.
    max_connection_age_s: float = 0.0
    # Seconds in-flight rpcs may go on over an aged connection before it is closed (a draft stream lasts
    # one generation; one cut short only costs that session a re-prefill).
    max_connection_age_grace_s: float = 600.0
    # The process's asyncio event loop: "uvloop" (libuv's: less time per rpc, docs/performance.md) or "asyncio"
    # (the standard library's).
    event_loop: str = setting("uvloop", choices=EVENT_LOOPS)
    # Python's garbage collector once serving: what the process built while it started (modules, the model's or
    # the tokenizer's objects) is frozen out of its scans, and it collects after this many new objects (Python's
    # default: 700). A full collection of the coordinator's start-up heap took ~90 ms, every few hundred rounds,
    # with every session's round waiting (docs/performance.md, The coordinator's own time). 0: Python's as it is.
    gc_young_objects: int = 10_000

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        if self.gc_young_objects < 0:
            raise ValueError(f"gc_young_objects must be >= 0, got {self.gc_young_objects}")
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"event_loop must be one of {', '.join(EVENT_LOOPS)}, got {self.event_loop!r}")
        if self.max_connection_age_s < 0 or self.max_connection_age_grace_s < 0:
            raise ValueError("max_connection_age_s and max_connection_age_grace_s must be >= 0 seconds")


def read_pem(path: str, what: str) -> bytes:
    """The bytes of a PEM file; a clear error if it is missing or is not PEM."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise OSError(f"cannot read {what} {path!r}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {path!r} is not a PEM file")
    return data


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS (or mutual TLS) credentials for config, or None for plaintext."""
    if not config.tls_cert:
        return None
    cert = read_pem(config.tls_cert, "TLS certificate")
    key = read_pem(config.tls_key, "TLS private key")
    client_ca = read_pem(config.tls_client_ca, "TLS client CA") if config.tls_client_ca else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None)


def client_credentials(ca: str, cert: str, key: str, server_name: str,
                       names: tuple[str, str, str, str]) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, str]]]:
    """TLS (mutual TLS with a client certificate) credentials for a channel to a tier, with the channel options they
    need (the name the tier's certificate must carry, where it is not the address's host); (None, []) for plaintext.
    names: the four settings' names (CA, client certificate, client key, server name), for the errors."""
    n_ca, n_cert, n_key, n_name = names
    if not ca:
        extra = [n for n, v in ((n_cert, cert), (n_key, key), (n_name, server_name)) if v]
        if extra:
            raise ValueError(f"{' and '.join(extra)} {'needs' if len(extra) == 1 else 'need'} {n_ca} (the CA that turns TLS on)")
        return None, []
    if bool(cert) != bool(key):
        raise ValueError(f"{n_cert} and {n_key} must be given together")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca, "tier CA"), private_key=read_pem(key, "tier client key") if key else None,
        certificate_chain=read_pem(cert, "tier client certificate") if cert else None)
    return credentials, [("grpc.ssl_target_name_override", server_name)] if server_name else []


def handle_errors(method: Callable) -> Callable:
    """Wrap a unary-response handler: RequestError -> abort(code, message); other exceptions ->
    INTERNAL (never a bare UNKNOWN with a Python traceback)."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            err = as_request_error(e)
            await context.abort(err.code, err.message)

    return wrapper


@dataclass(frozen=True)
class Service:
    servicer: Any
    add_to_server: Callable[[Any, grpc.aio.Server], None]  # generated add_XServicer_to_server
    name: str  # full service name, e.g. "specdec.v1.DraftService"


def create_server(
    services: list[Service], config: ServerConfig, interceptors: list[grpc.aio.ServerInterceptor] | None = None
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    if config.max_connection_age_s > 0:
        options += [("grpc.max_connection_age_ms", max(1, int(config.max_connection_age_s * 1000))),
                    ("grpc.max_connection_age_grace_ms", int(config.max_connection_age_grace_s * 1000))]
    credentials = server_credentials(config)  # before anything is bound: bad PEM files fail here
    server = grpc.aio.server(options=options, interceptors=list(interceptors or ()))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in services:
        service.add_to_server(service.servicer, server)
    names = [s.name for s in services]
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    if credentials is None:
        port = server.add_insecure_port(config.address)
    else:
        port = server.add_secure_port(config.address, credentials)
    if port == 0:
        raise OSError(f"could not bind {config.address}")
    return server, port, health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *names]:
        await health_servicer.set(name, status)


def settle_collector(young_objects: int) -> None:
    """Once started (ServerConfig.gc_young_objects): freeze what the start built out of the collector's scans and
    collect the young generation after `young_objects` new objects. 0: leave the collector as it is."""
    if young_objects <= 0:
        return
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(young_objects, older, oldest)


async def serve(
    server: grpc.aio.Server,
    health_servicer: health.aio.HealthServicer,
    names: list[str],
    config: ServerConfig,
    on_started: Callable[[], Any] | None = None,
    on_stop: Callable[[], Any] | None = None,
    on_draining: Callable[[], Awaitable[Any]] | None = None,
) -> None:
    """Start, report SERVING, and run until SIGINT/SIGTERM; then drain for config.grace_s.
    on_draining: drains another server (e.g. HTTP) alongside the gRPC one; on_stop runs after both."""
    await server.start()
    settle_collector(config.gc_young_objects)
    await set_serving(health_servicer, names, True)
    if on_started is not None:
        on_started()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(server.wait_for_termination())
    await asyncio.wait([waiter, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    log.info("shutting down (grace %.1fs)", config.grace_s)
    await set_serving(health_servicer, names, False)
    await asyncio.gather(server.stop(config.grace_s), *([on_draining()] if on_draining is not None else []))
    if on_stop is not None:
        result = on_stop()
        if asyncio.iscoroutine(result):
            await result
