"""The benchmarks' run logs: each bench appends its section to the month's log, docs/bench-logs/YYYY-MM.md
(docs/BENCHMARKS.md holds the current figures, each citing its section there)."""

from __future__ import annotations

import calendar
import re
from pathlib import Path

from bench.common import BENCH_LOGS, REPO, append_section, bench_log, plot_dir

ROOT = Path(__file__).resolve().parent.parent


def test_sections_go_to_the_months_log(tmp_path):
    assert bench_log(calendar.timegm((2026, 12, 1, 0, 0, 0))) == BENCH_LOGS / "2026-12.md"
    assert bench_log(calendar.timegm((2026, 11, 30, 23, 59, 0))) == REPO / "docs" / "bench-logs" / "2026-11.md"
    log = tmp_path / "2027-01.md"
    append_section("## first\n\nrow", log)
    append_section("## second", log)
    text = log.read_text()
    assert text.startswith("# Benchmark runs, 2027-01\n") and "BENCHMARKS.md" in text.split("##")[0]
    assert text.index("## first") < text.index("## second") and text.endswith("## second\n")
    assert plot_dir(BENCH_LOGS / "2026-11.md") == REPO / "docs" and plot_dir(tmp_path / "x.md") == tmp_path


def test_the_figures_page_cites_sections_that_exist():
    """Every `bench-logs/<month>.md` section BENCHMARKS.md cites (by its date and time) is in that log."""
    page = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    cites = re.findall(r"\[(\d{4}-\d{2}-\d{2} \d{2}:\d{2})\]\(bench-logs/(\d{4}-\d{2})\.md\)", page)
    assert len(cites) >= 10
    for when, month in cites:
        assert f"## {when} UTC" in (ROOT / "docs" / "bench-logs" / f"{month}.md").read_text(), when


def test_head_cost_runs_on_a_tiny_target(tiny_target, capsys):
    """bench.head_cost end to end on the tiny target (its figures are not checked: a test never times anything)."""
    from bench.head_cost import main

    assert main(["--target", tiny_target, "--out", "", "--repeats", "1", "--tokens", "1,3", "--curve-s", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "| 3 |" in out and "step with the taps" in out and "| 1 |" in out


def test_prefill_cost_runs_on_a_tiny_target(tiny_target, capsys):
    """bench.prefill_cost end to end on the tiny target, a prompt longer than one chunk (figures not checked)."""
    from bench.prefill_cost import main

    assert main(["--target", tiny_target, "--out", "", "--repeats", "1", "--lengths", "70", "--chunk-tokens", "40"]) == 0
    assert "| 70 |" in capsys.readouterr().out


def test_grpc_floor_runs_against_a_server_process(capsys):
    """bench.grpc_floor end to end: an echo server in a child process, its three round trips measured (not checked)."""
    from bench.grpc_floor import main

    assert main(["--n", "20", "--runs", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"unary call \d+ us, a write and a read on an open stream \d+ us back to back, \d+ us after 3 ms idle",
                     out), out


def test_quant_formats_runs_every_format_and_writes_a_model(tmp_path, capsys):
    """bench.quant_formats end to end at small shapes (figures not checked), and the random GGUF it writes for
    bench.step_cost loads in its blocks."""
    from bench.quant_formats import main
    from specdec.engine import gguf_weights
    from specdec.engine.quant_gemm import QuantLinear

    assert main(["--hidden", "256", "--kv", "64", "--ffn", "512", "--repeats", "1", "--out", ""]) == 0
    out = capsys.readouterr().out
    assert all(f"| {fmt} |" in out for fmt in ("float32", "Q8_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M")), out
    path = tmp_path / "m.gguf"
    assert main(["--write-gguf", str(path), "--format", "Q4_K_M", "--hidden", "256", "--ffn", "512", "--kv", "128",
                 "--layers", "1", "--heads", "4"]) == 0
    model = gguf_weights.load_blocks(path)
    assert {m.fmt.name for m in model.modules() if isinstance(m, QuantLinear)} == {"Q4_K", "Q6_K"}
