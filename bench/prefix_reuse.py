"""Prefix reuse across requests: time to first token of turn 2+ against turn 1, with the tiers' prefix cache on
and off (--prefix-cache / --no-prefix-cache on both tiers), on two workloads:

- chat: conversations of --turns turns; each turn's prompt is the last one, its answer and a new user message
  (by default ~900 tokens at turn 1, ~2k at turn 4);
- agent: --calls short calls that share one long system prompt (by default 1500 tokens), each with its own task.

The three services run as processes on loopback (bench.pipeline), one request at a time; TTFT is the client's
time to the first streamed token. Also reported: the aggregate tokens/s of each workload (generated tokens over
its wall time) and the target's prefix-cache hits / queries (vLLM's counters, from GetStatus). Greedy, ignore_eos,
fixed lengths, so on and off generate the same tokens.

    python -m bench.prefix_reuse                  # the default pair (the month's log in docs/bench-logs/)
    python -m bench.prefix_reuse --quick --out /tmp/prefix.md   # a tiny random model, short histories (~1 min)
"""

from __future__ import annotations

import argparse
import datetime as dt
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

from bench.common import bench_log, log, machine_info, md_table, publish
from bench.pipeline import BenchPipeline
from specdec.client import Client
from specdec.client.local import LocalPipelineConfig
from specdec.models import default_draft, default_target, make_tiny_model
from specdec.proto import common_pb2, target_pb2_grpc

VOCAB_SPAN = (300, 40000)  # token ids drawn from here: ordinary vocabulary of the SmolLM2 tokenizer


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.prefix_reuse", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny random model as target and draft, short histories")
    p.add_argument("--target", default=None, help="target model (default: the default pair's; --quick: a tiny one)")
    p.add_argument("--draft", default=None, help="draft model (default: the default pair's; --quick: the target)")
    p.add_argument("--conversations", type=int, default=3, help="chat: conversations")
    p.add_argument("--turns", type=int, default=4, help="chat: turns per conversation")
    p.add_argument("--first-prompt", type=int, default=900, help="chat: tokens of turn 1's prompt")
    p.add_argument("--user-tokens", type=int, default=300, help="chat: tokens of each later user message")
    p.add_argument("--calls", type=int, default=12, help="agent: calls")
    p.add_argument("--system-tokens", type=int, default=1500, help="agent: tokens of the shared system prompt")
    p.add_argument("--task-tokens", type=int, default=40, help="agent: tokens of each call's own task")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", default=str(bench_log()), help="markdown file to append to ('' = none)")
    p.add_argument("--tier-args", default="", help="extra flags for both tiers, e.g. '--device cuda'")
    p.add_argument("--coordinator-args", default="", help="extra flags for the coordinator")
    args = p.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.first_prompt, args.user_tokens = 1, 3, 200, 80
        args.calls, args.system_tokens, args.task_tokens, args.max_new_tokens = 4, 300, 20, 16
    return args


def token_block(seed: int, n: int) -> list[int]:
    """n deterministic pseudo-random ordinary token ids (a text's stand-in: timing does not read it)."""
    lo, hi = VOCAB_SPAN
    return [lo + (7919 * seed + 104729 * j + 31 * j * j) % (hi - lo) for j in range(n)]


def ttft(client: Client, prompt: list[int], max_new_tokens: int, routing_key: str) -> tuple[float, list[int], float]:
    """(seconds to the first streamed token, the output, seconds to the end)."""
    t0 = time.perf_counter()
    first, out = None, []
    for event in client.stream(token_ids=prompt, max_new_tokens=max_new_tokens, ignore_eos=True,
                               prompt_cache_key=routing_key):
        if event.HasField("chunk") and event.chunk.token_ids:
            first = first if first is not None else time.perf_counter() - t0
            out.extend(event.chunk.token_ids)
    return first if first is not None else float("nan"), out, time.perf_counter() - t0


