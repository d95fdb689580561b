"""Session-affine routing to the replicas of a tier, through gRPC's own client-side load balancing.

Each tier is one gRPC channel to one name (e.g. `dns:///specdec-target.ns.svc.cluster.local:50062`, a
headless Service that resolves to every ready pod). The channel's service config selects the ring-hash
policy keyed on a request header (gRFC A76, `requestHashHeader`; grpcio >= 1.70 as
`ring_hash_experimental`, behind GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY=true) and client-side
health checking. Every rpc of a session carries the session id in that header, so all of a session's
calls reach the replica that holds its KV cache. The header's value is the session's routing key
(routing_key): the request's prompt_cache_key if it has one, else the fingerprint of its leading
prefix_tokens tokens if it is longer than that, else the session id; so requests that share a
conversation or a long prefix reach the replica whose prefix cache holds it. A replica that dies or reports NOT_SERVING leaves the
ring's pick; its sessions hash to the next replica on the ring, which answers FAILED_PRECONDITION (it
lacks them) and the coordinator re-prefills there. Servers bound their connections' age, so the channel
re-resolves the name and finds replicas that joined.

probe_ring_hash() checks, at start, that the installed grpcio honours all of this: a header routes every
call to one replica and different headers reach both of two local servers.
"""

from __future__ import annotations

import os

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec.serving.routing import RING_HASH_ENV, RING_HASH_POLICY, RoutingConfig


class RoutingUnsupported(RuntimeError):
    """The installed grpcio cannot route by session (ring hash on a request header)."""


PROBE_SERVICE = "specdec.v1.RoutingProbe"
PROBE_KEYS = 32  # distinct header values; all landing on one of two servers has probability 2^-31


async def probe_ring_hash(config: RoutingConfig, timeout_s: float = 10.0) -> None:
    """Raise RoutingUnsupported unless this grpcio routes by config.hash_header: two local servers behind
    one channel with config's service config; every header value must reach one server only, and the
    values together must reach both. Costs ~100 calls on loopback (tens of milliseconds)."""
    servers, ports = [], []
    try:
        for index in range(2):
            server, port = await _probe_server(index)
            servers.append(server)
            ports.append(port)
        target = f"ipv4:127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}"
        async with grpc.aio.insecure_channel(target, options=config.channel_options(PROBE_SERVICE)) as channel:
            which = channel.unary_unary(f"/{PROBE_SERVICE}/Which")
            seen: dict[str, set[bytes]] = {}
            for _ in range(3):  # each key three times: it must reach the same server every time
                for k in range(PROBE_KEYS):
                    key = f"probe-{k}"
                    try:
                        reply = await which(b"", metadata=config.metadata(key), timeout=timeout_s)
                    except grpc.aio.AioRpcError as e:
                        raise RoutingUnsupported(
                            f"grpcio {grpc.__version__} cannot route by the {config.hash_header!r} header with "
                            f"{RING_HASH_POLICY} (probe call failed: {e.code().name}: {e.details()}); session-affine "
                            f"routing needs grpcio >= 1.70 and the environment variable {RING_HASH_ENV}=true "
                            f"(it is {_env_shown()}; `python -m coordinator` sets it when unset)") from None
                    seen.setdefault(key, set()).add(reply)
    finally:
        for server in servers:
            await server.stop(None)
    split = [k for k, replies in seen.items() if len(replies) > 1]
    if split:
        raise RoutingUnsupported(f"grpcio {grpc.__version__} sent calls with the same {config.hash_header!r} "
                                 f"header to different servers ({len(split)} of {PROBE_KEYS} keys): no session affinity")
    reached = set().union(*seen.values())
    if len(reached) < 2:
        raise RoutingUnsupported(f"grpcio {grpc.__version__} sent all {PROBE_KEYS} session keys to one of two "
                                 f"servers: the ring-hash policy is not in effect")


def _env_shown() -> str:
    value = os.environ.get(RING_HASH_ENV)
    return "unset" if value is None else repr(value)


async def _probe_server(index: int) -> tuple[grpc.aio.Server, int]:
    """A loopback server that answers PROBE_SERVICE/Which with its index, and is SERVING for health checks."""
    answer = str(index).encode()

    async def which(request: bytes, context) -> bytes:
        return answer

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        PROBE_SERVICE, {"Which": grpc.unary_unary_rpc_method_handler(which)})])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set(PROBE_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port
