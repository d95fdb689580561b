"""1 vs 2 target replicas under the same load: throughput of the pipeline when the target tier has one
replica, then two, reached through gRPC's ring hash on the session-id header (coordinator/routing.py).

Processes on loopback: target replicas on 127.0.0.2 and 127.0.0.3 (one port), one draft replica, and two
coordinators started together: one whose --target names one replica (`ipv4:127.0.0.2:P`), one whose
--target names both (`ipv4:127.0.0.2:P,127.0.0.3:P`: the same resolver output a headless Service gives,
without a DNS server). The same torch thread budget either way: one replica with T threads, or two with
T/2 each. Each configuration runs `-n` requests, `-c` at a time (specdec.client.bench), alternating
1, 2, 1, 2 ... `--repeats` times; per replica the steps it ran show how the sessions split.

    python -m bench.replicas                       # real pair, 16 requests x 8 clients, 32 tokens
    python -m bench.replicas --tiny --max-new-tokens 64

On a 2-core machine this shows that routing works (every request served, sessions split over both
replicas), not a speed-up: both replicas share the same two cores. Appends a section to
the month's log in docs/bench-logs/.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import append_section, bench_log, free_port, git_commit, log, md_table

TARGETS = ["127.0.0.2", "127.0.0.3"]
DRAFT = "127.0.0.4"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--num-requests", type=int, default=16, help="requests per configuration and repeat")
    p.add_argument("-c", "--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="runs of each configuration, alternating")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the target tier in all (split over replicas)")
    p.add_argument("--proposer", default="hybrid", choices=["draft", "lookup", "hybrid"])
    p.add_argument("--tiny", action="store_true", help="tiny random-init models instead of the real pair (wiring only)")
    p.add_argument("--out", default=str(bench_log()))
    return p.parse_args(argv)


class Fleet:
    """n target replicas (sharing one port), one draft and a coordinator over them, as processes."""

    def __init__(self, n: int, target_model: str, draft_model: str, target_threads: int) -> None:
        self.n = n
        self.dir = Path(tempfile.mkdtemp(prefix=f"specdec-bench-replicas{n}-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.target_port = free_port(TARGETS)
        self.draft_port = free_port([DRAFT])
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE"}
        self.target_model, self.draft_model, self.target_threads = target_model, draft_model, target_threads

    def spawn(self, name: str, args: list[str]) -> None:
        port_file = self.dir / f"{name}.port"
        log_file = open(self.dir / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", *args, "--port-file", str(port_file)],
                                            stdout=log_file, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)

    def wait(self, name: str, timeout_s: float = 900) -> int:
        port_file = self.dir / f"{name}.port"
        deadline = time.monotonic() + timeout_s
        while not port_file.exists():
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited:\n{(self.dir / f'{name}.log').read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(name)
            time.sleep(0.1)
        return int(port_file.read_text())

    def start(self) -> str:
        """Start everything; returns the coordinator's address."""
        for address in TARGETS[: self.n]:
            self.spawn(f"target-{address}", ["target_service", "--model", self.target_model, "--address",
                                             f"{address}:{self.target_port}", "--threads", str(self.target_threads)])
        self.spawn("draft", ["draft_service", "--model", self.draft_model, "--address", f"{DRAFT}:{self.draft_port}",
                             "--threads", "1"])
        # What a headless Service with n ready pods resolves to, without a DNS server.
        target = "ipv4:" + ",".join(f"{a}:{self.target_port}" for a in TARGETS[: self.n])
        self.spawn("coordinator", ["coordinator", "--address", "127.0.0.1:0", "--target", target,
                                   "--draft", f"{DRAFT}:{self.draft_port}", "--tokenizer", self.target_model])
        for name in self.procs:
            self.wait(name)
        return f"127.0.0.1:{self.wait('coordinator')}"

    def steps(self) -> list[int]:
        """Forward steps each target replica ran so far (GetStatus)."""
        import grpc

        from specdec.proto import common_pb2, target_pb2_grpc

        out = []
        for address in TARGETS[: self.n]:
            with grpc.insecure_channel(f"{address}:{self.target_port}") as ch:
                out.append(target_pb2_grpc.TargetServiceStub(ch).GetStatus(common_pb2.StatusRequest(), timeout=10).steps)
        return out

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def main(argv=None) -> None:
    args = parse_args(argv)
    from specdec.client import Client
    from specdec.client.bench import BenchConfig, run_bench
    from specdec.models import default_draft, default_target

    if args.tiny:
        from specdec.models import make_tiny_model

        tiny = Path(tempfile.mkdtemp(prefix="specdec-tiny-"))
        target_model, draft_model = make_tiny_model(tiny / "target", seed=0), make_tiny_model(tiny / "draft", seed=1)
    else:
        target_model, draft_model = default_target(), default_draft()
    results: dict[int, list[dict]] = {1: [], 2: []}
    split: dict[int, list[list[int]]] = {1: [], 2: []}
    config = BenchConfig(num_requests=args.num_requests, concurrency=args.concurrency,
                         generation=dict(max_new_tokens=args.max_new_tokens, ignore_eos=True, proposer=args.proposer))
    fleets: dict[int, tuple[Fleet, str]] = {}
    try:
        for n in (1, 2):  # both up at once (idle processes sleep), so the runs can alternate
            fleet = Fleet(n, target_model, draft_model, target_threads=max(1, args.threads // n))
            log(f"starting {n} target replica(s) in {fleet.dir}")
            fleets[n] = (fleet, fleet.start())
        for r in range(args.repeats):
            for n in (1, 2):
                fleet, address = fleets[n]
                before = fleet.steps()
                log(f"run {r + 1}/{args.repeats}: {n} target replica(s), {args.num_requests} requests, {args.concurrency} at a time")
                summary = run_bench(lambda: Client(address, timeout_s=1800), config)
                results[n].append(summary)
                split[n].append([b - a for a, b in zip(before, fleet.steps())])
                log(f"  {summary['output_tokens_per_s']:.1f} tok/s, {summary['failed']} failed, steps per replica {split[n][-1]}")
    finally:
        for fleet, _ in fleets.values():
            fleet.stop()
    section = report(args, results, split, target_model, draft_model)
    print(section)
    append_section(section, args.out)
    log(f"appended to {args.out}")


def report(args, results: dict[int, list[dict]], split: dict[int, list[list[int]]], target_model: str,
           draft_model: str) -> str:
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## {now}: 1 vs 2 target replicas (git {git_commit()})", "",
             "`" + " ".join(["python -m bench.replicas", *sys.argv[1:]]) + "`", "",
             f"Models: target `{Path(target_model).name}`, draft `{Path(draft_model).name}`. {args.num_requests} requests "
             f"per run, {args.concurrency} at a time, {args.max_new_tokens} new tokens each (EOS ignored), proposer "
             f"{args.proposer}, adaptive K; {args.repeats} runs per configuration, alternating. Target tier: "
             f"{args.threads} torch threads in all (1 replica x {args.threads}, 2 replicas x {max(1, args.threads // 2)}); "
             f"one draft replica (1 thread); {os.cpu_count()} CPU cores shared by every process.", ""]
    table = []
    for n in (1, 2):
        rs = results[n]
        tok = [r["output_tokens_per_s"] for r in rs]
        table.append([n, f"{statistics.median(tok):.1f} ({', '.join(f'{t:.1f}' for t in tok)})",
                      f"{statistics.median(r['requests_per_s'] for r in rs):.2f}",
                      f"{statistics.median(r['ttft_s']['p50'] for r in rs) * 1e3:.0f}",
                      f"{statistics.median(r['e2e_s']['p50'] for r in rs):.2f}", sum(r['failed'] for r in rs),
                      '; '.join(' / '.join(str(x) for x in run) for run in split[n])])
    lines += md_table(["target replicas", "output tok/s (median, runs)", "requests/s", "TTFT p50 ms", "e2e p50 s", "failed",
                       "target steps per replica"], table)
    ratio = statistics.median(r["output_tokens_per_s"] for r in results[2]) / max(
        1e-9, statistics.median(r["output_tokens_per_s"] for r in results[1]))
    lines += ["", f"Two replicas / one: {ratio:.2f}x. On {os.cpu_count()} cores both replicas, the draft and the "
              "coordinator share the same cores, so this shows that routing works (no failures, sessions split "
              "over both replicas by the ring hash), not the speed-up of a second GPU.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
