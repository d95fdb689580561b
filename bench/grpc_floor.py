"""gRPC's own floor on this machine: a message to another process and back on loopback, with nothing else done.

Two Python processes with grpc.aio (what the three services use), an echo server and a client, a 200-byte
message: a unary call, and one write and one read on an open bidirectional stream (how a session's rounds
travel: ProposeStream, VerifyStream), back to back and after the two processes have idled a few milliseconds.
A round of the pipeline pays at least this for each hop it makes (client -> coordinator -> target and back:
two), whatever the services do around it; bench.overhead prints it beside the rounds it measures. The idle
figure is the one a round meets: a tier waits while the other computes, and waking an idle process (its
threads, on a virtual machine its vCPU) costs more than a hot loop shows.

    python -m bench.grpc_floor            # the three figures, median of 5 runs of 2,000 round trips each
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


async def _client(port: int, n: int, runs: int) -> dict[str, float]:
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        unary = channel.unary_unary(f"/{SERVICE}/Unary", _same, _same)
        call = channel.stream_stream(f"/{SERVICE}/Stream", _same, _same)()

        async def one_unary():
            await unary(PAYLOAD)

        async def one_stream():
            await call.write(PAYLOAD)
            await call.read()

        out = {}
        idle = []
        for _ in range(max(n // 5, 1)):  # each round trip after the processes idled IDLE_S, timed on its own
            await asyncio.sleep(IDLE_S)
            t0 = time.perf_counter()
            await one_stream()
            idle.append((time.perf_counter() - t0) * 1e6)
        out["stream_idle_us"] = statistics.median(idle)
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


def measure(n: int = 2000, runs: int = 5) -> dict[str, float]:
    """{'unary_us', 'stream_us', 'stream_idle_us'}: the median round trip over `runs` runs of n (after an idle
    IDLE_S: over n / 5 round trips), the server a child process."""
    server = subprocess.Popen([sys.executable, "-m", "bench.grpc_floor", "--serve"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        return asyncio.run(_client(port, n, runs))
    finally:
        server.kill()
        server.wait()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.grpc_floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", action="store_true", help="be the echo server (prints its port)")
    p.add_argument("--n", type=int, default=2000, help="round trips per run")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args(argv)
    if args.serve:
        asyncio.run(_serve())
        return 0
    floor = measure(args.n, args.runs)
    print(f"gRPC round trip between two processes on loopback (grpc.aio, {len(PAYLOAD)}-byte message): "
          f"unary call {floor['unary_us']:.0f} us, a write and a read on an open stream {floor['stream_us']:.0f} us "
          f"back to back, {floor['stream_idle_us']:.0f} us after {IDLE_S * 1e3:.0f} ms idle")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