def chat(client: Client, args) -> dict:
    first, later, tokens, wall = [], [], 0, 0.0
    for conv in range(args.conversations):
        prompt = [1] + token_block(1000 + conv, args.first_prompt - 1)
        for turn in range(args.turns):
            if turn:
                prompt = prompt + token_block(2000 + 10 * conv + turn, args.user_tokens)
            t, out, total = ttft(client, prompt, args.max_new_tokens, f"chat-{conv}")
            (first if turn == 0 else later).append(t)
            tokens, wall = tokens + len(out), wall + total
            prompt = prompt + out
    return {"first": first, "later": later, "tokens": tokens, "wall": wall, "history": len(prompt)}


def agent(client: Client, args) -> dict:
    system = [1] + token_block(3000, args.system_tokens - 1)
    first, later, tokens, wall = [], [], 0, 0.0
    for call in range(args.calls):
        t, out, total = ttft(client, system + token_block(4000 + call, args.task_tokens), args.max_new_tokens, "")
        (first if call == 0 else later).append(t)
        tokens, wall = tokens + len(out), wall + total
    return {"first": first, "later": later, "tokens": tokens, "wall": wall, "history": args.system_tokens + args.task_tokens}


def target_status(port: int) -> common_pb2.StatusResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return target_pb2_grpc.TargetServiceStub(ch).GetStatus(common_pb2.StatusRequest(), timeout=10)


def run(args, target: str, draft: str, cache: bool) -> dict:
    flag = "--prefix-cache" if cache else "--no-prefix-cache"
    tier_args = [*args.tier_args.split(), flag, "--max-session-tokens", "4096"]
    config = LocalPipelineConfig(target_model=target, draft_model=draft, target_args=tier_args, draft_args=tier_args,
                                 coordinator_args=args.coordinator_args.split())
    results = {}
    with BenchPipeline(config) as pipe, Client(pipe.address) as client:
        client.generate(token_ids=token_block(9, 32), max_new_tokens=4, ignore_eos=True)  # warm-up
        for name, workload in (("chat", chat), ("agent", agent)):
            before = target_status(pipe.ports["target"])
            log(f"prefix cache {'on' if cache else 'off'}: {name}")
            results[name] = workload(client, args)
            after = target_status(pipe.ports["target"])
            results[name]["hits"] = after.prefix_cache_hits - before.prefix_cache_hits
            results[name]["queries"] = after.prefix_cache_queries - before.prefix_cache_queries
    return results


def section(args, argv, target: str, draft: str, results: dict) -> str:
    m = machine_info()
    lines = [f"## {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC: prefix reuse across requests", "",
             f"Command: `python -m bench.prefix_reuse{''.join(' ' + a for a in argv)}`", "",
             f"Target {target}, draft {draft}; {m.get('cpu', '?')}; one request at a time, greedy, "
             f"{args.max_new_tokens} new tokens each. chat: {args.conversations} conversations x {args.turns} turns "
             f"(turn 1 prompt {args.first_prompt} tokens, +{args.user_tokens} per turn); agent: {args.calls} calls "
             f"sharing a {args.system_tokens}-token system prompt (+{args.task_tokens} each). TTFT medians, ms:", ""]
    rows = []
    for name in ("chat", "agent"):
        for cache in (True, False):
            r = results[cache][name]
            t1, t2 = statistics.median(r["first"]) * 1e3, statistics.median(r["later"]) * 1e3
            hit_rate = f"{r['hits']}/{r['queries']}" if r["queries"] else "-"
            rows.append([name, "on" if cache else "off", f"{t1:.0f}", f"{t2:.0f}", f"**{t2 / t1:.2f}**",
                         f"{r['tokens'] / r['wall']:.1f}", hit_rate])
    lines += md_table(["workload", "prefix cache", "TTFT turn 1", "TTFT turn 2+", "turn 2+ / turn 1",
                       "tokens/s (aggregate)", "target prefix hits / queries (tokens)"], rows)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="specdec-prefix-"))
    try:
        if args.quick:
            target = args.target or make_tiny_model(work / "tiny", seed=0)
            draft = args.draft or target  # its own draft: every draft accepted
        else:
            target, draft = args.target or default_target(), args.draft or default_draft()
        results = {cache: run(args, target, draft, cache) for cache in (True, False)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = section(args, argv, target, draft, results)
    publish(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
