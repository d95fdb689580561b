"""bench.overhead's model of given shapes and the goal it is measured against (the bench itself is timed, not tested)."""

from __future__ import annotations

import json

import pytest

from transformers import AutoConfig, AutoTokenizer

from bench.overhead import outside_goals, parse_args, shaped_model
from specdec.models import default_draft


def test_a_shaped_model_has_the_shapes_and_the_real_tokenizer(tmp_path):
    shapes = tmp_path / "shapes"
    shapes.mkdir()
    (shapes / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 128256, "bos_token_id": 128000, "eos_token_id": 128001, "tie_word_embeddings": False}))
    path, what = shaped_model(tmp_path / "model", str(shapes), "bfloat16")
    config = AutoConfig.from_pretrained(path)
    vocab = len(AutoTokenizer.from_pretrained(default_draft()))
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (64, 3, 2)
    assert config.vocab_size == vocab and config.eos_token_id == [2] and str(config.dtype).endswith("bfloat16")
    assert len(AutoTokenizer.from_pretrained(path)) == vocab
    assert "3 layers" in what and f"{vocab:,} tokens for its 128,256" in what


def test_the_shaped_goal_is_the_rounds_time_outside_its_forwards():
    rows = {0: [{"client_round": 10.5, "compute": 10.0}] * 3, 2: [{"client_round": 13.0, "compute": 10.0}]}
    said = outside_goals(rows, shaped=True)
    assert "K = 0: 0.50 ms outside the forwards a round, 5.0% of them (met)" in said
    assert "K = 2: 3.00 ms outside the forwards a round, 30.0% of them (not met)" in said


def test_the_pair_goal_is_the_share_of_the_clients_round_outside_the_forwards():
    rows = {0: [{"client_round": 40.0, "compute": 38.4}] * 3, 2: [{"client_round": 20.0, "compute": 17.0}]}
    said = outside_goals(rows)
    assert "K = 0: 1.60 ms of a 40.00 ms round outside the forwards, 4.0% (met)" in said
    assert "K = 2: 3.00 ms of a 20.00 ms round outside the forwards, 15.0% (not met)" in said


@pytest.mark.parametrize("other", [["--head"], ["--byte-vocab"], ["--shapes", "x"]])
def test_the_pair_is_not_a_random_model(other):
    from bench.overhead import main

    assert parse_args(["--pair"]).pair and not parse_args([]).pair
    with pytest.raises(SystemExit, match="--pair runs the default pair"):
        main(["--pair", *other, "--out", ""])


def test_the_concurrency_bench_says_who_drafted():
    from bench.concurrency import summarise
    from bench.concurrency_report import proposer_shares

    def client(stats):
        return {"start": 0.0, "first": 0.1, "end": 1.0, "tokens": 10, "stats": stats}

    burst = summarise([
        client({"rounds": 6, "by_proposer": {"suffix": {"rounds": 2, "draft_tokens": 8, "accepted_tokens": 2}}}),
        client({"rounds": 4, "by_proposer": {"suffix": {"rounds": 1, "draft_tokens": 4, "accepted_tokens": 1},
                                             "draft_model": {"rounds": 1, "draft_tokens": 2, "accepted_tokens": 2}}}),
    ])
    assert burst["rounds"] == 10 and burst["by_proposer"] == {"suffix": [3, 12, 3], "draft_model": [1, 2, 2]}
    assert proposer_shares(burst) == ("suffix 30% of the rounds (12 drafts, 0.25 accepted), draft_model 10% of the "
                                      "rounds (2 drafts, 1.00 accepted), target-only 60%")


def test_the_grpc_floor_after_a_long_idle_is_timed_with_the_machines_own_stall():
    """bench.grpc_floor against its echo server in a child process: with long_idle_s, a round trip after idling that
    long, and the machine's probe (work()) hot and as the first thing after such an idle, all measured, and said."""
    from bench import grpc_floor

    floor = grpc_floor.measure(n=40, runs=1, long_idle_s=0.01)
    assert set(floor) == {"unary_us", "stream_us", "stream_idle_us", "stream_long_idle_us", "work_hot_us",
                          "work_long_idle_us"}
    assert all(v > 0 for v in floor.values()), floor
    said = grpc_floor.long_idle_said(floor, 0.01)
    assert said.startswith("After 10 ms idle: the round trip ") and f"{floor['work_hot_us']:.0f} us hot" in said
    assert "stream_long_idle_us" not in grpc_floor.measure(n=20, runs=1)  # only when asked


def test_k0_without_the_stall_takes_the_hops_excess_off_the_time_outside_and_the_round():
    from bench.overhead import without_stall

    rows = [{"client_round": 70.0, "compute": 60.0}, {"client_round": 80.0, "compute": 68.0},
            {"client_round": 90.0, "compute": 70.0}]
    said = without_stall(rows, {"stream_long_idle_us": 5000.0, "stream_idle_us": 1000.0})  # excess 1.5 x 4 ms = 6 ms
    assert "6.00 ms outside the forwards" in said  # median of 4, 6, 14
    assert f"{100 * 6 / 74:.1f}% of a round" in said  # (12 - 6) / (80 - 6), the median share
    no_excess = {"stream_long_idle_us": 500.0, "stream_idle_us": 1000.0}
    assert "12.00 ms outside" in without_stall(rows, no_excess)  # no excess: as measured
