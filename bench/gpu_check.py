"""`make gpu-check`: on a bare GPU machine with the repository and the model pair (no network), one command
that checks and measures the GPU path in under 8 minutes, each part within its own time budget:

    cuda-tests    the CUDA test files with SPECDEC_TEST_DEVICE=cuda (docs/testing.md), the Triton fallback too
    exactness     the real pair's greedy identity and argmax-flip counts on the GPU (bench.exactness)
    step-cost     the target's step in the served mode by batch, and its in-process K = 0 loop (bench.step_cost)
    workloads     the open / grounded / template workloads, K = 0 and the target alone at its best
                  (static cache + torch.compile `generate`) in the same run (bench.run)
    concurrency   1 and 32 clients (bench.concurrency)

The parts run one after another as the benches' own commands (python -m bench.X) with short settings; each
bench appends its section to --out as it always does, and this appends a dated summary (each part's
status and time) after them. A part over its budget is stopped and reported, and the next one runs.
--cpu-smoke runs the same plan on the CPU with tiny settings, to check the plan itself anywhere;
--dry-run prints the plan. `--only head-cost-8b` runs a part outside the plan: a feature draft's costs at an 8B
target's shapes (random weights); `--only overhead` another: the tiny pair's round tax on the GPU (`--only overhead-inline`: with inline steps); `--only
overhead-8b` an 8B-shaped target's round against its forwards (random weights, its own draft; `--only
overhead-8b-inline`: with inline steps, whose event-loop step lasts an 8B forward). Run it wherever a GPU is available (its first runs, on an H200 on 2026-11-27, are in
docs/bench-logs/2026-11.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import append_section, bench_log, md_table

REPO = Path(__file__).resolve().parent.parent
# The test files that run on a CUDA device (docs/testing.md lists the H100 run of 2026-11-25).
CUDA_TESTS = ("tests/test_triton_attention.py", "tests/test_triton_row_ops.py", "tests/test_runner.py",
              "tests/test_draft_chain.py", "tests/test_step_program.py", "tests/test_batched_verify.py",
              "tests/test_tree_engine.py", "tests/test_feature_taps.py", "tests/test_triton_fallback.py",
              "tests/test_run_on.py::test_one_request_that_runs_on_is_the_target_only_rounds_it_replaces",
              "tests/test_run_on.py::test_run_on_stops_after_eos_and_at_the_end_of_the_context",
              "tests/test_head_engine.py", "tests/test_draft_vocab_head.py")
# Test files that follow SPECDEC_TEST_DEVICE but have not yet run on a GPU (prompt scoring, the keyed race): outside
# the 8 minutes (`--only cuda-tests-extra`; 44 s on the Xeon's CPU), until a GPU run has seen them pass.
CUDA_TESTS_EXTRA = ("tests/test_prompt_logprobs.py", "tests/test_race.py")
TOTAL_BUDGET_S = 480  # the whole check: under 8 minutes


@dataclass(frozen=True)
class Part:
    name: str
    module: str  # python -m <module>
    args: tuple[str, ...]
    budget_s: float  # stopped after this long
    env: dict[str, str] = field(default_factory=dict)

    def command(self) -> list[str]:
        return [sys.executable, "-m", self.module, *self.args]


def plan(device: str, dtype: str, out: str, smoke: bool = False) -> list[Part]:
    """The parts, with short settings (smoke: tiny ones, for a CPU)."""
    out_args = ("--out", out)
    if smoke:
        return [
            Part("cuda-tests", "pytest", ("-q", "-x", "tests/test_triton_fallback.py"), 120, {"SPECDEC_TEST_DEVICE": device}),
            Part("exactness", "bench.exactness", ("--device", device, "--dtypes", dtype, "--tokens", "8", "--prompts", "1",
                                                  "--ks", "1", "--modes", "eager", *out_args), 300),
            Part("step-cost", "bench.step_cost", ("--device", device, "--dtype", dtype, "--modes", "eager", "--repeats", "1",
                                                  "--decode-tokens", "0", "--draft", "", *out_args), 300),
            Part("workloads", "bench.run", ("--device", device, "--dtype", dtype, "--smoke", "--workloads", "open",
                                            "--no-sampled", "--no-peer", "--no-target-compiled", "--proposers", "",
                                            "--wait-idle", "0", *out_args), 300),
            Part("concurrency", "bench.concurrency", ("--device", device, "--levels", "1", "--repeats", "1",
                                                      "--max-new-tokens", "8", "--rows", "k0",
                                                      "--plot", str(Path(out).parent / "bench_concurrency_smoke.png"), *out_args), 300),
        ]
    # Budgets from the H100 runs (2026-11-26, twice: cuda-tests 67 / 88 s; exactness over 80 s at 4 prompts, its
    # float32 half 46 s; step-cost ~75 / 66 s; workloads 150 s at the settings below; concurrency 30 s; 2026-11-27:
    # cuda-tests 80 s, exactness stopped at 105 s with 3 prompts (its bfloat16 half alone 54 s), workloads 130 s,
    # concurrency 30 s before its untimed warm bursts; 2026-11-27 on an H200: cuda-tests 100 s, step-cost stopped at
    # 75 s in two modes of both models, so it now measures the served mode of the target alone: its cuda-graphs step
    # and its in-process K = 0 loop, 71 s; 2026-11-28: cuda-tests 78 s before the run-on chain's and the head
    # engine's tests joined them, workloads given 10 s of its margin for them; 2026-11-29: the tests stopped at 120 s,
    # the head engine's then building the CPU kernels (its head had loaded on the CPU: fixed), and the
    # draft-vocabulary tests joined them (17 s), so 20 s more from exactness's and the workloads' margins), so that
    # the budgets sum to TOTAL_BUDGET_S.
    return [
        # a test still running after 45 s has every thread's stack printed (a hang shows where it waits)
        Part("cuda-tests", "pytest", ("-q", "-o", "faulthandler_timeout=45", *CUDA_TESTS), 140,
             {"SPECDEC_TEST_DEVICE": device}),
        Part("exactness", "bench.exactness", ("--device", device, "--dtypes", f"float32,{dtype}", "--tokens", "64",
                                              "--prompts", "2", "--ks", "1,3", *out_args), 90),
        Part("step-cost", "bench.step_cost", ("--device", device, "--dtype", dtype, "--quick", "--decode-tokens", "32",
                                              "--modes", "cuda-graphs", "--draft", "", *out_args), 75),
        Part("workloads", "bench.run", ("--device", device, "--dtype", dtype, "--workloads", "open,grounded,template",
                                        "--prompts", "2", "--template-prompts", "2", "--repeats", "1",
                                        "--max-new-tokens", "64", "--ks", "2,4", "--no-sampled", "--no-peer",
                                        "--draft-trees", "0", "--speculate", "0", "--wait-idle", "0", *out_args), 125),
        Part("concurrency", "bench.concurrency", ("--device", device, "--dtype", dtype, "--levels", "1,32", "--repeats", "1",
                                                  "--max-new-tokens", "64", "--rows", "specdec,k0", *out_args), 45),
    ]


def extras(device: str, dtype: str, out: str) -> list[Part]:
    """Parts outside the 8-minute plan, run when --only names them: the CUDA tests not yet seen on a GPU
    (CUDA_TESTS_EXTRA); a feature draft's costs at an 8B target's
    shapes (random weights: the head's draft step at 1-64 sessions, the target's step with and without the
    taps; docs/DESIGN.md, Feature drafts), the figure the EAGLE-3 issue asks of a GPU; and the round tax of the
    tiny pair with both tiers on the GPU, direct rounds against the coordinator's own in one run (74 s on an
    H200), and the same with both tiers stepping a lone session on their event loops (`--inline-steps on`, which
    `auto` leaves off on CUDA until measured); and an 8B-shaped target's round (random weights, its own draft)
    against its forwards, also with inline steps."""
    return [Part("cuda-tests-extra", "pytest", ("-q", "-o", "faulthandler_timeout=45", *CUDA_TESTS_EXTRA), 150,
                 {"SPECDEC_TEST_DEVICE": device}),
            Part("head-cost-8b", "bench.head_cost", ("--random-weights", "--target", str(REPO / "bench/shapes/llama-3-8b"),
                                                     "--device", device, "--dtype", dtype, "--repeats", "10",
                                                     "--curve-s", "5", "--out", out), 150),
            Part("overhead", "bench.overhead", ("--ks", "0,2", "--generations", "8", "--own-rounds",
                                                f"--target-args=--device {device}", f"--draft-args=--device {device}",
                                                "--out", out), 150),
            Part("overhead-inline", "bench.overhead", ("--ks", "0,2", "--generations", "8",
                                                       f"--target-args=--device {device} --inline-steps on",
                                                       f"--draft-args=--device {device} --inline-steps on",
                                                       "--out", out), 150),
            Part("overhead-8b", "bench.overhead", ("--shapes", str(REPO / "bench/shapes/llama-3-8b"), "--ks", "0,2",
                                                   "--generations", "4", "--max-new-tokens", "128",
                                                   f"--target-args=--device {device} --dtype {dtype}",
                                                   f"--draft-args=--device {device} --dtype {dtype}", "--out", out), 300),
            Part("overhead-8b-inline", "bench.overhead", ("--shapes", str(REPO / "bench/shapes/llama-3-8b"), "--ks", "0,2",
                                                          "--generations", "4", "--max-new-tokens", "128",
                                                          f"--target-args=--device {device} --dtype {dtype} --inline-steps on",
                                                          f"--draft-args=--device {device} --dtype {dtype} --inline-steps on",
                                                          "--out", out), 300)]


# What the parts import beyond torch (module, the distribution pip installs it from): a machine's image may lack
# any of them (the first H100 run failed at import twice), so the check names them all before it starts.
NEEDED = (("grpc", "grpcio"), ("grpc_health", "grpcio-health-checking"), ("grpc_reflection", "grpcio-reflection"),
          ("google.protobuf", "protobuf"), ("transformers", "transformers"), ("gguf", "gguf"),
          ("fastapi", "fastapi"), ("uvicorn", "uvicorn"), ("llguidance", "llguidance"), ("openai", "openai"),
          ("opentelemetry.sdk", "opentelemetry-sdk"), ("prometheus_client", "prometheus-client"),
          ("uvloop", "uvloop"), ("pytest", "pytest"), ("matplotlib", "matplotlib"), ("asyncio_throttle", "asyncio-throttle"))
# The services' entry points, imported whole: a package none of the names above covers (a dependency's own
# dependency, say) stops the check here rather than in a part (the second H100 run met two such).
ENTRY_POINTS = ("target_service.__main__", "draft_service.__main__", "coordinator.__main__")


def preflight(device: str, needed=NEEDED) -> list[str]:
    """What stops the check before it starts: packages that do not import (each with the error), the
    generated gRPC modules, the model pair's directory, the device. Empty: ready."""
    import importlib

    problems = []
    for module, dist in needed:
        try:
            importlib.import_module(module)
        except Exception as e:  # an import that fails for any reason (missing, a version clash) is named
            problems.append(f"{dist}: import {module} failed ({type(e).__name__}: {e})")
    try:
        importlib.import_module("specdec.proto.generate_pb2_grpc")
    except Exception as e:
        problems.append(f"the generated gRPC modules (make proto): {type(e).__name__}: {e}")
    else:
        for module in ENTRY_POINTS if not problems else ():
            try:
                importlib.import_module(module)
            except Exception as e:
                problems.append(f"{module}: {type(e).__name__}: {e}")
    from specdec.models import models_dir

    if not models_dir().is_dir():
        problems.append(f"the model pair: {models_dir()} is not a directory (set SPECDEC_MODELS_DIR)")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            problems.append(f"--device {device}: torch {torch.__version__} sees no CUDA device")
    return problems


