"""The entry points as a user runs them: three processes (python -m target_service / draft_service /
coordinator) on loopback, the `specdec` CLI against them, and a clean SIGTERM shutdown."""

import json
import subprocess
import sys

import pytest

from specdec.client.local import LocalPipeline, LocalPipelineConfig
from tests.helpers import reference_greedy, tier_device_args

pytestmark = pytest.mark.processes

PROMPT = [1, 504, 3937, 282, 4193, 314, 30]


def test_processes_and_cli(tiny_target, tiny_random_draft, tiny_target_model):
    config = LocalPipelineConfig(target_model=tiny_target, draft_model=tiny_random_draft,
                                 target_args=tier_device_args(), draft_args=tier_device_args(),
                                 coordinator_args=["--default-k", "3"], start_timeout_s=180)
    with LocalPipeline(config) as pipeline:
        cli = [sys.executable, "-m", "specdec.client.cli"]
        info = json.loads(subprocess.run([*cli, "info", "--address", pipeline.address], check=True,
                                         capture_output=True, text=True, timeout=60).stdout)
        assert info["target"]["model"] == tiny_target and info["draft"]["model"] == tiny_random_draft
        assert info["default_num_speculative_tokens"] == 3

        from transformers import AutoTokenizer

        prompt_text = AutoTokenizer.from_pretrained(tiny_target).decode(PROMPT[1:])
        run = subprocess.run([*cli, "generate", prompt_text, "--no-chat", "--max-new-tokens", "16", "--json",
                              "--address", pipeline.address], check=True, capture_output=True, text=True, timeout=120)
        out = json.loads(run.stdout)
        tok = AutoTokenizer.from_pretrained(tiny_target)
        prompt_ids = tok(prompt_text)["input_ids"]
        assert out["token_ids"] == reference_greedy(tiny_target_model, prompt_ids, 16, [2])
        assert out["finish_reason"] in ("length", "eos")
        assert out["stats"]["num_speculative_tokens"] == 3
        assert out["stats"]["rounds"] >= 1 and out["text"] == tok.decode(out["token_ids"], skip_special_tokens=True)

        bad = subprocess.run([*cli, "generate", "x", "--max-new-tokens", "0", "--address", pipeline.address],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "max_new_tokens" in bad.stderr
        codes = pipeline.stop()
    assert codes == {"target": 0, "draft": 0, "coordinator": 0}, {n: pipeline.log_tail(n) for n in codes}


def test_direct_rounds_between_real_processes_survive_a_killed_draft(tiny_target, tiny_target_model):
    """As `make run` starts them, the draft runs a fixed-K session's rounds itself (it was given the target's
    address); SIGKILLed mid-Drive, the coordinator's own rounds finish the generation with the same tokens."""
    from specdec.client import Client

    config = LocalPipelineConfig(target_model=tiny_target, draft_model=tiny_target, target_args=tier_device_args(),
                                 draft_args=tier_device_args(), start_timeout_s=180)
    expected = reference_greedy(tiny_target_model, PROMPT, 400, [])
    kw = dict(token_ids=PROMPT, max_new_tokens=400, num_speculative_tokens=1, proposer="draft", ignore_eos=True)
    with LocalPipeline(config) as pipeline, Client(pipeline.address, timeout_s=120) as c:
        whole = c.generate(**kw)
        assert whole.token_ids == expected and whole.stats["direct_rounds"] == whole.stats["rounds"] > 0
        tokens, stats = [], None
        for i, event in enumerate(c.stream(**kw)):
            if event.HasField("chunk"):
                tokens.extend(event.chunk.token_ids)
            else:
                stats = event.result.stats
            if i == 0:
                pipeline.kill("draft")
        assert tokens == expected
        assert 0 < stats.direct_rounds < stats.rounds  # the coordinator ran the rest
