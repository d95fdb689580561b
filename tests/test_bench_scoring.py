"""bench.scoring end to end on the tiny model (a real `specdec serve`, the official client, the peer): its table and
its exactness line, which fails the bench's reader if the served scores were not the reference's."""

from __future__ import annotations

import re

import pytest

from bench.scoring import main, windows
from specdec.models import load_tokenizer

pytestmark = pytest.mark.processes  # `specdec serve` as its own processes


def test_windows_are_distinct_and_as_long_as_asked(tiny_target):
    got = windows(load_tokenizer(tiny_target), 300, 4)
    assert [len(w) for w in got] == [300] * 4 and len({tuple(w[:8]) for w in got}) == 4


def test_the_bench_reports_both_kinds_the_peer_and_the_served_scores_exact(tiny_target, tmp_path):
    out = tmp_path / "log.md"
    assert main(["--lengths", "40", "--requests", "2", "--out", str(out),
                 "--serve-args", f"--target-model {tiny_target} --draft-model {tiny_target}"]) == 0
    text = out.read_text()
    row = re.search(r"^\| 40 \| (\d+) \| (\d+) \| ([+-]\d+) \| (\d+) \| (\d+) \|$", text, re.M)
    assert row is not None, text
    worst = float(re.search(r"largest difference \*\*([0-9.e+-]+)\*\*", text).group(1))
    assert worst < 1e-3
