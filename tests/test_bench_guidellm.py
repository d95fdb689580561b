"""bench.guidellm_sweep's scenario and its reading of guidellm's report (the sweep itself is timed, not tested)."""

from __future__ import annotations

from pathlib import Path

from bench.guidellm_sweep import ROW_BODY, chat_files, main, scenario, summarise


def test_the_k0_row_asks_every_request_for_k_0_and_the_default_row_adds_nothing(tmp_path):
    for row, extras in (("k0", {"body": {"num_speculative_tokens": 0}}), ("specdec", None)):
        spec = scenario("http://127.0.0.1:8000", ROW_BODY[row], 4, 30.0, 128, 64, "/models/draft", tmp_path / "r.json",
                        seed=2)
        backend = spec["spec"]["backend"]
        assert backend["target"] == "http://127.0.0.1:8000" and backend["request_format"] == "/v1/chat/completions"
        assert backend.get("extras") == extras
        assert spec["spec"]["profile"] == {"kind": "concurrent", "streams": 4}
        assert spec["spec"]["data"] == [{"kind": "synthetic_text", "prompt_tokens": 128, "output_tokens": 64}]
        assert spec["spec"]["seed"] == {"kind": "static", "value": 2}
        assert spec["spec"]["constraints"] == [{"kind": "max_duration", "seconds": 30.0}]
        assert spec["spec"]["outputs"] == [{"kind": "json", "path": str(tmp_path / "r.json")}]


def test_each_level_gets_chat_requests_no_other_level_sends_answered_up_to_the_budget(tmp_path):
    import json

    from specdec.training.prompts import chat_prompts

    files = chat_files(tmp_path, 3, chat_prompts())
    levels = [[json.loads(line)["prompt"] for line in f.read_text().splitlines()] for f in files]
    assert [len(x) for x in levels] == [210, 210, 210] and all(p for x in levels for p in x)
    assert len({p for x in levels for p in x}) == 630  # distinct, within and across the levels
    spec = scenario("http://h:1", {}, 1, 5.0, 128, 64, "/t", tmp_path / "r.json", files[0])
    assert spec["spec"]["data"] == [{"kind": "json_file", "path": str(files[0])}]
    assert spec["spec"]["backend"]["max_tokens"] == 64 and "extras" not in spec["spec"]["backend"]


def _distribution(median: float, mean: float, p95: float) -> dict:
    return {"successful": {"median": median, "mean": mean, "percentiles": {"p95": p95}}}


def test_the_table_reads_each_levels_streams_and_figures():
    def bench(streams: int, tps: float) -> dict:
        return {"config": {"strategy": {"streams": streams}},
                "metrics": {"request_totals": {"successful": 9, "errored": 1},
                            "output_tokens_per_second": _distribution(50.0, tps, 90.0),
                            "time_to_first_token_ms": _distribution(300.0, 310.0, 900.0),
                            "inter_token_latency_ms": _distribution(12.5, 13.0, 40.0),
                            "request_latency": _distribution(1.5, 1.6, 3.0)}}

    rows = summarise({"benchmarks": [bench(1, 51.2), bench(4, 80.0)]})
    assert [r["streams"] for r in rows] == [1, 4] and [r["output_tps"] for r in rows] == [51.2, 80.0]
    assert rows[0] == {"streams": 1, "requests": 9, "errored": 1, "output_tps": 51.2, "ttft_p50": 300.0,
                       "ttft_p95": 900.0, "itl_p50": 12.5, "latency_p50": 1.5}


def test_without_guidellm_the_sweep_says_how_to_install_it(tmp_path, capsys):
    assert main(["--guidellm", str(tmp_path / "none" / "guidellm"), "--out", ""]) == 2
    assert "make guidellm" in capsys.readouterr().err
    assert not Path(tmp_path / "none").exists()


def test_the_plot_draws_both_rows(tmp_path):
    from bench.guidellm_sweep import plot

    rows = lambda tps: [{"streams": s, "output_tps": tps * s, "ttft_p50": 100.0 * s} for s in (1, 4, 16)]  # noqa: E731
    path = tmp_path / "g.png"
    assert plot({"specdec": rows(50.0), "k0": rows(45.0)}, path, "t") and path.stat().st_size > 1000
