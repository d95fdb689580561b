"""`make gpu-check`'s plan, checked without running its heavy parts: every part is a real command of a bench
of this repository whose own argument parser accepts the arguments the plan gives it, the CUDA test files
exist, and the GPU plan fits the 8 minutes it promises. (The GPU run itself needs a GPU; see docs/testing.md.)"""

from __future__ import annotations

import importlib

import pytest

from bench import gpu_check


@pytest.mark.parametrize("smoke", [False, True])
def test_every_part_is_a_valid_bench_command(tmp_path, smoke):
    out = str(tmp_path / "BENCHMARKS.md")
    parts = gpu_check.plan("cpu" if smoke else "cuda", "float32" if smoke else "bfloat16", out, smoke=smoke)
    assert [p.name for p in parts] == ["cuda-tests", "exactness", "step-cost", "workloads", "concurrency"]
    for part in parts:
        if part.module == "pytest":
            files = [a for a in part.args if a.startswith("tests/")]
            assert files and all((gpu_check.REPO / f.split("::")[0]).is_file() for f in files)
            assert part.env["SPECDEC_TEST_DEVICE"] == ("cpu" if smoke else "cuda")
            continue
        args = importlib.import_module(part.module).parse_args(list(part.args))  # SystemExit on a bad argument
        assert args.out == out and args.device == ("cpu" if smoke else "cuda")
    if not smoke:
        assert sum(p.budget_s for p in parts) <= gpu_check.TOTAL_BUDGET_S
        assert set(gpu_check.CUDA_TESTS) >= {"tests/test_triton_row_ops.py", "tests/test_triton_fallback.py"}


def test_the_parts_outside_the_plan_are_valid_and_run_only_when_named(capsys, tmp_path):
    out = str(tmp_path / "BENCHMARKS.md")
    tests, head, overhead, inline, shaped, shaped_inline = gpu_check.extras("cuda", "bfloat16", out)
    assert tests.env == {"SPECDEC_TEST_DEVICE": "cuda"} and all((gpu_check.REPO / f).is_file() for f in gpu_check.CUDA_TESTS_EXTRA)
    args = importlib.import_module(head.module).parse_args(list(head.args))
    assert args.out == out and args.device == "cuda" and args.random_weights
    assert (gpu_check.REPO / "bench/shapes/llama-3-8b/config.json").is_file()
    args = importlib.import_module(overhead.module).parse_args(list(overhead.args))
    assert args.out == out and args.own_rounds and args.target_args == args.draft_args == "--device cuda"
    args = importlib.import_module(inline.module).parse_args(list(inline.args))
    assert args.target_args == args.draft_args == "--device cuda --inline-steps on"
    args = importlib.import_module(shaped.module).parse_args(list(shaped.args))
    assert args.shapes.endswith("llama-3-8b") and args.target_args == "--device cuda --dtype bfloat16"
    args = importlib.import_module(shaped_inline.module).parse_args(list(shaped_inline.args))
    assert args.shapes.endswith("llama-3-8b") and args.draft_args == "--device cuda --dtype bfloat16 --inline-steps on"
    assert gpu_check.main(["--dry-run", "--out", out]) == 0
    printed = capsys.readouterr().out
    assert "head-cost-8b" not in printed and "overhead" not in printed
    assert gpu_check.main(["--dry-run", "--only", "head-cost-8b,exactness", "--out", out]) == 0
    assert [line.split(" ")[0] for line in capsys.readouterr().out.splitlines()] == ["exactness", "head-cost-8b"]


def test_dry_run_prints_the_plan(capsys, tmp_path):
    assert gpu_check.main(["--cpu-smoke", "--dry-run", "--out", str(tmp_path / "b.md")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5 and lines[1].startswith("exactness (300s): -m bench.exactness --device cpu")
    assert not (tmp_path / "b.md").exists()  # a dry run writes nothing


def test_a_part_keeps_the_callers_python_path(tmp_path, monkeypatch):
    """Packages installed beside the image's (pip --target, on PYTHONPATH) stay importable in every part."""
    (tmp_path / "pp_probe.py").write_text("import bench.gpu_check\n")  # needs both the caller's path and the repo
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    status, _ = gpu_check.run_part(gpu_check.Part("probe", "pp_probe", (), 60))
    assert status == "ok"


def test_preflight_names_what_would_stop_the_check(monkeypatch, tmp_path):
    """Ready here (every package of the parts, the models, the CPU); a package that does not import is named
    with the distribution to install, and a missing model directory stops main() before any part runs."""
    assert gpu_check.preflight("cpu") == []
    problems = gpu_check.preflight("cpu", needed=(("no_such_module_xyz", "no-such-dist"),))
    assert len(problems) == 1 and problems[0].startswith("no-such-dist: import no_such_module_xyz failed")
    monkeypatch.setenv("SPECDEC_MODELS_DIR", str(tmp_path / "absent"))
    out = tmp_path / "b.md"
    assert gpu_check.main(["--cpu-smoke", "--out", str(out)]) == 2
    assert not out.exists()  # nothing ran, nothing written
