"""bench.seeded end to end on the tiny model (real services as their own processes, the Python client): its table, and
its count of prompts whose seeded output was one at K = 0, a fixed K and the default, which must be every prompt."""

from __future__ import annotations

import re

import pytest

from bench.seeded import main

pytestmark = pytest.mark.processes  # LocalPipeline: the services as their own processes


def test_the_bench_reports_both_kinds_and_one_output_per_seed(tiny_target, tmp_path):
    out = tmp_path / "log.md"
    assert main(["--target", tiny_target, "--draft", tiny_target, "--repeats", "1", "--prompts", "2", "--burst", "2",
                 "--max-new-tokens", "12", "--out", str(out)]) == 0
    text = out.read_text()
    assert re.search(r"^\| one client, the default request \(tok/s\) \| [\d.]+ \| [\d.]+ \|$", text, re.M), text
    acceptance = re.search(r"^\| its acceptance \(K = 2\) \| ([\d.]+) \| ([\d.]+) \|$", text, re.M)
    # The self-draft races the target's keys: accepted often although the tiny model's distributions are flat (with
    # keys of its own a draft would meet the target's token about as often as two draws from ~7,000 tokens agree)
    assert acceptance is not None and float(acceptance.group(1)) > 0.1
    assert "**2/2** prompts in every seeded row" in text
