"""Session-affine routing to a tier's replicas through gRPC's own client-side load balancing: the channel
options and call metadata every caller of a tier uses (the coordinator, and a draft replica running direct
rounds). Ring hash on a request header (gRFC A76, `requestHashHeader`; grpcio >= 1.70 as
`ring_hash_experimental`, behind GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY=true) and client-side
health checking; every rpc of a session carries its routing key in that header, so all of a session's calls
reach the replica that holds its KV cache (docs/DESIGN.md, Many replicas). The coordinator checks at start
that the installed grpcio honours it (coordinator.tiers.routing.probe_ring_hash)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from specdec.core.prefix import PrefixHashes
from specdec.core.settings import setting

# grpc-core reads requestHashHeader from the ring-hash config only when this is true (A76, experimental).
RING_HASH_ENV = "GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY"
RING_HASH_POLICY = "ring_hash_experimental"


@dataclass(frozen=True)
class RoutingConfig:
    """Routing: how sessions reach the replicas of each tier."""

    hash_header: str = "specdec-session-id"  # request header the ring hash keys on: every session rpc carries its routing key
    # A prompt longer than this (and without a prompt_cache_key) reaches the replicas by the fingerprint of its first
    # this-many tokens, where their prefix caches hold it; 0 = route every session by its own id
    prefix_tokens: int = setting(256, flag="prefix-route-tokens")
    min_ring_size: int = 1024  # ring entries at least (grpc's default); more entries split sessions more evenly
    max_ring_size: int = 4096  # ring entries at most (grpc's default and its cap)
    health_check: bool = True  # watch each replica's health service; a NOT_SERVING replica gets no new calls
    min_resolution_interval_s: float = setting(5.0, flag="min-resolution-interval")  # re-resolve the tier's name at most this often (grpc's default: 30 s)
    max_reconnect_backoff_s: float = 0.5  # a replica that comes back is connected within this (grpc's default grows to 120 s)

    def service_config(self, health_service: str) -> dict:
        """The channel's service config: ring hash on hash_header, health checks on health_service."""
        config: dict = {"loadBalancingConfig": [{RING_HASH_POLICY: {
            "requestHashHeader": self.hash_header, "minRingSize": self.min_ring_size, "maxRingSize": self.max_ring_size}}]}
        if self.health_check:
            config["healthCheckConfig"] = {"serviceName": health_service}
        return config

    def channel_options(self, health_service: str) -> list[tuple[str, object]]:
        """gRPC channel options for one tier's channel."""
        backoff_ms = int(self.max_reconnect_backoff_s * 1000)
        return [("grpc.service_config", json.dumps(self.service_config(health_service))),
                ("grpc.dns_min_time_between_resolutions_ms", int(self.min_resolution_interval_s * 1000)),
                # Connection attempts to a replica start 0.1 s apart, then at most max_reconnect_backoff_s
                # apart; each may take up to 1 s (grpc's "min reconnect backoff" is the connect timeout).
                ("grpc.initial_reconnect_backoff_ms", min(100, backoff_ms)), ("grpc.max_reconnect_backoff_ms", backoff_ms),
                ("grpc.min_reconnect_backoff_ms", 1000)]

    def metadata(self, key: str) -> tuple[tuple[str, str], ...]:
        """The call metadata that routes an rpc to the replica of a session's routing key."""
        return ((self.hash_header, key),)

    def routing_key(self, session_id: str, prompt_ids: Sequence[int], cache_key: str = "") -> str:
        """The key a session's rpcs are hashed on: the client's cache key, else the prompt's leading
        prefix_tokens tokens (so requests sharing them meet the replica whose prefix cache holds them),
        else the session itself."""
        if cache_key:
            return f"key:{cache_key}"
        n = self.prefix_tokens
        if n > 0 and len(prompt_ids) > n:
            return f"prefix:{PrefixHashes(prompt_ids[:n]).at(n):016x}"
        return session_id
