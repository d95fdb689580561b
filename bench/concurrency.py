"""Concurrency sweep: many clients at once against one pipeline, beside a peer measured in the same run.

For each concurrency level C (default 1, 4, 16, 32), C clients start together, each with its own chat
prompt, greedy (or sampled: --temperature, a seed per client), a fixed number of new tokens (EOS
ignored), streaming. Per client we record the time to first token (TTFT), the time per output token
after it (TPOT = (end - first) / (n - 1), vLLM's definition) and its tokens per second; per level the
aggregate tokens per second over the whole burst. Rows:

* specdec, the default policy (hybrid proposer, adaptive K), and the mean K it chose at each level
  (the cross-session suffix tree and the tiers' prefix caches are off: the rows and levels reuse prompts,
  so a later one would have found the answers or the prompts' KV ready);
* specdec K = 0: the same services with no speculation (the target tier's batching alone);
* the peer, Hugging Face transformers serving the same C prompts with the target alone, in this
  process: its continuous-batching API (``generate_batch``) and padded batched ``generate``; each
  returns only when the whole batch is done, so its per-client figures are the batch's wall time.

With ``--steady SECONDS`` each specdec row is also measured under a **steady load** at each level: C
clients each send their next request as soon as the last one ends (closed loop, as a server with C
users sees them), and the throughput is the tokens streamed in the window [``--steady-warmup``,
SECONDS] over its length. Sessions then start and end at different times, as on a server; a burst's
makespan instead waits for its slowest session, which a policy that maximises throughput may slow.

With ``--cold`` every burst gets a **fresh cluster** (three service processes started for it, no warm-up
request): no session has finished when the clients start, so nothing the coordinator learns from finished
sessions helps; what prices the first rounds is what each tier measured at start (its cost curve). The
cluster's start-up is not timed. Users meet this burst first (docs/performance.md, "cold burst").

Each specdec row runs ``--repeats`` bursts per level (default 3), alternating with the other row, and
reports the median: on a 2-core machine two bursts of the same row differ by up to ~10%, more than the
differences the rows are compared on. Before them, each row runs one untimed burst at the level: on a GPU
the tiers capture a CUDA graph the first time a batch reaches a new size or context length, and the row
that went first would pay all of them (measured on an H100, 2026-11-27: the default request at 0.45x K = 0
at one client with no such burst; ``--cold`` measures what the first users meet).

Run with ``python -m bench.concurrency`` (``make bench`` runs it after bench.run). It appends a
section to the month's log in docs/bench-logs/ and draws docs/bench_concurrency.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

from bench.batched_peer import run_peer
from bench.common import REPO, append_section, bench_log, git_commit, gpu_name, log, machine_info
from bench.concurrency_report import markdown, plot


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.concurrency", description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default="1,4,16,32", help="comma list of concurrent clients")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="the specdec rows' sampling temperature, each client its own seed (0 = greedy; the peer stays greedy)")
    p.add_argument("--repeats", type=int, default=3,
                   help="bursts per row and level, the rows alternating (specdec, K = 0, specdec, ...); the median "
                        "by aggregate tok/s is reported, with the range (a 2-core machine's bursts vary by ~10%%)")
    p.add_argument("--rows", default="specdec,k0,peer", help="comma list of specdec, k0, peer")
    p.add_argument("--steady", type=float, default=0.0, metavar="SECONDS",
                   help="also measure each specdec row under a steady load of C closed-loop clients for this long "
                        "per level and row (0 = bursts only)")
    p.add_argument("--steady-warmup", type=float, default=10.0, metavar="SECONDS",
                   help="the steady load's first seconds, not counted (the clients' first requests start together)")
    p.add_argument("--cold", action="store_true",
                   help="a fresh cluster for every burst (no warm-up request, no finished session before it)")
    p.add_argument("--out", default=str(bench_log()), help="markdown file to append the section to ('' = none)")
    p.add_argument("--plot", default=None, help="PNG to draw (default docs/bench_concurrency.png; "
                   "docs/bench_concurrency_gpu.png with a GPU --device)")
    p.add_argument("--json", default=None, help="also write the raw per-client samples here")
    p.add_argument("--target-args", default="", help="extra flags for the target service")
    p.add_argument("--draft-args", default="", help="extra flags for the draft service")
    # The levels reuse prompts (level 4's include level 1's): a shared suffix tree would have seen the
    # answers already. The template workload of bench.run measures that tree; here it is off.
    p.add_argument("--coordinator-args", default="--suffix-cache-entries 0", help="extra flags for the coordinator")
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--device", default="cpu", help="torch device of both tiers and the peer: cpu, cuda, ...")
    p.add_argument("--dtype", default="float32", help="dtype of the target tier and the peer's model")
    p.add_argument("--draft-dtype", default=None, help="dtype of the draft tier (default: --dtype)")
    return p.parse_args(argv)


ROW_K = {"specdec": None, "k0": 0}  # each specdec row's num_speculative_tokens (None: the default request's adaptive K)


def chat_prompts(n: int) -> list[list[dict]]:
    """n distinct user messages: the bench's open and grounded prompts, then variants of them."""
    from bench.prompts import prompts_for

    base = [p.content for p in prompts_for("open", None)] + [p.content for p in prompts_for("grounded", None)]
    out = []
    for i in range(n):
        text = base[i % len(base)]
        if i >= len(base):
            text += f"\n\n(Request {i}: answer in your own words.)"
        out.append([{"role": "user", "content": text}])
    return out


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[i]


