"""The one gRPC server skeleton every specdec service uses.

create_server() binds the services plus the standard health and reflection services and returns
(server, port); serve() runs it until SIGINT/SIGTERM, then marks it NOT_SERVING and stops it
gracefully. Handlers report bad requests by raising RequestError; @handle_errors turns that into
context.abort(code, message), so every failure leaves the server healthy.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    address: str = "127.0.0.1:0"  # host:port to bind; port 0 picks a free one
    max_message_bytes: int = 8 * 1024 * 1024  # larger requests get RESOURCE_EXHAUSTED
    grace_s: float = 5.0  # on shutdown, in-flight rpcs get this long to finish


class RequestError(Exception):
    """A request the service refuses, with the gRPC status to answer."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid_argument(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def as_request_error(e: Exception) -> RequestError:
    """RequestError as is; anything else is our bug: INTERNAL, logged with its traceback."""
    if isinstance(e, RequestError):
        return e
    log.exception("internal error")
    return RequestError(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")


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
    services: list[Service], config: ServerConfig
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(options=options)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for service in services:
        service.add_to_server(service.servicer, server)
    names = [s.name for s in services]
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(config.address)
    if port == 0:
        raise OSError(f"could not bind {config.address}")
    return server, port, health_servicer


async def set_serving(health_servicer: health.aio.HealthServicer, names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *names]:
        await health_servicer.set(name, status)


async def serve(
    server: grpc.aio.Server,
    health_servicer: health.aio.HealthServicer,
    names: list[str],
    config: ServerConfig,
    on_started: Callable[[], Any] | None = None,
    on_stop: Callable[[], Any] | None = None,
) -> None:
    """Start, report SERVING, and run until SIGINT/SIGTERM; then drain for config.grace_s."""
    await server.start()
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
    await server.stop(config.grace_s)
    if on_stop is not None:
        result = on_stop()
        if asyncio.iscoroutine(result):
            await result
