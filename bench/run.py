"""`make bench`: target alone vs Hugging Face assisted generation vs specdec, on the same machine.

    python -m bench.run                      # quick run (a few minutes on 2 cores)
    python -m bench.run --long               # the full matrix (hours on 2 cores)
    python -m bench.run --smoke --max-new-tokens 16 --workloads open --placements shared --out /tmp/b.md
    python -m bench.run --device cuda --dtype float32     # on a GPU: both tiers and the baselines there
    python -m bench.run --device cuda --draft TARGET --draft-dtype bfloat16   # the target's own copy as draft

Appends one section per run to the month's log in docs/bench-logs/ (created with a header explaining the columns),
prints the same tables to stdout and progress to stderr, and redraws docs/bench_speed_vs_k.png and
docs/bench_bound.png. Goals are recorded ("met" / "missed"), never asserted: a slow machine never
fails the bench. A row that errors (e.g. a proposer the server does not implement yet) shows
"n/a (error: ...)" and the run goes on.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from bench.common import T_START, CpuMeter, append_section, bench_log, log_header, plot_dir, gpu_name, log, machine_info, wait_idle
from bench.run_rows import run_baselines, run_specdec
from bench.run_rows import repeats as _repeats
from bench.run_plan import SPEC_MAX_NEW_TOKENS, build_plan, describe_plan
from bench.run_section import build_section


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--long", action="store_true", help="the full matrix: K 1..8 everywhere, all prompts, 2 repeats, N=128")
    mode.add_argument("--smoke", action="store_true", help="tiny run for development: 1 prompt, 2 K values, N=16")
    p.add_argument("--out", default=str(bench_log()), help="markdown file to append the run's section to ('' = none: "
                                                               "printed only)")
    p.add_argument("--plot-dir", default=None,
                   help="where the PNGs go (default: docs/ for a log under docs/, else the directory of --out; with "
                        "--out '' a temporary directory)")
    p.add_argument("--json", default=None, help="also write every raw sample (token ids, stats) to this JSON file")
    p.add_argument("--placements", default=None,
                   help="comma list of shared, separate (CPU; the default there) or gpu (the default with --device cuda)")
    p.add_argument("--workloads", default="open,grounded,template", help="comma list of open, grounded, template")
    p.add_argument("--max-new-tokens", type=int, default=None, help=f"tokens per generation (quick 32, long {SPEC_MAX_NEW_TOKENS})")
    p.add_argument("--repeats", type=int, default=None, help="repeats of each prompt (quick 1, long 2)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per workload, 0 = all (quick 3, long all)")
    p.add_argument("--template-prompts", type=int, default=None,
                   help="requests of the template workload, in sequence (quick and long 20, smoke 4)")
    p.add_argument("--ks", type=_ints, default=None, help="greedy K values for the draft proposer, e.g. 1,2,3,4")
    p.add_argument("--temperatures", type=_floats, default=None, help="sampled temperatures (default 0.7,1.0)")
    p.add_argument("--sampled-ks", type=_ints, default=None, help="K values for sampled rows (adaptive is always added)")
    p.add_argument("--lookup-ks", type=_ints, default=None, help="K values for lookup/hybrid rows (grounded; adaptive added)")
    p.add_argument("--proposers", default="lookup,suffix,hybrid", help="extra proposers for the grounded workload ('' = none)")
    p.add_argument("--no-sampled", action="store_true", help="skip sampled (temperature > 0) rows")
    p.add_argument("--sampled-everywhere", action="store_true",
                   help="sampled rows in every placement and workload (quick mode: only shared/open)")
    p.add_argument("--no-peer", action="store_true", help="skip the Hugging Face assisted-generation rows")
    p.add_argument("--no-target-compiled", action="store_true",
                   help="skip the target alone with a static cache + torch.compile (its best settings; compiles ~1 min)")
    p.add_argument("--warmup-tokens", type=int, default=None, help="tokens of the one warm-up generation per method (0 = none)")
    p.add_argument("--wait-idle", type=float, default=60.0, metavar="SECONDS",
                   help="before each placement, wait up to this long for other processes to go quiet (< 10%% CPU)")
    p.add_argument("--retry-disturbed", type=int, default=1, metavar="N",
                   help="measure a generation again (after waiting up to 15 s for quiet) when other processes used "
                        "> 10%% of the CPU during it, up to N times; the last measurement is kept")
    p.add_argument("--retry-budget", type=float, default=60.0, metavar="SECONDS",
                   help="at most this long spent on such retries per placement and part (baselines / services)")
    p.add_argument("--target-args", default="", metavar="ARGS", help="extra flags for every target service, e.g. '--max-sessions 8'")
    p.add_argument("--draft-args", default="", metavar="ARGS", help="extra flags for every draft service")
    p.add_argument("--coordinator-args", default="", metavar="ARGS",
                   help="extra flags for every coordinator, e.g. '--overlap' (use --coordinator-args=--overlap)")
    p.add_argument("--tree-nodes", type=int, default=0,
                   help="> 0: every coordinator proposes token trees of this many nodes from lookup / suffix (issue 17)")
    p.add_argument("--draft-trees", type=int, default=16,
                   help="node budget of the draft model's token-tree rows (beside its chains; 0 = no tree rows)")
    p.add_argument("--tree-ks", type=_ints, default=[2],
                   help="depths of the fixed-K draft-tree rows (an adaptive tree row is always added)")
    p.add_argument("--speculate", type=int, default=4,
                   help="outcomes the draft's speculation cache pre-drafts in the overlap rows (0 = no overlap rows)")
    p.add_argument("--target", default=None, help="target model (default: specdec.models.default_target())")
    p.add_argument("--draft", default=None, help="draft model (default: specdec.models.default_draft())")
    p.add_argument("--device", default="cpu", help="torch device of both tiers and the in-process baselines: cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="float32", help="dtype of the target tier and the in-process target: float32 | bfloat16 | float16")
    p.add_argument("--draft-dtype", default=None,
                   help="dtype of the draft tier and the in-process draft (default: --dtype); with --draft set to the "
                        "target, e.g. bfloat16 makes the target's own low-precision copy the draft")
    p.add_argument("--baseline-only", metavar="SPEC_JSON", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def llama_cpp_row(plan: dict, models: dict, prompts: dict, rows: list[dict], aggs: dict) -> list[str]:
    """bench.llama_cpp_peer's lines: its tok/s on every prompt of the run, beside specdec's K = 0 (shared placement)."""
    from bench import llama_cpp_peer, report
    from specdec.models import load_tokenizer

    tok = load_tokenizer(models["target"])
    ids = {p.id: list(tok.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
           for wl in plan["workloads"] for p in prompts[wl]}
    log("llama.cpp peer on the target GGUF")
    result = llama_cpp_peer.measure(models["target"], ids, plan["max_new_tokens"], threads=len(os.sched_getaffinity(0)))
    k0 = report.find_row(rows, aggs, placement=plan["placements"][0], method="specdec", k=0)
    return llama_cpp_peer.section_lines(result, aggs[k0[0]["key"]]["tps"] if k0 else None)


# --- the plan -------------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    if args.baseline_only:
        from bench.inprocess import main as baseline_main
        return baseline_main(args.baseline_only)

    from bench import report
    from bench.prompts import prompts_for
    from specdec.models import default_draft, default_target

    plan = build_plan(args)
    models = {"target": args.target or default_target(), "draft": args.draft or default_draft()}
    prompts = {wl: prompts_for(wl, (plan["template_prompts"] if wl == "template" else plan["prompts"]) or None)
               for wl in plan["workloads"]}
    if plan["device"] != "cpu":
        log(f"device {plan['device']}: {gpu_name(plan['device'])}; target {plan['dtype']}, draft {plan['draft_dtype']}")
    if "separate" in plan["placements"] and len(os.sched_getaffinity(0)) < 2:
        log("separate placement needs 2 CPUs; skipping it")
        plan["placements"] = [p for p in plan["placements"] if p != "separate"]
        plan["rows"] = [r for r in plan["rows"] if r["placement"] != "separate"]
    cli = list(argv if argv is not None else sys.argv[1:])
    command = " ".join(["python -m bench.run", shlex.join(cli)]).strip()
    n_gen = sum(len(prompts[r["workload"]]) * _repeats(plan, r) for r in plan["rows"])
    for line in describe_plan(plan):
        log(line)
    log(f"{len(plan['rows'])} rows, {n_gen} timed generations of {plan['max_new_tokens']} tokens; "
        f"roughly {n_gen * plan['max_new_tokens'] * 0.075 / 60 + 1.0 * len(plan['placements']):.0f} min on an idle 2-core CPU")
    info = machine_info()
    if plan["device"] != "cpu":
        info["gpu"] = gpu_name(plan["device"])
    started = dt.datetime.now(dt.timezone.utc)
    meter = CpuMeter()

    all_rows: list[dict] = []
    per_placement = {}
    baseline_meta = {}
    waited = 0.0
    for pl in plan["placements"]:
        t_wait = time.time()
        wait_idle(args.wait_idle, pl)
        waited += time.time() - t_wait
        base = run_baselines(plan, pl, prompts, models)
        baseline_meta[pl] = {k: v for k, v in base.items() if k != "rows"}
        spec = run_specdec(plan, pl, prompts, models)
        per_placement[pl] = spec
        for r in base["rows"] + spec["rows"]:
            all_rows.append(r)
    elapsed = time.time() - T_START
    other = meter.other_fraction()

    # order rows as planned
    order = {r["key"]: i for i, r in enumerate(plan["rows"])}
    all_rows.sort(key=lambda r: order.get(r["key"], 1 << 30))
    aggs = {r["key"]: report.aggregate(r) for r in all_rows}
    bounds = report.bound_rows(all_rows, aggs)
    summary = report.summarise(all_rows, aggs, bounds, plan["placements"], plan["workloads"])

    # --- the markdown section ---
    # --out '': the section printed only, its plots drawn outside the repository (the committed ones untouched)
    plots = (Path(args.plot_dir) if args.plot_dir else plot_dir(args.out) if args.out
             else Path(tempfile.mkdtemp(prefix="bench-run-")))
    out_path = Path(args.out) if args.out else plots / "run.md"
    section = build_section(plan=plan, models=models, prompts=prompts, info=info, started=started, command=command,
                            elapsed=elapsed, waited=waited, other=other, all_rows=all_rows, aggs=aggs, bounds=bounds,
                            summary=summary, per_placement=per_placement, baseline_meta=baseline_meta, out_path=out_path,
                            plot_dir=plots)
    if plan["device"] == "cpu":  # the llama.cpp peer on the same GGUF and prompts (where it is installed)
        section = section.rstrip("\n") + "\n\n" + "\n".join(llama_cpp_row(plan, models, prompts, all_rows, aggs))
    if args.out:
        append_section(section, out_path, header=log_header(Path(out_path)) + "\n" + report.HEADER)
    if args.json:
        Path(args.json).write_text(json.dumps({"plan": plan, "machine": info, "rows": all_rows, "aggregates": aggs,
                                               "bounds": bounds, "placements": per_placement, "baselines": baseline_meta},
                                              default=str))
    print(section)
    log(f"done in {elapsed / 60:.1f} min; " + (f"appended to {out_path}" if args.out else f"not logged (plots in {plots})"))
    return 0



if __name__ == "__main__":
    sys.exit(main())