# --- specdec ----------------------------------------------------------------------------------------


def sampled(temperature: float, i: int) -> dict:
    """A request's sampling fields: greedy (none), or the temperature with a seed of its own (client i)."""
    return dict(temperature=temperature, seed=i) if temperature > 0 else {}


def burst(address: str, prompts: list[list[dict]], max_new: int, k: int | None, temperature: float = 0.0) -> dict:
    """C streaming clients started together (a barrier); per-client timings and stats."""
    from specdec.client import Client

    n = len(prompts)
    barrier = threading.Barrier(n)
    results: list[dict | None] = [None] * n

    def one(i: int) -> None:
        kw = dict(messages=prompts[i], max_new_tokens=max_new, ignore_eos=True, **sampled(temperature, i))
        if k is not None:
            kw["num_speculative_tokens"] = k
        with Client(address, timeout_s=1800) as client:
            barrier.wait()
            t0 = time.perf_counter()
            first = None
            tokens = 0
            stats = {}
            for event in client.stream(**kw):
                if event.HasField("chunk") and event.chunk.token_ids:
                    tokens += len(event.chunk.token_ids)
                    if first is None:
                        first = time.perf_counter()
                elif event.HasField("result"):
                    from google.protobuf.json_format import MessageToDict

                    stats = MessageToDict(event.result.stats, preserving_proto_field_name=True)
            end = time.perf_counter()
        results[i] = {"start": t0, "first": first, "end": end, "tokens": tokens, "stats": stats}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summarise(results)


def steady(address: str, prompts: list[list[dict]], clients: int, max_new: int, k: int | None, seconds: float,
           warmup_s: float, temperature: float = 0.0) -> dict:
    """`clients` closed-loop streaming clients for `seconds`: client i sends prompts i, i + clients, ... (cycling)
    back to back; the tokens that arrive in [warmup_s, seconds] over the window's length, and the gaps between a
    request's consecutive chunks that end in the window (what a streaming user waits; a pause of any process
    shows in their tail)."""
    from specdec.client import Client

    barrier = threading.Barrier(clients)
    stamps: list[list[float]] = [[] for _ in range(clients)]
    gaps: list[list[float]] = [[] for _ in range(clients)]
    start = [0.0]

    def one(i: int) -> None:
        with Client(address, timeout_s=1800) as client:
            if barrier.wait() == 0:
                start[0] = time.perf_counter()
            barrier.wait()
            j = 0
            while time.perf_counter() < start[0] + seconds:
                kw = dict(messages=prompts[(i + j * clients) % len(prompts)], max_new_tokens=max_new, ignore_eos=True,
                          **sampled(temperature, i + j * clients))
                if k is not None:
                    kw["num_speculative_tokens"] = k
                last = None
                for event in client.stream(**kw):
                    if event.HasField("chunk") and event.chunk.token_ids:
                        now = time.perf_counter()
                        stamps[i].extend([now] * len(event.chunk.token_ids))
                        if last is not None and start[0] + warmup_s <= now < start[0] + seconds:
                            gaps[i].append(now - last)
                        last = now
                j += 1

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lo, hi = start[0] + warmup_s, start[0] + seconds
    tokens = sum(lo <= t < hi for ts in stamps for t in ts)
    return {"clients": clients, "window_s": hi - lo, "tokens": tokens, "steady_tok_s": tokens / (hi - lo),
            "gaps_s": [g for gs in gaps for g in gs]}


