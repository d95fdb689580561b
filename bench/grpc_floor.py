"""gRPC's own floor on this machine: a message to another process and back on loopback, with nothing else done.

Two Python processes with grpc.aio (what the three services use), an echo server and a client, a 200-byte
message: a unary call, and one write and one read on an open bidirectional stream (how a session's rounds
travel: ProposeStream, VerifyStream), back to back and after the two processes have idled a few milliseconds.
A round of the pipeline pays at least this for each hop it makes (client -> coordinator -> target and back:
two), whatever the services do around it; bench.overhead prints it beside the rounds it measures. The idle
figure is the one a round meets: a tier waits while the other computes, and waking an idle process (its
threads, on a virtual machine its vCPU) costs more than a hot loop shows.

A round of a real model idles each process far longer (the default target's forwards take tens of
milliseconds), so `--long-idle` also times a round trip after the processes idled that long, and the machine's
own part of it: a fixed bit of work (work(): a byte of each page of 1 MiB, a little Python) timed hot and
again as the first thing a process does after idling as long. On a machine whose memory is virtualised in
software (this project's sandboxes are nested microVMs) the first touches of a working set after a wait run
slowly, as faults would, and the stall grows with the wait; on bare metal or a hardware-virtualised VM it should
stay near the hot figure (docs/performance.md, Per-round overhead).

    python -m bench.grpc_floor                    # the figures, median of 5 runs of 2,000 round trips each
    python -m bench.grpc_floor --long-idle 0.05   # and after a 50 ms idle
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import grpc
from grpc import aio

SERVICE = "specdec.bench.Echo"
PAYLOAD = b"x" * 200
IDLE_S = 0.003  # a draft step or two: how long a tier idles between a session's messages
LONG_IDLE_TRIES = 12  # round trips (and bits of work) timed after a long idle, each on its own


WORKING_SET = bytearray(b"\1" * (1 << 20))  # what work() touches: 1 MiB, a byte in each of its 256 pages


def work() -> float:
    """The machine's probe: a byte read from each page of a 1 MiB working set, and a little Python (tens of us
    hot); its time in us."""
    t0 = time.perf_counter()
    bytes(WORKING_SET[::4096])
    sum(i * i for i in range(2_000))
    return (time.perf_counter() - t0) * 1e6


def wake_stall(idle_s: float, tries: int = LONG_IDLE_TRIES) -> tuple[float, float]:
    """(hot, after idling idle_s) medians of work() in us: the second run straight after the first, hot."""
    cold, hot = [], []
    for _ in range(tries):
        time.sleep(idle_s)
        cold.append(work())
        hot.append(work())
    return statistics.median(hot), statistics.median(cold)


def _same(x):
    return x


async def _serve() -> None:
    async def unary(request, context):
        return request

    async def stream(requests, context):
        async for request in requests:
            yield request

    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "Unary": grpc.unary_unary_rpc_method_handler(unary, _same, _same),
        "Stream": grpc.stream_stream_rpc_method_handler(stream, _same, _same)})
    server = aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


async def _client(port: int, n: int, runs: int, long_idle_s: float = 0.0) -> dict[str, float]:
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        unary = channel.unary_unary(f"/{SERVICE}/Unary", _same, _same)
        call = channel.stream_stream(f"/{SERVICE}/Stream", _same, _same)()

        async def one_unary():
            await unary(PAYLOAD)

        async def one_stream():
            await call.write(PAYLOAD)
            await call.read()

        async def after_idle(idle_s: float, tries: int) -> float:
            """The median of `tries` stream round trips, each after the processes idled idle_s, timed on its own."""
            idle = []
            for _ in range(tries):
                await asyncio.sleep(idle_s)
                t0 = time.perf_counter()
                await one_stream()
                idle.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(idle)

        out = {"stream_idle_us": await after_idle(IDLE_S, max(n // 5, 1))}
        if long_idle_s > 0:
            out["stream_long_idle_us"] = await after_idle(long_idle_s, LONG_IDLE_TRIES)
            out["work_hot_us"], out["work_long_idle_us"] = wake_stall(long_idle_s)
        for name, once in (("unary_us", one_unary), ("stream_us", one_stream)):
            for _ in range(n // 10):  # warm: connection, stream, both interpreters' caches
                await once()
            times = []
            for _ in range(runs):
                t0 = time.perf_counter()
                for _ in range(n):
                    await once()
                times.append((time.perf_counter() - t0) / n * 1e6)
            out[name] = statistics.median(times)
        call.cancel()
        return out


def measure(n: int = 2000, runs: int = 5, long_idle_s: float = 0.0) -> dict[str, float]:
    """{'unary_us', 'stream_us', 'stream_idle_us'}: the median round trip over `runs` runs of n (after an idle
    IDLE_S: over n / 5 round trips), the server a child process. long_idle_s > 0 adds 'stream_long_idle_us' (a
    round trip after idling that long) and 'work_hot_us' / 'work_long_idle_us' (work() hot and as the first
    thing after such an idle)."""
    server = subprocess.Popen([sys.executable, "-m", "bench.grpc_floor", "--serve"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        return asyncio.run(_client(port, n, runs, long_idle_s))
    finally:
        server.kill()
        server.wait()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.grpc_floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", action="store_true", help="be the echo server (prints its port)")
    p.add_argument("--n", type=int, default=2000, help="round trips per run")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--long-idle", type=float, default=0.0, metavar="SECONDS",
                   help="also time a round trip, and the machine's wake stall, after the processes idled this long")
    args = p.parse_args(argv)
    if args.serve:
        asyncio.run(_serve())
        return 0
    floor = measure(args.n, args.runs, args.long_idle)
    print(f"gRPC round trip between two processes on loopback (grpc.aio, {len(PAYLOAD)}-byte message): "
          f"unary call {floor['unary_us']:.0f} us, a write and a read on an open stream {floor['stream_us']:.0f} us "
          f"back to back, {floor['stream_idle_us']:.0f} us after {IDLE_S * 1e3:.0f} ms idle")
    if args.long_idle > 0:
        print(long_idle_said(floor, args.long_idle))
    return 0


def long_idle_said(floor: dict[str, float], idle_s: float) -> str:
    """The long-idle figures as a sentence."""
    return (f"After {idle_s * 1e3:.0f} ms idle: the round trip {floor['stream_long_idle_us']:.0f} us; the machine's own "
            f"wake stall, work() (a byte of each page of 1 MiB, a little Python) as the first thing a process does "
            f"after idling as long, {floor['work_long_idle_us']:.0f} us against {floor['work_hot_us']:.0f} us hot")


if __name__ == "__main__":
    raise SystemExit(main())
