"""`specdec bench-client`: N requests, C at a time, against a running coordinator (its gRPC API), with a
progress line and a summary: throughput, time to first token, inter-token latency (per streamed output,
as vLLM's vllm:inter_token_latency_seconds: one round can carry several tokens), time per output token
and end-to-end latency percentiles. No torch, no model.

    specdec bench-client --address 127.0.0.1:50051 -n 64 -c 8 --max-new-tokens 128
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

import grpc

from specdec.client import Client


@dataclass(frozen=True)
class BenchConfig:
    num_requests: int = 32  # requests in all
    concurrency: int = 8  # requests in flight at once
    prompt: str = "Explain in a few sentences why the sky is blue."  # every request's prompt (one user chat message)
    chat: bool = True  # send the prompt as a chat message (False: raw text)
    generation: dict = field(default_factory=dict)  # Client.generate keyword arguments (max_new_tokens, K, ...)


@dataclass
class RequestResult:
    ok: bool
    error: str = ""
    ttft_s: float = 0.0  # request sent -> first token
    e2e_s: float = 0.0  # request sent -> stream ended
    itl_s: list[float] = field(default_factory=list)  # gaps between streamed outputs carrying tokens
    output_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rounds: int = 0


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); 0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def one_request(client: Client, config: BenchConfig) -> RequestResult:
    prompt = {"messages": [{"role": "user", "content": config.prompt}]} if config.chat else {"prompt": config.prompt}
    t0 = time.perf_counter()
    last, r = None, RequestResult(ok=False)
    try:
        for event in client.stream(**prompt, **config.generation):
            now = time.perf_counter()
            if event.HasField("chunk"):
                if not event.chunk.token_ids:
                    continue
                r.output_tokens += len(event.chunk.token_ids)
                if last is None:
                    r.ttft_s = now - t0
                else:
                    r.itl_s.append(now - last)
                last = now
            else:
                s = event.result.stats
                r.draft_tokens, r.accepted_tokens, r.rounds = s.draft_tokens, s.accepted_tokens, s.rounds
        r.ok = True
    except grpc.RpcError as e:
        r.error = f"{e.code().name}: {e.details()}"
    r.e2e_s = time.perf_counter() - t0
    return r


class Progress:
    """One self-overwriting line on a terminal; a line per 10% otherwise (logs, CI)."""

    def __init__(self, total: int, stream=sys.stderr) -> None:
        self.total, self.stream = total, stream
        self.done = self.failed = self.tokens = 0
        self.t0 = time.perf_counter()
        self.tty = stream.isatty()
        self._lock = threading.Lock()
        self._last_decile = -1

    def update(self, r: RequestResult) -> None:
        with self._lock:
            self.done += 1
            self.failed += not r.ok
            self.tokens += r.output_tokens
            elapsed = time.perf_counter() - self.t0
            width = 30
            filled = width * self.done // self.total
            line = (f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} requests, {self.failed} failed, "
                    f"{self.tokens / elapsed if elapsed > 0 else 0:.1f} tok/s")
            if self.tty:
                self.stream.write("\r" + line + ("\n" if self.done == self.total else ""))
            elif self.done * 10 // self.total != self._last_decile:
                self._last_decile = self.done * 10 // self.total
                self.stream.write(line + "\n")
            self.stream.flush()


def run_bench(client_factory, config: BenchConfig, progress: Progress | None = None) -> dict:
    """Run the benchmark; client_factory() gives a Client (one per worker thread). Returns the summary."""
    progress = progress or Progress(config.num_requests)
    local = threading.local()
    clients: list[Client] = []

    def work(_: int) -> RequestResult:
        if not hasattr(local, "client"):
            local.client = client_factory()
            clients.append(local.client)
        return one_request(local.client, config)

    results: list[RequestResult] = []
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=config.concurrency) as pool:
            for future in as_completed([pool.submit(work, i) for i in range(config.num_requests)]):
                r = future.result()
                results.append(r)
                progress.update(r)
    finally:
        for c in clients:
            c.close()
    return summarize(results, time.perf_counter() - t0, config)


def summarize(results: list[RequestResult], wall_s: float, config: BenchConfig) -> dict:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft_s for r in ok]
    itl = [x for r in ok for x in r.itl_s]
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    e2e = [r.e2e_s for r in ok]
    drafts, accepted, rounds = (sum(getattr(r, k) for r in ok) for k in ("draft_tokens", "accepted_tokens", "rounds"))
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "requests": len(results), "succeeded": len(ok), "failed": len(results) - len(ok), "errors": errors,
        "concurrency": config.concurrency, "wall_s": wall_s, "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "ttft_s": {"mean": sum(ttft) / len(ttft) if ttft else 0.0, "p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        "itl_s": {"mean": sum(itl) / len(itl) if itl else 0.0, "p50": percentile(itl, 50), "p99": percentile(itl, 99)},
        "tpot_s": {"mean": sum(tpot) / len(tpot) if tpot else 0.0, "p50": percentile(tpot, 50), "p99": percentile(tpot, 99)},
        "e2e_s": {"mean": sum(e2e) / len(e2e) if e2e else 0.0, "p50": percentile(e2e, 50), "p99": percentile(e2e, 99)},
        "acceptance_rate": accepted / drafts if drafts else 0.0,
        "mean_tokens_per_round": tokens / rounds if rounds else 0.0,
    }


def format_summary(s: dict) -> str:
    rows = [
        ("requests (succeeded / failed)", f"{s['succeeded']} / {s['failed']}"),
        ("concurrency", f"{s['concurrency']}"),
        ("wall time (s)", f"{s['wall_s']:.2f}"),
        ("output tokens", f"{s['output_tokens']}"),
        ("throughput (output tok/s)", f"{s['output_tokens_per_s']:.1f}"),
        ("throughput (requests/s)", f"{s['requests_per_s']:.2f}"),
    ]
    for key, label in (("ttft_s", "time to first token (ms)"), ("itl_s", "inter-token latency (ms)"),
                       ("tpot_s", "time per output token (ms)"), ("e2e_s", "end-to-end latency (ms)")):
        d = s[key]
        rows.append((label, f"mean {d['mean'] * 1e3:.1f}  p50 {d['p50'] * 1e3:.1f}  p99 {d['p99'] * 1e3:.1f}"))
    rows += [("acceptance rate", f"{s['acceptance_rate']:.3f}"), ("tokens per round", f"{s['mean_tokens_per_round']:.2f}")]
    width = max(len(label) for label, _ in rows)
    lines = [f"  {label:<{width}}  {value}" for label, value in rows]
    for error, n in s["errors"].items():
        lines.append(f"  error x{n}: {error}")
    return "\n".join(lines)


def main_bench(args, address: str, connect) -> int:
    """The CLI command body: args from specdec.client.cli; connect() -> a Client of the coordinator at address."""
    if args.num_requests < 1 or args.concurrency < 1:
        print("error: --num-requests and --concurrency must be >= 1", file=sys.stderr)
        return 2
    generation = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                      seed=args.seed, stop=args.stop, num_speculative_tokens=args.num_speculative_tokens,
                      num_speculative_nodes=args.num_speculative_nodes, ignore_eos=args.ignore_eos, proposer=args.proposer)
    config = BenchConfig(num_requests=args.num_requests, concurrency=min(args.concurrency, args.num_requests),
                         prompt=args.prompt, chat=args.chat, generation=generation)
    print(f"{config.num_requests} requests, {config.concurrency} at a time, against {address}", file=sys.stderr)
    summary = run_bench(connect, config)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0 if summary["failed"] == 0 else 1