def summarise(results: list[dict]) -> dict:
    start = min(r["start"] for r in results)
    end = max(r["end"] for r in results)
    total = sum(r["tokens"] for r in results)
    ttft = [r["first"] - r["start"] for r in results if r["first"] is not None]
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in results if r["first"] is not None and r["tokens"] > 1]
    per_client = [r["tokens"] / (r["end"] - r["start"]) for r in results]
    ks = [float(r["stats"].get("mean_num_speculative_tokens", 0.0)) for r in results if r["stats"]]
    rounds, by_proposer = 0, {}  # the burst's rounds, and each proposer's [rounds, drafts, accepted]
    for stats in (r["stats"] or {} for r in results):
        rounds += int(stats.get("rounds", 0))
        for name, p in (stats.get("by_proposer") or {}).items():
            counts = by_proposer.setdefault(name, [0, 0, 0])
            for i, key in enumerate(("rounds", "draft_tokens", "accepted_tokens")):
                counts[i] += int(p.get(key, 0))
    return {
        "clients": len(results), "tokens": total, "wall_s": end - start, "aggregate_tok_s": total / (end - start),
        "per_client_tok_s": statistics.median(per_client), "client_rates": per_client, "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_ms": 1e3 * percentile(tpot, 50), "tpot_p99_ms": 1e3 * percentile(tpot, 99),
        "latency_p50_s": percentile([r["end"] - r["start"] for r in results], 50),
        "mean_k": statistics.mean(ks) if ks else 0.0,
        # pooled over the burst: a session that never drafted (or drafted little) does not pull it to 0
        "acceptance": sum(c[2] for c in by_proposer.values()) / max(sum(c[1] for c in by_proposer.values()), 1),
        "rounds": rounds, "by_proposer": by_proposer,
    }


def pipeline_config(args, models: dict):
    from specdec.client.local import LocalPipelineConfig, sharing

    return LocalPipelineConfig(
        target_model=models["target"], draft_model=models["draft"],
        # No prefix cache in the tiers: the rows and levels reuse prompts, so a later row would find the
        # prompts' KV cached by an earlier one and skip their prefill (the peer has no such cache).
        target_args=["--device", args.device, "--dtype", args.dtype, "--no-prefix-cache", *shlex.split(args.target_args)],
        draft_args=["--device", args.device, "--dtype", args.draft_dtype or args.dtype, "--no-prefix-cache",
                    *shlex.split(args.draft_args)],
        coordinator_args=["--log-level", "warning", *shlex.split(args.coordinator_args)], **sharing(args.device))


def cold_bursts(args, levels: list[int], rows: list[str], models: dict) -> dict:
    """Each burst on a fresh cluster (rows alternating at each level), as run_pipeline_rows reports them."""
    from specdec.client.local import LocalPipeline

    runs: dict = {row: {c: [] for c in levels} for row in rows}
    for c in levels:
        for _ in range(max(args.repeats, 1)):
            for row in rows:
                with LocalPipeline(pipeline_config(args, models)) as pipeline:
                    res = burst(pipeline.address, chat_prompts(c), args.max_new_tokens, ROW_K[row], args.temperature)
                runs[row][c].append(res)
                log(f"{row} C={c} cold: {res['aggregate_tok_s']:.1f} tok/s aggregate, mean K {res['mean_k']:.2f}")
    return runs


def run_pipeline_rows(args, levels: list[int], rows: list[str], models: dict) -> dict:
    from specdec.client import Client
    from specdec.client.local import LocalPipeline

    if args.cold:
        return medians(cold_bursts(args, levels, rows, models), {row: {} for row in rows}, levels, rows)
    with LocalPipeline(pipeline_config(args, models)) as pipeline:
        log(f"services up at {pipeline.address}")
        with Client(pipeline.address, timeout_s=600) as client:  # warm-up: both tiers, both paths
            client.generate(messages=chat_prompts(1)[0], max_new_tokens=16, ignore_eos=True)
            client.generate(messages=chat_prompts(1)[0], max_new_tokens=16, ignore_eos=True, num_speculative_tokens=0)
        runs: dict = {row: {c: [] for c in levels} for row in rows}
        for c in levels:  # at each level the rows alternate, so a slow spell of the machine hits both
            for row in rows:  # untimed: what the level's first burst meets once (lazily captured graphs) hits no row
                burst(pipeline.address, chat_prompts(c), args.max_new_tokens, ROW_K[row], args.temperature)
            for _ in range(max(args.repeats, 1)):
                for row in rows:
                    k = ROW_K[row]
                    res = burst(pipeline.address, chat_prompts(c), args.max_new_tokens, k, args.temperature)
                    runs[row][c].append(res)
                    log(f"{row} C={c}: {res['aggregate_tok_s']:.1f} tok/s aggregate, {res['per_client_tok_s']:.2f} per "
                        f"client, TTFT p50 {res['ttft_p50_s']:.2f}s, TPOT p50 {res['tpot_p50_ms']:.0f} ms, mean K {res['mean_k']:.2f}")
        loads: dict = {row: {} for row in rows}
        if args.steady > 0:
            for c in levels:  # --repeats windows per row and level, the rows alternating
                windows: dict = {row: [] for row in rows}
                for _ in range(max(args.repeats, 1)):
                    for row in rows:
                        k = ROW_K[row]
                        w = steady(pipeline.address, chat_prompts(2 * c), c, args.max_new_tokens, k, args.steady,
                                   args.steady_warmup, args.temperature)
                        windows[row].append(w)
                        log(f"{row} C={c} steady: {w['steady_tok_s']:.1f} tok/s over {w['window_s']:.0f} s")
                for row in rows:
                    rates = [w["steady_tok_s"] for w in windows[row]]
                    gaps = [g for w in windows[row] for g in w["gaps_s"]]  # every window's, pooled
                    loads[row][c] = {"steady_tok_s": statistics.mean(rates), "range": (min(rates), max(rates)),
                                     "window_s": windows[row][0]["window_s"], "windows": len(rates),
                                     "gap_p99_ms": 1e3 * percentile(gaps, 99), "gap_max_ms": 1e3 * max(gaps, default=0.0)}
    return medians(runs, loads, levels, rows)


