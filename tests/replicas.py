"""In-process replicas: several target and draft servers, each with its own engine, on 127.0.0.x addresses
that share one port per tier, found through one DNS name per tier (tests.dns_server.FakeDns), and a
coordinator that reaches each tier by that name. Everything runs on one background event loop, like
tests.helpers.Cluster; tests/test_replica_faults.py has the real-process version."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from dataclasses import dataclass

import grpc

from specdec.serving.routing import RoutingConfig
from coordinator.config import CoordinatorConfig
from coordinator.service import build as build_coordinator
from draft_service.service import SERVICE_NAME as DRAFT_SERVICE
from draft_service.service import DraftConfig
from draft_service.service import build as build_draft
from specdec.engine.config import TierConfig
from specdec.engine.engine import Engine
from specdec.models import ModelConfig
from specdec.proto import common_pb2, draft_pb2_grpc, target_pb2_grpc
from specdec.serving.ports import free_port
from specdec.serving.server import ServerConfig, set_serving
from target_service.service import SERVICE_NAME as TARGET_SERVICE
from target_service.service import TargetConfig
from target_service.service import build as build_target
from tests.dns_server import FakeDns
from tests.helpers import TEST_COST_CURVE_S

NAMES = {"target": "target.specdec.test", "draft": "draft.specdec.test"}


@dataclass
class Replica:
    tier: str  # "target" or "draft"
    address: str  # 127.0.0.x
    port: int
    engine: Engine
    server: grpc.aio.Server
    health: object  # grpc_health's aio HealthServicer
    _channel: grpc.Channel | None = None  # for status()
    _stub: object = None

    def status(self) -> common_pb2.StatusResponse:
        """GetStatus straight from this replica (its own address, no balancer)."""
        if self._stub is None:
            stub_cls = target_pb2_grpc.TargetServiceStub if self.tier == "target" else draft_pb2_grpc.DraftServiceStub
            self._channel = grpc.insecure_channel(f"{self.address}:{self.port}")
            self._stub = stub_cls(self._channel)
        return self._stub.GetStatus(common_pb2.StatusRequest(), timeout=10)

    def close_status_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = self._stub = None


class ReplicaCluster:
    def __init__(self, target_model: str, draft_model: str, *, target_addresses: list[str], draft_addresses: list[str],
                 spare_addresses: list[str] = (), max_connection_age_s: float = 0.5, direct: bool = False) -> None:
        """The tiers' DNS names list target_addresses and draft_addresses. spare_addresses: more addresses
        the port must be free on (for replicas added later with add()). The tiers close connections after
        max_connection_age_s, so the coordinator re-resolves the names quickly. direct: the draft replicas
        reach the target tier by its name (--direct-target) and run direct rounds."""
        self.direct = direct
        self.dns = FakeDns()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server_config = ServerConfig(max_connection_age_s=max_connection_age_s, max_connection_age_grace_s=60)
        everything = [*target_addresses, *draft_addresses, *spare_addresses]
        self.ports = {"target": free_port(everything), "draft": 0}
        self.ports["draft"] = free_port(everything)
        while self.ports["draft"] == self.ports["target"]:
            self.ports["draft"] = free_port(everything)
        self.replicas: dict[str, dict[str, Replica]] = {"target": {}, "draft": {}}
        self.coordinators = []
        try:
            for address in target_addresses:
                self.add("target", address, target_model, publish=False)
            for address in draft_addresses:
                self.add("draft", address, draft_model, publish=False)
            self.dns.set(NAMES["target"], target_addresses)
            self.dns.set(NAMES["draft"], draft_addresses)
        except BaseException:
            self.close()
            raise

    def _call(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def tier_target(self, tier: str) -> str:
        """The gRPC target naming every replica of a tier."""
        return self.dns.target(NAMES[tier], self.ports[tier])

    def add(self, tier: str, address: str, model: str, publish: bool = True) -> Replica:
        """Start a replica of `tier` on address; publish: add it to the tier's DNS name."""
        engine = Engine.load(TierConfig(ModelConfig(model), cost_curve_s=TEST_COST_CURVE_S))
        config = dataclasses.replace(self.server_config, address=f"{address}:{self.ports[tier]}")
        build, cfg, service = ((build_target, TargetConfig(engine.config, server=config), TARGET_SERVICE) if tier == "target"
                               else (build_draft, DraftConfig(engine.config, server=config, direct_target=(
                                   self.tier_target("target") if self.direct else "")), DRAFT_SERVICE))

        async def start():
            built = build(cfg, engine)
            await built.server.start()
            await set_serving(built.health, [service], True)  # as serve() does
            return built

        built = self._call(start())
        replica = Replica(tier, address, self.ports[tier], engine, built.server, built.health)
        self.replicas[tier][address] = replica
        if publish:
            self.dns.set(NAMES[tier], [*self.dns.get(NAMES[tier]), address])
        return replica

    def stop(self, tier: str, address: str) -> None:
        """A replica dies: its server stops at once (its address stays in the tier's name, as a crashed pod's
        may for a while)."""
        self._call(self.replicas[tier][address].server.stop(0))

    def coordinator(self, target: str | None = None, draft: str | None = None, tokenizer: str | None = None, **overrides):
        """Start a coordinator (default: reaching each tier by its DNS name); returns its address."""
        config = CoordinatorConfig(
            target_address=target or self.tier_target("target"), draft_address=draft or self.tier_target("draft"),
            tokenizer=tokenizer or next(iter(self.replicas["target"].values())).engine.config.model.path,
            connect_timeout_s=30, **{"routing": RoutingConfig(min_resolution_interval_s=0.2), **overrides})

        async def start():
            c = await build_coordinator(config)
            await c.server.start()
            return c

        c = self._call(start())
        self.coordinators.append(c)
        return f"127.0.0.1:{c.port}"

    def wait_no_sessions(self, timeout_s: float = 10.0) -> None:
        """Poll every replica until none holds a session (ending them is asynchronous); fail on timeout."""
        deadline = time.monotonic() + timeout_s
        while any(r.status().num_sessions for reps in self.replicas.values() for r in reps.values()):
            assert time.monotonic() < deadline, "sessions left on a replica"
            time.sleep(0.05)

    def close(self) -> None:
        async def stop():
            for c in self.coordinators:
                await c.server.stop(0)
                await c.pipeline.close()
            for replicas in self.replicas.values():
                for r in replicas.values():
                    await r.server.stop(0)

        try:
            self._call(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            for replicas in self.replicas.values():
                for r in replicas.values():
                    r.close_status_channel()
                    r.engine.close()
            self.dns.close()
