"""What bench.run measures, per placement: the in-process baselines (target alone, Hugging Face assisted
generation and prompt lookup, in a child process: bench.inprocess) and the specdec rows (the three services
as processes: bench.pipeline), each returning its rows with their timed samples."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, log
from bench.prompts import PROMPTS
from coordinator.proposers.suffix import SuffixConfig


PLACEMENTS = {
    # env / args for the tiers, CPU sets, in-process baseline pinning
    # shared: OpenMP's default wait policy for the tiers and the baselines alike, the best for each
    # (specdec.client.local; a passive policy slowed transformers' generate alone from 30 to 17 tok/s).
    "shared": dict(env={}, target_args=[], draft_args=[], affinity=None,
                   parent_cpus=None, baseline=dict(pin_cpus=None, threads=0)),
    "separate": dict(env={}, target_args=["--threads", "1"], draft_args=["--threads", "1"],
                     affinity={"target": {0}, "draft": {1}, "coordinator": {1}}, parent_cpus={1},
                     baseline=dict(pin_cpus=[0], threads=1)),
    # Both tiers on the one GPU (--device), every process free to use every core with torch's default
    # threads: core pinning and OpenMP settings mean little when the model runs on the GPU.
    "gpu": dict(env={}, target_args=[], draft_args=[], affinity=None, parent_cpus=None,
                baseline=dict(pin_cpus=None, threads=0)),
}


def tier_device_args(plan: dict) -> dict[str, list[str]]:
    """--device / --dtype for each tier: the target in --dtype, the draft in --draft-dtype."""
    return {"target": ["--device", plan["device"], "--dtype", plan["dtype"]],
            "draft": ["--device", plan["device"], "--dtype", plan["draft_dtype"]]}


def run_baselines(plan: dict, placement: str, prompts: dict, models: dict) -> dict:
    rows = [r for r in plan["rows"] if r["placement"] == placement and r["method"] != "specdec"]
    with tempfile.TemporaryDirectory(prefix="specdec-bench-") as tmp:
        spec = {**PLACEMENTS[placement]["baseline"], **models, "max_new_tokens": plan["max_new_tokens"],
                "device": plan["device"], "dtype": plan["dtype"], "draft_dtype": plan["draft_dtype"],
                "retry": plan["retry"],
                "repeats": plan["repeats"], "warmup_tokens": plan["warmup_tokens"], "rows": rows,
                "prompts": [{"id": p.id, "workload": p.workload, "messages": p.messages}
                            for wl in plan["workloads"] for p in prompts[wl]],
                "out": str(Path(tmp) / "result.json")}
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        log(f"{placement}: in-process baselines ({len(rows)} rows) in a child process"
            + (f" pinned to CPU {spec['pin_cpus']} with {spec['threads']} thread" if spec["pin_cpus"] else ""))
        env = {**os.environ, **PLACEMENTS[placement]["env"]}  # the same OpenMP settings as the tiers
        proc = subprocess.run([sys.executable, "-m", "bench.run", "--baseline-only", str(spec_path)], cwd=REPO, env=env)
        if proc.returncode != 0 or not Path(spec["out"]).exists():
            err = f"baseline process exited with {proc.returncode}"
            return {"rows": [{**r, "samples": [], "error": err} for r in rows], "error": err}
        return json.loads(Path(spec["out"]).read_text())


# The shared suffix tree must not let a row find another row's (or its own earlier repeat's) output
# of the same prompt: the main coordinator of a placement runs without it, and each template row
# that uses it (suffix, hybrid) gets a fresh coordinator whose tree learns from that row alone.
MAIN_COORDINATOR_FLAGS = ("--suffix-cache-entries", "0")
WARMUP_PROMPT = next(p for p in PROMPTS if p.workload == "open")  # unrelated to the template requests


def variant_flags(row: dict, plan: dict) -> tuple[str, ...]:
    """The coordinator flags of a row's variant (bench.run_plan.tree_variants)."""
    v = row.get("variant", "")
    flags: tuple[str, ...] = ()
    if "tree" in v:
        flags += ("--draft-tree-nodes", str(plan["draft_trees"]))
    if "overlap" in v:
        flags += ("--overlap", "--speculate-outcomes", str(plan["speculate"]))
    return flags


def coordinator_flags(row: dict, plan: dict | None = None) -> tuple[tuple[str, ...], bool]:
    """(coordinator flags the row needs beyond the main coordinator's, whether it needs a fresh one)."""
    flags = ("--default-proposer", "suffix") if row["proposer"] == "suffix" else ()
    flags += variant_flags(row, plan or {})
    if row["workload"] == "template" and row["proposer"] in ("suffix", "hybrid"):
        return flags + ("--suffix-cache-entries", str(SuffixConfig.cache_entries)), True
    return flags, False