def medians(runs: dict, loads: dict, levels: list[int], rows: list[str]) -> dict:
    """Per row and level, the burst of median aggregate tok/s, with the range and the steady load's figures."""
    out: dict = {}
    for row in rows:
        out[row] = {}
        for c in levels:
            ordered = sorted(runs[row][c], key=lambda r: r["aggregate_tok_s"])
            median = dict(ordered[len(ordered) // 2])
            median["range_tok_s"] = (ordered[0]["aggregate_tok_s"], ordered[-1]["aggregate_tok_s"])
            median["repeats"] = len(ordered)
            # each request's own speed (tokens over its latency), pooled over every burst of the row
            median["mean_client_tok_s"] = statistics.mean(x for r in ordered for x in r["client_rates"])
            if c in loads[row]:
                median["steady"] = loads[row][c]
            out[row][c] = median
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from specdec.models import default_draft, default_target

    levels = [int(x) for x in args.levels.split(",") if x]
    rows = [r for r in args.rows.split(",") if r]
    models = {"target": args.target or default_target(), "draft": args.draft or default_draft()}
    command = " ".join(["python -m bench.concurrency", shlex.join(list(argv if argv is not None else sys.argv[1:]))]).strip()
    t0 = time.time()
    results: dict = {}
    pipeline_rows = [r for r in rows if r in ("specdec", "k0")]
    if pipeline_rows:
        results.update(run_pipeline_rows(args, levels, pipeline_rows, models))
    if "peer" in rows:
        peer = run_peer(levels, args.max_new_tokens, models["target"], chat_prompts, args.device, args.dtype)
        results["peer:continuous"], results["peer:padded"] = peer["continuous"], peer["padded"]
    m = machine_info()
    gpu = f"GPU **{gpu_name(args.device)}** (`--device {args.device}`), both tiers and the peer on it" if args.device != "cpu" else "no GPU"
    info = (f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory']} RAM, {gpu}; torch {m.get('torch')}, "
            f"transformers {m.get('transformers')}; git {git_commit()}; wall {(time.time() - t0) / 60:.1f} min; "
            f"target {Path(models['target']).name} ({args.dtype}), draft {Path(models['draft']).name} ({args.draft_dtype or args.dtype})")
    plot_path = Path(args.plot or REPO / "docs" / ("bench_concurrency.png" if args.device == "cpu" else "bench_concurrency_gpu.png"))
    where = f"{gpu_name(args.device).split(' (')[0]}, {args.dtype}" if args.device != "cpu" else f"{m['cores']} cores"
    made = plot(results, levels, plot_path, f"aggregate throughput vs concurrency ({where}, N={args.max_new_tokens})")
    # The log links the plot only where the link will resolve: a plot drawn outside the repository (--plot
    # /tmp/x.png) is named in the printout, not linked from a committed log.
    inside = plot_path.resolve().is_relative_to(REPO.resolve())
    link = (os.path.relpath(plot_path, Path(args.out).resolve().parent) if inside else None) if args.out else plot_path.name
    lines = markdown(results, levels, command, info, args.max_new_tokens, link if made else None, args.temperature)
    if made and not inside:
        print(f"plot: {plot_path}")
    if args.out:
        append_section("\n".join(lines), args.out)
    if args.json:
        Path(args.json).write_text(json.dumps({str(k): v for k, v in results.items()}, indent=1, default=str))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
