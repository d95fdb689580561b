"""bench.draft_vocab on the tiny model as its own draft: a row per vocabulary, the whole one covering every answer
token and the draft's own copy agreeing with the target nearly everywhere, `auto` scoring a third of the ids."""

from __future__ import annotations

import re

from bench.draft_vocab import main


def test_the_bench_reports_each_vocabulary(tiny_target, tmp_path):
    out = tmp_path / "log.md"
    assert main(["--target", tiny_target, "--draft", tiny_target, "--vocabs", "0,auto", "--prompts", "1",
                 "--max-new-tokens", "8", "--repeats", "3", "--out", str(out)]) == 0
    text = out.read_text()
    number = r"([\d.]+)"
    rows = {m.group(1): m.groups()[1:] for m in re.finditer(
        rf"^\| (0|auto) \| (\d+) \| {number} \| {number} \| {number} / {number} \| {number} / {number} \| "
        rf"{number} / {number} \| {number} \| {number} \| {number}x \|$",
        text, re.M)}
    assert set(rows) == {"0", "auto"}, text
    assert rows["0"][0] == "49152" and rows["auto"][0] == "16384"
    assert rows["0"][7:9] == ("1.000", "1.000")  # the whole vocabulary holds every answer token
    assert float(rows["0"][1]) >= 0.5  # its own Q8_0 copy as the draft (a random model: few near-ties flip)
    assert all(float(a) > 0.9 for a in rows["0"][3:7])  # sampling, p and its Q8_0 copy's q nearly coincide
    assert float(rows["auto"][7]) < 1.0 or float(rows["auto"][8]) < 1.0  # a random model's tokens spread over all ids
    assert all(float(a) < float(b) for a, b in zip(rows["auto"][3:7], rows["0"][3:7]))  # q = 0 on two thirds of p
