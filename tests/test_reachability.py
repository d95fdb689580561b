"""TierReachability against real gRPC servers on loopback, through a channel configured as the coordinator's
tier channels are (ring hash on the session header, client-side health checks): reachable while a replica
serves, unreachable within about a second of the last one stopping or reporting NOT_SERVING, reachable
again by itself when one comes back (on the same port, as a restarted process does)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from coordinator.tiers.reachability import ReachabilityConfig, TierReachability
from specdec.serving.routing import RoutingConfig

SERVICE = "specdec.v1.TargetService"


async def replica(port: int = 0) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    await servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, servicer, port


async def until(predicate, timeout_s: float) -> float:
    """Seconds until predicate() holds; fails the test after timeout_s."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout_s, f"not within {timeout_s}s"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


def test_reachability_follows_the_replicas():
    async def scenario():
        (a, health_a, port_a), (b, _, port_b) = await replica(), await replica()
        options = RoutingConfig().channel_options(health_service=SERVICE)
        channel = grpc.aio.insecure_channel(f"ipv4:127.0.0.1:{port_a},127.0.0.1:{port_b}", options=options)
        changes = []
        watch = TierReachability("target", channel, SERVICE, ReachabilityConfig(interval_s=0.2), on_change=changes.append)
        watch.start()
        try:
            assert await watch.probe()
            await b.stop(None)  # one of two replicas gone: still reachable
            for _ in range(10):
                await watch.probe()
            assert watch.reachable and changes == []
            await health_a.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)  # the last one drains
            watch.suspect()
            assert await until(lambda: not watch.reachable, 3) < 2
            assert changes == [False] and "no target replica is reachable" in watch.why()
            await health_a.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
            await until(lambda: watch.reachable, 5)
            assert changes == [False, True] and watch.last_error == ""
            await a.stop(None)  # the process dies: connection refused
            watch.suspect()
            assert await until(lambda: not watch.reachable, 3) < 2
            a, _, _ = await replica(port_a)  # restarted on its port
            await until(lambda: watch.reachable, 5)
            assert changes == [False, True, False, True]
        finally:
            await watch.close()
            await channel.close()
            await a.stop(None)

    asyncio.run(scenario())


def test_a_replica_that_just_came_back_keeps_the_tier_reachable():
    """A replica restarts and the other one stops before the channel has reconnected to the first (it waits
    out its reconnect back-off): for a moment no replica is connected and every check fails, although one
    serves. Seen in the drain test: the tier was declared unreachable within milliseconds and every session
    failed. An outage counts only after `confirm_s` of failed probes, longer than the back-off."""
    async def scenario():
        (a, _, port_a), (b, _, port_b) = await replica(), await replica()
        channel = grpc.aio.insecure_channel(f"ipv4:127.0.0.1:{port_a},127.0.0.1:{port_b}",
                                            options=RoutingConfig().channel_options(health_service=SERVICE))
        changes = []
        watch = TierReachability("target", channel, SERVICE, ReachabilityConfig(interval_s=0.2), on_change=changes.append)
        watch.start()
        try:
            assert await watch.probe()
            await a.stop(None)
            await asyncio.sleep(1.5)  # the channel's attempts to reach a back off to their longest
            a, _, _ = await replica(port_a)
            await b.stop(None)
            watch.suspect()
            await asyncio.sleep(2.0)
            assert changes == [] and watch.reachable and await watch.probe()
        finally:
            await watch.close()
            await channel.close()
            await a.stop(None)
            await b.stop(None)

    asyncio.run(scenario())


def test_a_stalled_check_ends_the_probe_at_its_timeout():
    async def scenario():
        server, _, port = await replica()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        try:
            watch = TierReachability("target", channel, SERVICE, ReachabilityConfig(timeout_s=0.3))
            calls = []

            async def stalled(request, timeout):
                calls.append(timeout)
                await asyncio.sleep(timeout)
                raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           "Deadline Exceeded")

            watch._check = stalled
            t0 = time.monotonic()
            assert await watch.probe() is False
            assert time.monotonic() - t0 < 0.6 and len(calls) == 1
        finally:
            await channel.close()
            await server.stop(None)

    asyncio.run(scenario())


def test_the_probe_rests_while_sessions_hear_from_the_tier_and_not_when_a_call_fails():
    """heard() (a session's call succeeded) stands for the next probe: a busy coordinator sends no health checks,
    a quiet one probes every interval, and suspect() (a failed call) probes at once, heard or not."""

    async def scenario():
        server, _, port = await replica()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=RoutingConfig().channel_options(SERVICE))
        watch = TierReachability("target", channel, SERVICE, ReachabilityConfig(interval_s=0.1))
        watch.start()
        try:
            await until(lambda: watch.probes >= 1, 2)
            for _ in range(20):  # 1 s of traffic: a reply every 50 ms
                watch.heard()
                await asyncio.sleep(0.05)
            busy = watch.probes
            assert busy <= 2, busy  # the first probe (and at most one racing the first reply)
            watch.heard()
            watch.suspect()
            await until(lambda: watch.probes > busy, 1)  # a failed call is probed at once, traffic or not
            await asyncio.sleep(0.6)  # quiet: every 0.1 s
            assert watch.probes >= busy + 4 and watch.reachable
        finally:
            await watch.close()
            await channel.close()
            await server.stop(None)

    asyncio.run(scenario())
