"""Target-only rounds with and without the run-on (PolicyConfig.run_on): what the split costs a K = 0 generation.

One client, the real pair (or --target / --draft), three processes on loopback as `make run` starts them, K = 0,
greedy, EOS ignored. The tiers start once; the coordinator is restarted for each row, alternating, `--pairs`
times: "run-on" (the default) and "one token a round" (`--adaptive-run-on 0`). Per row, the median over its
generations: tokens/s, rounds, and the generation's time outside the target's forwards (elapsed less the
verify compute the target reports), split into the tiers' own time, the network and the coordinator, as a
share of the generation (issue 35's goal for the real pair: <= 5%).

    python -m bench.run_on                                     # 3 pairs of 4 generations of 256 tokens
    python -m bench.run_on --target-args='--device cuda' --draft-args='--device cuda'
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import statistics
import subprocess
import sys
import time

from bench.common import bench_log, md_table, publish
from bench.pipeline import BenchPipeline
from specdec.client import Client
from specdec.client.local import LocalPipelineConfig
from specdec.models import default_draft, default_target

PROMPT = "Explain how a refrigerator works."
ROWS = {"run-on": [], "one token a round": ["--adaptive-run-on", "0"]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run_on", description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=3, help="times each row runs, alternating")
    p.add_argument("--generations", type=int, default=4, help="timed generations per row and pair (after a warm-up)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--target", default=None, help="target model (default: the default pair's)")
    p.add_argument("--draft", default=None, help="draft model (default: the default pair's)")
    p.add_argument("--target-args", default="", help="extra flags for the target service")
    p.add_argument("--draft-args", default="", help="extra flags for the draft service")
    p.add_argument("--out", default=str(bench_log()), help="markdown file to append to ('' = none)")
    return p.parse_args(argv)


def measure(address: str, generations: int, n: int) -> list[dict]:
    rows = []
    with Client(address) as c:
        c.generate(prompt=PROMPT, max_new_tokens=16, num_speculative_tokens=0, ignore_eos=True)
        for _ in range(generations):
            t0 = time.perf_counter()
            out = c.generate(prompt=PROMPT, max_new_tokens=n, num_speculative_tokens=0, ignore_eos=True)
            wall_ms = (time.perf_counter() - t0) * 1e3
            s = out.stats
            elapsed_ms = s["elapsed_s"] * 1e3
            rows.append({"tok_s": len(out.token_ids) / (wall_ms / 1e3), "rounds": s["rounds"],
                         "outside": (elapsed_ms - s["verify_ms"]) / elapsed_ms, "tier": s["tier_ms"] / elapsed_ms,
                         "network": s["network_ms"] / elapsed_ms, "coordinator": s["coordinator_ms"] / elapsed_ms,
                         "forward_ms": s["verify_ms"] / max(1, len(out.token_ids))})
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    config = LocalPipelineConfig(target_model=args.target or default_target(), draft_model=args.draft or default_draft(),
                                 target_args=shlex.split(args.target_args), draft_args=shlex.split(args.draft_args))
    results: dict[str, list[dict]] = {name: [] for name in ROWS}
    with BenchPipeline(config) as pipe:
        for _ in range(args.pairs):
            for name, flags in ROWS.items():
                pipe.restart_coordinator(flags)
                results[name] += measure(pipe.address, args.generations, args.max_new_tokens)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [f"## {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC: target-only rounds, run-on against one token a round",
             "", f"Command: `{shlex.join(['python', '-m', 'bench.run_on', *(argv if argv is not None else sys.argv[1:])])}` "
             f"(git {commit})", "",
             f"One client, K = 0, greedy, {args.max_new_tokens} tokens, EOS ignored; the rows alternate {args.pairs} times "
             f"over the same tiers, {args.generations} generations each; medians over all of a row's generations. "
             "Outside the forwards: the generation's time less the target's verify compute, as a share of it "
             "(goal for the real pair: <= 5%), and its parts:", ""]
    table = []
    for name, rows in results.items():
        med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        table.append([name, f"{med['tok_s']:.1f}", f"{med['rounds']:.0f}", f"{med['forward_ms']:.2f}",
                      f"**{med['outside']:.1%}**", f"{med['tier']:.1%}", f"{med['network']:.1%}", f"{med['coordinator']:.1%}"])
    lines += md_table(["row", "tokens/s", "rounds", "forward ms a token", "outside the forwards", "the tiers' own",
                       "network", "coordinator"], table)
    text = "\n".join(lines) + "\n"
    publish(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