def run_part(part: Part) -> tuple[str, float]:
    """(status, seconds): ok, failed (exit code), or stopped at its budget."""
    t0 = time.monotonic()
    print(f"gpu-check: {part.name}: {' '.join(part.command()[1:])} (budget {part.budget_s:.0f}s)", file=sys.stderr, flush=True)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, **part.env}
    try:
        rc = subprocess.run(part.command(), cwd=REPO, env=env, timeout=part.budget_s).returncode
    except subprocess.TimeoutExpired:
        return f"stopped at its {part.budget_s:.0f}s budget", time.monotonic() - t0
    return ("ok" if rc == 0 else f"failed (exit {rc})"), time.monotonic() - t0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="the GPU to check (cuda, cuda:1, ...)")
    p.add_argument("--dtype", default="bfloat16", help="the target's dtype besides float32")
    p.add_argument("--out", default=str(bench_log()), help="markdown file every part appends to (the month's run log)")
    p.add_argument("--cpu-smoke", action="store_true", help="the same plan on the CPU with tiny settings (checks the plan)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    p.add_argument("--only", default="", help="comma list of parts to run (default: the plan's; cuda-tests-extra, head-cost-8b, overhead, overhead-inline, overhead-8b, overhead-8b-inline only so)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device, dtype = ("cpu", "float32") if args.cpu_smoke else (args.device, args.dtype)
    only = [name for name in args.only.split(",") if name]
    parts = [p for p in plan(device, dtype, args.out, smoke=args.cpu_smoke) if not only or p.name in only]
    parts += [p for p in extras(device, dtype, args.out) if p.name in only]
    if args.dry_run:
        for part in parts:
            print(f"{part.name} ({part.budget_s:.0f}s): {' '.join(part.command()[1:])}")
        return 0
    problems = preflight(device)
    if problems:
        print("gpu-check: not started; fix these first:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = []
    for part in parts:
        status, seconds = run_part(part)
        rows.append((part.name, status, f"{seconds:.0f}", f"{part.budget_s:.0f}"))
    what = "CPU smoke run of the plan (not a GPU measurement)" if args.cpu_smoke else f"{device}, target in float32 and {dtype}"
    section = [f"## GPU check, {started}", "", f"`python -m bench.gpu_check` ({what}); each part's own section is above.",
               "", *md_table(["part", "status", "s", "budget s"], rows)]
    append_section("\n".join(section), args.out)
    print("\n".join(section))
    return 0 if all(r[1] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