def repeats(plan: dict, row: dict) -> int:
    """The template workload runs once per row: a repeat would find its own outputs in the shared tree."""
    return 1 if row["workload"] == "template" and row["method"] == "specdec" else plan["repeats"]


def run_specdec(plan: dict, placement: str, prompts: dict, models: dict) -> dict:
    from bench.inprocess import BackgroundMeter, RetryPolicy, own_cpu_seconds
    from bench.pipeline import BenchPipeline, run_specdec_row
    from specdec.client import Client
    from specdec.client.local import LocalPipelineConfig

    cfg = PLACEMENTS[placement]
    rows = [r for r in plan["rows"] if r["placement"] == placement and r["method"] == "specdec"]
    out = {"rows": [], "memory": {}, "cpus": {}, "error": None, "start_s": None, "info": None}
    parent_cpus = os.sched_getaffinity(0)
    if cfg["parent_cpus"]:
        os.sched_setaffinity(0, cfg["parent_cpus"])  # the client stays off the target's core
    extra = plan["extra_args"]
    dev = tier_device_args(plan)
    pipeline = BenchPipeline(LocalPipelineConfig(
        target_model=models["target"], draft_model=models["draft"],
        target_args=[*cfg["target_args"], *dev["target"], *extra["target"]],
        draft_args=[*cfg["draft_args"], *dev["draft"], *extra["draft"]],
        coordinator_args=["--log-level", "warning", *extra["coordinator"], *MAIN_COORDINATOR_FLAGS],
        env=dict(cfg["env"]), shared_cores=placement == "shared",
        shared_gpu=placement == "gpu"),
        affinity=cfg["affinity"])
    try:
        t = time.perf_counter()
        log(f"{placement}: starting target, draft and coordinator services"
            + (f" (env {cfg['env']})" if cfg["env"] else "") + (f" (affinity {cfg['affinity']})" if cfg["affinity"] else ""))
        pipeline.start()
        out["cpus"] = pipeline.pin_all_threads()
        out["omp_wait_policy"] = pipeline.environ("OMP_WAIT_POLICY")
        out["start_s"] = time.perf_counter() - t
        log(f"{placement}: services up in {out['start_s']:.1f}s at {pipeline.address}; CPUs allowed {out['cpus']}")
        client = Client(pipeline.address, timeout_s=900)
        try:
            try:
                out["info"] = client.info()
            except Exception as e:  # informational only
                out["info"] = {"error": str(e)}
            warmed: set = set()
            meter = BackgroundMeter(own=lambda: own_cpu_seconds() + sum(v for v in pipeline.cpu_seconds().values() if v == v))
            retry = RetryPolicy(**plan["retry"], own=meter.own)
            current: tuple[str, ...] = ()  # coordinator flags beyond the placement's (the main coordinator: none)
            for r in rows:
                flags, fresh = coordinator_flags(r, plan)
                if fresh or flags != current:
                    client.close()
                    pipeline.restart_coordinator(list(flags))
                    log(f"{placement}: fresh coordinator for {r['key']}" + (f" ({shlex.join(flags)})" if flags else ""))
                    client, current, warmed = Client(pipeline.address, timeout_s=900), flags, set()
                res = run_specdec_row(client, r, prompts[r["workload"]], plan["max_new_tokens"], repeats(plan, r),
                                      plan["warmup_tokens"], log, warmed, meter, retry,
                                      warmup_prompt=WARMUP_PROMPT if r["workload"] == "template" else None)
                out["rows"].append(res)
                if res["error"] and any(pipeline.procs[n].poll() is not None for n in pipeline.procs):
                    dead = {n: p.returncode for n, p in pipeline.procs.items() if p.poll() is not None}
                    out["error"] = f"service process(es) exited: {dead}"
                    log(f"{placement}: {out['error']}; remaining rows skipped")
                    for name in dead:
                        log(f"--- {name} log tail ---\n{pipeline.log_tail(name)}")
                    break
        finally:
            client.close()
        out["retries"], out["retry_spent_s"] = retry.retries, retry.spent
        out["memory"] = pipeline.memory()
        out["tier_cpu_s"] = pipeline.cpu_seconds()
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        log(f"{placement}: pipeline failed: {out['error']}")
    finally:
        out["exit_codes"] = pipeline.stop()
        os.sched_setaffinity(0, parent_cpus)
    done = {r["key"] for r in out["rows"]}
    for r in rows:
        if r["key"] not in done:
            out["rows"].append({**r, "samples": [], "error": out["error"] or "not run"})
    return out


