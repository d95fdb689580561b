"""`specdec bench-client` as a user runs it (a subprocess) against a running coordinator."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specdec.client.bench import percentile

pytestmark = pytest.mark.processes


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdec.client.cli", *args], capture_output=True, text=True, timeout=120)


def test_bench_client_summary(random_draft_cluster):
    address = random_draft_cluster.address
    run = run_cli("bench-client", "--address", address, "-n", "6", "-c", "3", "--max-new-tokens", "8", "-k", "2", "--json")
    assert run.returncode == 0, run.stderr
    s = json.loads(run.stdout)
    assert (s["requests"], s["succeeded"], s["failed"], s["concurrency"]) == (6, 6, 0, 3)
    assert s["output_tokens"] == 6 * 8  # EOS is ignored by default: every request is full length
    assert s["output_tokens_per_s"] > 0 and s["requests_per_s"] > 0
    for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
        assert 0 < s[key]["p50"] <= s[key]["p99"], key
    assert s["ttft_s"]["p99"] <= s["e2e_s"]["p99"]
    assert "6/6 requests, 0 failed" in run.stderr  # the progress line

    table = run_cli("bench-client", "--address", address, "-n", "2", "-c", "2", "--max-new-tokens", "4")
    assert table.returncode == 0, table.stderr
    assert "inter-token latency (ms)" in table.stdout and "p99" in table.stdout

    bad = run_cli("bench-client", "--address", address, "-n", "2", "--max-new-tokens", "0")
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stdout


def test_percentile():
    assert percentile([], 50) == 0.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0


def test_the_cli_prints_no_acceptance_rate_where_nothing_was_drafted():
    from specdec.client.cli import format_stats

    none = format_stats({"generated_tokens": 12, "draft_tokens": 0, "accepted_tokens": 0, "acceptance_rate": 0.0})
    assert "acceptance rate" in none and "nothing drafted" in none and "0.000" not in none.split("acceptance rate")[1].split("\n")[0]
    some = format_stats({"draft_tokens": 8, "accepted_tokens": 0, "acceptance_rate": 0.0})
    assert [line.split()[-1] for line in some.splitlines() if "acceptance rate" in line] == ["0.000"]
