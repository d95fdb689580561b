"""`make bench`: target alone vs Hugging Face assisted generation vs specdec, on the same machine.

    python -m bench.run                      # quick run (a few minutes on 2 cores)
    python -m bench.run --long               # the full matrix (hours on 2 cores)
    python -m bench.run --smoke --max-new-tokens 16 --workloads open --placements shared --out /tmp/b.md
    python -m bench.run --device cuda --dtype float32     # on a GPU: both tiers and the baselines there
    python -m bench.run --device cuda --draft TARGET --draft-dtype bfloat16   # the target's own copy as draft

Appends one section per run to docs/BENCHMARKS.md (created with a header explaining the columns),
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
import platform
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.inprocess import DISTURBED
from bench.prompts import PROMPTS
from coordinator.proposers.suffix import SuffixConfig

REPO = Path(__file__).resolve().parent.parent
T_START = time.time()

MODES = {
    # quick: sized to finish in about 15 minutes on an idle 2-core CPU (8 without the template workload).
    "quick": dict(max_new_tokens=32, prompts=3, template_prompts=20, template_placements=("shared", "gpu"), repeats=1,
                  warmup_tokens=8, greedy_ks=[1, 2, 4], sampled_temps=[0.7, 1.0], sampled_ks=[2],
                  lookup_ks=[2, 4], peer_sampled_temps=[0.7], peer_fixed_ks=[], peer_lookup_ks=[2, 4],
                  sampled_cells=[("shared", "open"), ("gpu", "open")]),
    "long": dict(max_new_tokens=128, prompts=0, template_prompts=20, template_placements=None, repeats=2, warmup_tokens=16,
                 greedy_ks=list(range(1, 9)), sampled_temps=[0.7, 1.0], sampled_ks=list(range(1, 9)),
                 lookup_ks=[2, 4, 8], peer_sampled_temps=[0.7, 1.0], peer_fixed_ks=[1, 2, 4], peer_lookup_ks=[2, 4, 8],
                 sampled_cells=None),
    "smoke": dict(max_new_tokens=16, prompts=1, template_prompts=4, template_placements=None, repeats=1, warmup_tokens=4,
                  greedy_ks=[1, 2], sampled_temps=[0.7], sampled_ks=[2],
                  lookup_ks=[2], peer_sampled_temps=[0.7], peer_fixed_ks=[], peer_lookup_ks=[2],
                  sampled_cells=None),
}
SPEC_MAX_NEW_TOKENS = 128
TEMPLATE_PROPOSERS = ("lookup", "suffix", "hybrid")  # adaptive K each, beside target alone and K = 0


def log(msg: str) -> None:
    print(f"[{time.time() - T_START:7.1f}s] {msg}", file=sys.stderr, flush=True)


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
    p.add_argument("--out", default=str(REPO / "docs" / "BENCHMARKS.md"), help="markdown file to append the run's section to")
    p.add_argument("--plot-dir", default=None, help="where the PNGs go (default: the directory of --out)")
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
    p.add_argument("--target", default=None, help="target model (default: specdec.models.default_target())")
    p.add_argument("--draft", default=None, help="draft model (default: specdec.models.default_draft())")
    p.add_argument("--device", default="cpu", help="torch device of both tiers and the in-process baselines: cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="float32", help="dtype of the target tier and the in-process target: float32 | bfloat16 | float16")
    p.add_argument("--draft-dtype", default=None,
                   help="dtype of the draft tier and the in-process draft (default: --dtype); with --draft set to the "
                        "target, e.g. bfloat16 makes the target's own low-precision copy the draft")
    p.add_argument("--baseline-only", metavar="SPEC_JSON", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- the plan -------------------------------------------------------------------------------------

def build_plan(args) -> dict:
    mode = "long" if args.long else "smoke" if args.smoke else "quick"
    m = dict(MODES[mode])
    for key, value in (("max_new_tokens", args.max_new_tokens), ("repeats", args.repeats), ("prompts", args.prompts),
                       ("template_prompts", args.template_prompts),
                       ("greedy_ks", args.ks), ("sampled_ks", args.sampled_ks), ("lookup_ks", args.lookup_ks),
                       ("warmup_tokens", args.warmup_tokens), ("sampled_temps", args.temperatures)):
        if value is not None:
            m[key] = value
    if args.temperatures is not None:
        m["peer_sampled_temps"] = args.temperatures[:1] if mode != "long" else args.temperatures
    if args.no_sampled:
        m["sampled_temps"], m["peer_sampled_temps"] = [], []
    on_gpu = args.device != "cpu"
    placements = [x for x in (args.placements or ("gpu" if on_gpu else "shared,separate")).split(",") if x]
    workloads = [x for x in args.workloads.split(",") if x]
    for pl in placements:
        if pl not in PLACEMENTS:
            raise SystemExit(f"unknown placement {pl!r}")
        if (pl == "gpu") != on_gpu:
            raise SystemExit(f"placement {pl!r} does not fit --device {args.device} (gpu goes with a GPU device, "
                             "shared and separate with cpu)")
    proposers = [x for x in args.proposers.split(",") if x]
    m.update(mode=mode, placements=placements, workloads=workloads, proposers=proposers, peer=not args.no_peer,
             device=args.device, dtype=args.dtype, draft_dtype=args.draft_dtype or args.dtype,
             retry=dict(max_retries=args.retry_disturbed, wait_s=15.0, budget_s=args.retry_budget),
             extra_args={"target": shlex.split(args.target_args), "draft": shlex.split(args.draft_args),
                         "coordinator": shlex.split(args.coordinator_args)})
    if args.sampled_everywhere:
        m["sampled_cells"] = None
    rows = []
    for pl in placements:
        for wl in workloads:
            sampled_here = m["sampled_cells"] is None or (pl, wl) in m["sampled_cells"]

            def add(method, **kw):
                r = dict(placement=pl, workload=wl, method=method, proposer=kw.get("proposer"), k=kw.get("k"),
                         temperature=float(kw.get("temperature", 0.0)))
                t = f"T{r['temperature']:g}"
                k = "Kdefault" if r["k"] is None else f"K{r['k']}"
                r["key"] = "/".join(x for x in (pl, wl, method, r["proposer"] or "", t, k) if x)
                rows.append(r)
            if wl == "template":  # 20 requests per row: target alone, K = 0 and the model-free proposers
                if m["template_placements"] is not None and pl not in m["template_placements"]:
                    continue  # quick mode: the shared placement only
                add("target")
                add("specdec", proposer="draft", k=0)
                for prop in TEMPLATE_PROPOSERS:
                    add("specdec", proposer=prop, k=None)
                continue
            add("target")
            if m["peer"]:
                add("peer")
                for temp in (m["peer_sampled_temps"] if sampled_here else []):
                    add("peer", temperature=temp)
                for k in m["peer_fixed_ks"]:
                    add("peer", k=k)
                if wl == "grounded":
                    for k in m["peer_lookup_ks"]:
                        add("peer_lookup", k=k)
            add("specdec", proposer="draft", k=0)
            for k in [*m["greedy_ks"], None]:
                add("specdec", proposer="draft", k=k)
            for temp in (m["sampled_temps"] if sampled_here else []):
                for k in [*m["sampled_ks"], None]:
                    add("specdec", proposer="draft", k=k, temperature=temp)
            if wl == "grounded":
                for prop in proposers:
                    for k in [*m["lookup_ks"], None]:
                        add("specdec", proposer=prop, k=k)
    m["rows"] = rows
    return m


def describe_plan(plan: dict) -> list[str]:
    n = plan["max_new_tokens"]
    lines = [f"mode **{plan['mode']}**: {n} new tokens per generation"
             + (f" (the spec's {SPEC_MAX_NEW_TOKENS} is used by `--long`; fewer here to fit the time)" if n < SPEC_MAX_NEW_TOKENS else ""),
             f"prompts per workload: {plan['prompts'] or 'all'}, repeats: {plan['repeats']}, "
             f"one warm-up generation of {plan['warmup_tokens']} tokens per method (proposer, greedy/sampled) and placement before timing",
             f"specdec draft greedy K: {plan['greedy_ks']} + adaptive + K=0; sampled T {plan['sampled_temps']} at K {plan['sampled_ks']} + adaptive"
             + (f" (sampled rows, specdec and peer, only in {', '.join(f'{p}/{w}' for p, w in plan['sampled_cells'])}; "
                f"`--sampled-everywhere` for all)" if plan["sampled_cells"] else ""),
             f"grounded workload: proposers {plan['proposers']} at K {plan['lookup_ks']} + adaptive; "
             f"peer prompt lookup K {plan['peer_lookup_ks']}"]
    if "template" in plan["workloads"]:
        where = "" if plan["template_placements"] is None else f" ({', '.join(plan['template_placements'])} placement only)"
        lines.append(f"template workload{where}: {plan['template_prompts']} requests in sequence, once (a repeat would find its own "
                     f"earlier outputs); target alone, K=0 and {', '.join(TEMPLATE_PROPOSERS)} at adaptive K; suffix and "
                     "hybrid rows each get a fresh coordinator, so their shared suffix tree starts empty and learns "
                     "only from the row's own earlier requests (open and grounded rows run with the shared tree off: "
                     "other rows and repeats ask the same prompts)")
    extra = {k: v for k, v in plan["extra_args"].items() if v}
    if extra:
        lines.append("extra service flags: " + "; ".join(f"{k} `{shlex.join(v)}`" for k, v in extra.items()))
    if plan["peer_fixed_ks"]:
        lines.append(f"peer assisted generation also at fixed K {plan['peer_fixed_ks']} (confidence early-stop off)")
    return lines


# --- machine / environment ------------------------------------------------------------------------

def machine_info() -> dict:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "?"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "cpus_allowed": len(os.sched_getaffinity(0)), "memory": mem,
            "python": platform.python_version(), "os": platform.platform(), "git": git_commit()}
    try:
        import torch
        import transformers
        info["torch"] = torch.__version__
        info["transformers"] = transformers.__version__
        info["torch_threads_default"] = torch.get_num_threads()
    except ImportError:
        pass
    try:
        import grpc
        info["grpc"] = grpc.__version__
    except ImportError:
        pass
    return info


def gpu_name(device: str = "cuda") -> str:
    """The GPU's name, memory and driver as nvidia-smi reports them (no CUDA context in this process),
    else as torch does; "?" if neither can tell."""
    index = device.split(":", 1)[1] if ":" in device else "0"
    try:
        out = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            name, memory, driver = [x.strip() for x in out.stdout.strip().splitlines()[0].split(",")]
            return f"{name} ({memory}, driver {driver})"
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    try:
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    except Exception:
        return "?"


def git_commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        commit = rev.stdout.strip() or "unknown"
        st = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                            capture_output=True, text=True, timeout=10)
        if st.returncode == 0 and st.stdout.strip():
            commit += " (+ uncommitted changes)"
        return commit if commit != "unknown" else os.environ.get("SPECDEC_GIT_COMMIT", commit)
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("SPECDEC_GIT_COMMIT", "unknown")  # a copy without .git (e.g. on a lent GPU machine)


class CpuMeter:
    """How much CPU other processes used while we ran: /proc/stat busy time minus our own (and our
    children's, once waited for) user + system time."""

    def __init__(self) -> None:
        self.t0 = time.time()
        self.busy0 = self._busy()
        self.ours0 = self._ours()

    @staticmethod
    def _busy() -> float:
        try:
            f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
            return (f[0] + f[1] + f[2] + f[5] + f[6] + (f[7] if len(f) > 7 else 0)) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return float("nan")

    @staticmethod
    def _ours() -> float:
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

    def other_fraction(self) -> float:
        wall = time.time() - self.t0
        other = (self._busy() - self.busy0) - (self._ours() - self.ours0)
        return max(0.0, other) / (wall * (os.cpu_count() or 1)) if wall > 0 else float("nan")


def background_load(seconds: float = 1.0) -> float:
    m = CpuMeter()
    time.sleep(seconds)
    return m.other_fraction()


def wait_idle(max_s: float, what: str) -> float:
    """Wait (up to max_s) until other processes use < 10% of the CPU over 2 s; returns the last reading."""
    deadline = time.time() + max_s
    load = background_load(2.0)
    if load > DISTURBED and max_s > 0:
        log(f"{what}: other processes use {load:.0%} of the CPU; waiting up to {max_s:.0f}s for quiet")
        while load > DISTURBED and time.time() < deadline:
            load = background_load(2.0)
        log(f"{what}: " + ("quiet now" if load <= DISTURBED else f"still {load:.0%} busy; going on anyway"))
    return load


# --- one placement --------------------------------------------------------------------------------

PLACEMENTS = {
    # env / args for the tiers, CPU sets, in-process baseline pinning
    "shared": dict(env={"OMP_WAIT_POLICY": "PASSIVE"}, target_args=[], draft_args=[], affinity=None,
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


def coordinator_flags(row: dict) -> tuple[tuple[str, ...], bool]:
    """(coordinator flags the row needs beyond the main coordinator's, whether it needs a fresh one)."""
    flags = ("--default-proposer", "suffix") if row["proposer"] == "suffix" else ()
    if row["workload"] == "template" and row["proposer"] in ("suffix", "hybrid"):
        return flags + ("--suffix-cache-entries", str(SuffixConfig.cache_entries)), True
    return flags, False


def _repeats(plan: dict, row: dict) -> int:
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
        env=dict(cfg["env"])),
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
                flags, fresh = coordinator_flags(r)
                if fresh or flags != current:
                    client.close()
                    pipeline.restart_coordinator(list(flags))
                    log(f"{placement}: fresh coordinator for {r['key']}" + (f" ({shlex.join(flags)})" if flags else ""))
                    client, current, warmed = Client(pipeline.address, timeout_s=900), flags, set()
                res = run_specdec_row(client, r, prompts[r["workload"]], plan["max_new_tokens"], _repeats(plan, r),
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


# --- checks ---------------------------------------------------------------------------------------

def exactness_checks(rows: list[dict], eos_ids: set[int]) -> list[str]:
    """Greedy outputs must agree: specdec at any K with K=0 (token for token, both ignore EOS), and
    K=0 with target alone up to the first EOS (HF's min_new_tokens masks EOS, the services do not)."""
    by_key = {}
    for r in rows:
        for s in r.get("samples", []):
            by_key[(r["key"], s["prompt_id"], s["repeat"])] = s["token_ids"]
    lines = []
    cells = sorted({(r["placement"], r["workload"]) for r in rows})
    for pl, wl in cells:
        cell = [r for r in rows if r["placement"] == pl and r["workload"] == wl and r.get("samples")]
        k0 = next((r for r in cell if r["method"] == "specdec" and r["k"] == 0), None)
        tgt = next((r for r in cell if r["method"] == "target"), None)
        parts = []
        if k0:
            eq, tot, bad = 0, 0, []
            for r in cell:
                if r["method"] != "specdec" or r["temperature"] != 0 or r["k"] == 0:
                    continue
                for s in r["samples"]:
                    ref = by_key.get((k0["key"], s["prompt_id"], s["repeat"]))
                    if ref is None:
                        continue
                    tot += 1
                    if s["token_ids"] == ref:
                        eq += 1
                    else:
                        n = next((i for i, (x, y) in enumerate(zip(s["token_ids"], ref)) if x != y), min(len(ref), len(s["token_ids"])))
                        bad.append(f"{r['proposer']} K={_k(r['k'])} {s['prompt_id']} (first difference at token {n})")
            if tot:
                parts.append(f"greedy specdec K>0 = K=0 output token for token: {eq}/{tot}" + (f" (differ: {'; '.join(bad[:6])})" if bad else ""))
        if k0 and tgt:
            eq, tot = 0, 0
            for s in k0["samples"]:
                ref = by_key.get((tgt["key"], s["prompt_id"], s["repeat"]))
                if ref is None:
                    continue
                cut = next((i for i, t in enumerate(s["token_ids"]) if t in eos_ids), len(s["token_ids"]))
                tot += 1
                eq += s["token_ids"][:cut] == ref[:cut]
            if tot:
                parts.append(f"K=0 via services = target alone up to the first EOS: {eq}/{tot}")
        if tgt:
            eq, tot = 0, 0
            for r in cell:
                if r["method"] in ("peer", "peer_lookup") and r["temperature"] == 0:
                    for s in r["samples"]:
                        ref = by_key.get((tgt["key"], s["prompt_id"], s["repeat"]))
                        if ref is not None:
                            tot += 1
                            eq += s["token_ids"] == ref
            if tot:
                parts.append(f"HF greedy assisted / prompt lookup = target alone: {eq}/{tot}")
        if parts:
            lines.append(f"- {pl} / {wl}: " + "; ".join(parts))
    return lines


def reading(rows: list[dict], aggs: dict, bounds: list[dict]) -> list[str]:
    """A few data-driven sentences on what the numbers say about the draft model on this machine."""
    out = []
    draft_b = [b for b in bounds if b["proposer"] == "draft"]
    if draft_b:
        best = max(draft_b, key=lambda b: b["bound"])
        a_rng = (min(b["a"] for b in draft_b), max(b["a"] for b in draft_b))
        v_rng = (min(b["v"] for b in draft_b), max(b["v"] for b in draft_b))
        c_rng = (min(b["c"] for b in draft_b), max(b["c"] for b in draft_b))
        verdict = ("so the draft model cannot speed up decoding here even with zero overhead"
                   if best["bound"] < 1.0 else "so a speed-up is possible in principle")
        out.append(f"Reading: with the draft model, greedy per-token acceptance is a = {a_rng[0]:.2f}-{a_rng[1]:.2f}, a draft token "
                   f"costs c = {c_rng[0]:.2f}-{c_rng[1]:.2f} of a target step and one verify v = {v_rng[0]:.2f}-{v_rng[1]:.2f} target steps; "
                   f"the best analytical bound over the fixed K measured is {best['bound']:.2f}x ({best['placement']}/{best['workload']}, "
                   f"K={best['k']}), {verdict}.")
    adaptive = [(r, aggs[r["key"]]) for r in rows if r["method"] == "specdec" and r["proposer"] == "draft"
                and r["k"] is None and r["temperature"] == 0 and aggs[r["key"]].get("n")]
    if adaptive:
        mk = [a.get("mean_k") or 0.0 for _, a in adaptive]
        out.append(f"Adaptive K (draft proposer, greedy) drafted {min(mk):.2f}-{max(mk):.2f} tokens per round on average, "
                   "i.e. it mostly falls back to target-only rounds where drafting does not pay.")
    lk = [b for b in bounds if b["proposer"] in ("lookup", "hybrid")]
    if lk:
        best = max(lk, key=lambda b: b["measured"])
        out.append(f"Prompt lookup needs no model: on the grounded prompts its best fixed-K row reaches {best['measured']:.2f}x "
                   f"the K=0 pipeline ({best['proposer']} K={best['k']}, {best['placement']}).")
    return [" ".join(out)] if out else []


def _k(k) -> str:
    return "adaptive" if k is None else str(k)


# --- main -----------------------------------------------------------------------------------------

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
    meta = next((m for m in baseline_meta.values() if m.get("models")), {})
    eos = set(meta.get("eos_token_ids") or [])

    # --- the markdown section ---
    out_path = Path(args.out)
    plot_dir = Path(args.plot_dir) if args.plot_dir else out_path.parent
    prefix = "bench_gpu_" if plan["device"] != "cpu" else "bench_"  # GPU runs keep the CPU plots
    speed_png, bound_png = plot_dir / f"{prefix}speed_vs_k.png", plot_dir / f"{prefix}bound.png"
    title = (f"{started:%Y-%m-%d %H:%M} UTC, {plan['mode']}, "
             + (f"{info['gpu']}, {plan['dtype']}" if info.get("gpu") else f"{info['cpu']} x{info['cores']}")
             + f", N={plan['max_new_tokens']}")
    made_speed = report.plot_speed_vs_k(all_rows, aggs, plan["placements"], plan["workloads"], speed_png,
                                        plan["max_new_tokens"], f"specdec tokens/s vs K: {title}")
    made_bound = report.plot_bound(bounds, plan["placements"], plan["workloads"], bound_png,
                                   f"measured vs analytical speed-up: {title}")

    L = [f"## {started:%Y-%m-%d %H:%M} UTC: {plan['mode']} run (git {info['git']})", ""]
    L.append(f"Command: `{command}` (wall time {elapsed / 60:.1f} min"
             + (f", of which {waited / 60:.1f} min waiting for other processes to go quiet" if waited > 5 else "") + ")")
    L.append("")
    gpu_used = f"GPU **{info['gpu']}** (`--device {plan['device']}`)" if info.get("gpu") else "no GPU used"
    L.append(f"- Machine: {info['cpu']}, {info['cores']} cores ({info['cpus_allowed']} allowed), {info['memory']} RAM, {gpu_used}; "
             f"Python {info['python']}, torch {info.get('torch')}, transformers {info.get('transformers')}, grpcio {info.get('grpc')}")
    tm, dm = meta.get("models", {}).get("target", {}), meta.get("models", {}).get("draft", {})
    L.append(f"- Models: target `{models['target']}` ({tm.get('arch', '?')}, {tm.get('params', 0) / 1e6:.1f}M params, {tm.get('layers', '?')} layers, {plan['dtype']}); "
             f"draft `{models['draft']}` ({dm.get('arch', '?')}, {dm.get('params', 0) / 1e6:.1f}M params, {dm.get('layers', '?')} layers, {plan['draft_dtype']})"
             + (" (the target's own weights in a lower precision: the self-draft)" if models["draft"] == models["target"] else ""))
    for line in describe_plan(plan):
        L.append(f"- {line[0].upper() + line[1:]}")
    sched = meta.get("peer_default_schedule") or {}
    if sched:
        L.append(f"- Peer default schedule (transformers {meta.get('transformers_version')}): num_assistant_tokens={sched.get('num_assistant_tokens')}, "
                 f"schedule `{sched.get('num_assistant_tokens_schedule')}`, assistant_confidence_threshold={sched.get('assistant_confidence_threshold')} "
                 f"(the draft stops a round early when its top probability falls below it; "
                 + ("adapted per round since scikit-learn is installed)" if sched.get("threshold_adapts") else "fixed: it only adapts when scikit-learn is installed, which it is not)"))
    for pl in plan["placements"]:
        spec, bm = per_placement[pl], baseline_meta.get(pl, {})
        c = PLACEMENTS[pl]
        omp = spec.get("omp_wait_policy") or {}
        omp_txt = ", ".join(f"{k} {v or '(unset)'}" for k, v in omp.items()) or "?"
        desc = (f"- Placement **{pl}**: bench sets tier env {c['env'] or '{}'} (OMP_WAIT_POLICY as the tier processes got it: {omp_txt}), "
                f"target args {c['target_args'] or '[]'}, draft args {c['draft_args'] or '[]'}; "
                f"CPUs allowed per process: {spec.get('cpus') or '?'}; services started in {_fmt_s(spec.get('start_s'))}; "
                f"baselines ran with {bm.get('torch_threads', '?')} torch thread(s) on CPUs {bm.get('cpus', '?')}"
                f"{' and OMP_WAIT_POLICY=' + bm['omp_wait_policy'] if bm.get('omp_wait_policy') else ''}")
        retries = (spec.get("retries") or 0) + (bm.get("retries") or 0)
        if retries:
            desc += f"; {retries} disturbed generation(s) measured again ({(spec.get('retry_spent_s') or 0) + (bm.get('retry_spent_s') or 0):.0f}s spent)"
        if spec.get("error"):
            desc += f"; **pipeline error**: {spec['error']}"
        if bm.get("error"):
            desc += f"; **baseline error**: {bm['error']}"
        L.append(desc)
    samples = [x for r in all_rows for x in r.get("samples", [])]
    disturbed = [x for x in samples if x.get("background_cpu", 0) > DISTURBED]
    L.append(f"- Other processes used {other:.0%} of the machine's CPU during this run; "
             f"{len(disturbed)} of {len(samples)} timed generations ran while other processes used more than {DISTURBED:.0%} of it"
             + (" (**timings disturbed**: such rows are marked in the notes; rerun on an idle machine)" if disturbed or other > 0.05 else ""))
    L.append("")

    L.append("### Summary")
    L.append("")
    L.append("| placement | workload | target alone tok/s | peer greedy tok/s | specdec K=0 tok/s | best specdec greedy tok/s (K) | vs target | vs peer | best fixed K tok/s (K) | grounded: best lookup/hybrid tok/s (vs target, vs peer lookup) |")
    L.append("|---|---|---|---|---|---|---|---|---|---|")
    for cell in summary["cells"]:
        vs_t = _ratio(cell["best"], cell["target"])
        vs_p = _ratio(cell["best"], cell["peer"])
        lk = "–"
        if cell.get("lookup"):
            lk = f"{cell['lookup']:.2f} ({cell['lookup_label']}; {_ratio(cell['lookup'], cell['target'])}, {_ratio(cell['lookup'], cell.get('peer_lookup'))})"
        L.append(f"| {cell['placement']} | {cell['workload']} | {_fmt(cell['target'])} | {_fmt(cell['peer'])} | {_fmt(cell['k0'])} | "
                 f"{_fmt(cell['best'])} ({cell['best_k'] or '–'}) | {vs_t} | {vs_p} | {_fmt(cell['best_fixed'])} ({cell['best_fixed_k'] or '–'}) | {lk} |")
    L.append("")
    if "template" in plan["workloads"]:
        L.append("Template workload (tok/s, median over the requests; x target alone):")
        L.append("")
        L.extend(report.template_table(all_rows, aggs, plan["placements"]))
        L.append("")
    L.append("Goals:")
    L.append("")
    L.extend(report.goal_lines(summary["goals"]))
    L.append("")
    L.extend(reading(all_rows, aggs, bounds))
    L.append("")

    for pl in plan["placements"]:
        for wl in plan["workloads"]:
            rows = [r for r in all_rows if r["placement"] == pl and r["workload"] == wl]
            if not rows:
                continue
            tgt = next((aggs[r["key"]].get("tps") for r in rows if r["method"] == "target"), None)
            ptoks = [aggs[r["key"]].get("prompt_tokens") for r in rows if aggs[r["key"]].get("prompt_tokens")]
            L.append(f"### {pl} / {wl}")
            L.append("")
            L.append(f"Prompts: {', '.join(p.id for p in prompts[wl])} (mean {sum(ptoks) / len(ptoks) if ptoks else 0:.0f} prompt tokens).")
            L.append("")
            L.extend(report.results_table(rows, aggs, tgt))
            L.append("")
            b = [x for x in bounds if x["placement"] == pl and x["workload"] == wl]
            if b:
                L.append(f"Bound vs measured ({pl} / {wl}, greedy, speed-up over specdec K=0):")
                L.append("")
                L.extend(report.bound_table(b))
                L.append("")

    L.append("### Memory")
    L.append("")
    L.append("| placement | process | peak RSS (VmHWM) MiB | threads |")
    L.append("|---|---|---|---|")
    for pl in plan["placements"]:
        for name, mem in (per_placement[pl].get("memory") or {}).items():
            L.append(f"| {pl} | {name} | {mem['peak_rss_kib'] / 1024:.0f} | {mem.get('threads', '?')} |")
        bm = baseline_meta.get(pl, {})
        if bm.get("peak_rss_kib"):
            L.append(f"| {pl} | in-process baselines (target + draft + HF generate) | {bm['peak_rss_kib'] / 1024:.0f} | – |")
    L.append("")
    if meta.get("models"):
        mean_prompt = {}
        for wl in plan["workloads"]:
            vals = [aggs[r["key"]].get("prompt_tokens") for r in all_rows if r["workload"] == wl and r["method"] == "target" and aggs[r["key"]].get("prompt_tokens")]
            if vals:
                mean_prompt[wl] = vals[0]
        hdr = " | ".join(f"KV per session, {wl} (~{mean_prompt[wl]:.0f} + {plan['max_new_tokens']} tokens)" for wl in mean_prompt)
        L.append(f"| model | layers | KV heads | head dim | bytes/elt | KV bytes/token | {hdr} |")
        L.append("|---|---|---|---|---|---|" + "---|" * len(mean_prompt))
        for name in ("target", "draft"):
            m = meta["models"][name]
            per = " | ".join(f"{m['bytes_per_token'] * (mean_prompt[wl] + plan['max_new_tokens']) / 2**20:.2f} MiB" for wl in mean_prompt)
            L.append(f"| {name} | {m['layers']} | {m['kv_heads']} | {m['head_dim']} | {m['dtype_bytes']} | {m['bytes_per_token']:,} | {per} |")
        L.append("")
        L.append("KV bytes/token = 2 (K and V) x layers x KV heads x head dim x bytes per element; a session holds it "
                 "for prompt + generated tokens on each tier (the target also briefly for K rejected drafts).")
        L.append("")

    L.append("### Checks and notes")
    L.append("")
    L.extend(exactness_checks(all_rows, eos))
    for r in all_rows:
        notes = [n for n in report.row_notes(r, aggs[r["key"]]) if not n.startswith("disturbed")]  # those are in the tables
        if r.get("error"):
            notes.append(f"error: {r['error'][:300]}")
        if notes:
            L.append(f"- `{r['key']}`: " + "; ".join(notes))
    L.append("- tok/s for specdec uses the coordinator's elapsed time (request validated to last token); "
             "measured at the client (adds the client-to-coordinator hop and prompt tokenization) the median is: "
             + ", ".join(f"{r['key'].split('/', 2)[2]} ({r['placement']}/{r['workload']}) {aggs[r['key']]['client_tps']:.2f}"
                         for r in all_rows if r["method"] == "specdec" and r["k"] == 0 and aggs[r["key"]].get("n")))
    if made_speed:
        L.append("")
        L.append(f"![tokens/s vs K]({os.path.relpath(speed_png, out_path.parent)})")
    if made_bound:
        L.append("")
        L.append(f"![measured vs bound]({os.path.relpath(bound_png, out_path.parent)})")
    L.append("")
    section = "\n".join(L) + "\n"

    out_path.parent.mkdir(parents=True, exist_ok=True)
    existing = out_path.read_text() if out_path.exists() else ""
    if not existing.strip():
        existing = report.HEADER
    out_path.write_text(existing.rstrip("\n") + "\n\n" + section)
    if args.json:
        Path(args.json).write_text(json.dumps({"plan": plan, "machine": info, "rows": all_rows, "aggregates": aggs,
                                               "bounds": bounds, "placements": per_placement, "baselines": baseline_meta},
                                              default=str))
    print(section)
    log(f"done in {elapsed / 60:.1f} min; appended to {out_path}" + (f", plots in {plot_dir}" if made_speed else ""))
    return 0


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def _fmt_s(x) -> str:
    return "?" if x is None else f"{x:.1f}s"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "–"


if __name__ == "__main__":
    sys.exit(main())
