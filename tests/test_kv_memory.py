"""KV memory reported truthfully, through real processes: the pool a tier announces at start (sized from
--kv-memory-gib) is the pool GetStatus reports after load, and the memory it really occupies grows with
the tokens written, never past the bound."""

import re

import grpc
import pytest

from specdec.client import Client
from specdec.client.local import LocalPipeline, LocalPipelineConfig
from specdec.proto import common_pb2, target_pb2_grpc
from tests.helpers import TEST_DEVICE, tier_device_args

pytestmark = pytest.mark.processes

PROMPT = [1, 504, 3937, 282, 4193, 314, 30]


def status(port: int) -> common_pb2.StatusResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return target_pb2_grpc.TargetServiceStub(ch).GetStatus(common_pb2.StatusRequest(), timeout=10)


def test_the_pool_announced_at_start_is_the_pool_reported_after_load(tiny_target):
    budget_gib = 0.01
    config = LocalPipelineConfig(target_model=tiny_target, draft_model=None, start_timeout_s=180,
                                 target_args=[*tier_device_args(), "--kv-memory-gib", str(budget_gib),
                                              "--max-session-tokens", "512"])
    with LocalPipeline(config) as pipeline:
        start_line = next(line for line in pipeline.log_tail("target", 200).splitlines() if "KV pool:" in line)
        slots, slot_tokens, at_most_mib, resident_mib = map(float, re.search(
            r"KV pool: (\d+) slots x (\d+) tokens, at most (\d+) MiB, (\d+) MiB resident now", start_line).groups())
        before = status(pipeline.ports["target"])
        assert before.kv_capacity_tokens == slots * slot_tokens and slot_tokens == 512
        assert before.kv_capacity_bytes <= budget_gib * 2**30  # as many slots as fit in the budget...
        assert before.kv_capacity_bytes + slot_tokens * (before.kv_capacity_bytes // before.kv_capacity_tokens) \
            > budget_gib * 2**30  # ...and no fewer
        assert round(before.kv_capacity_bytes / 2**20) == at_most_mib
        assert before.step_mode in ("packed", "compile", "cuda-graphs", "eager")

        with Client(pipeline.address) as client:
            for i in range(4):
                client.generate(token_ids=PROMPT + [100 + i] * (20 * i), max_new_tokens=24, num_speculative_tokens=0)
        after = status(pipeline.ports["target"])
        assert after.kv_capacity_bytes == before.kv_capacity_bytes  # the bound announced at start holds
        assert after.kv_capacity_tokens == before.kv_capacity_tokens
        assert 0 < after.kv_resident_bytes <= after.kv_capacity_bytes + after.kv_capacity_bytes // int(slots)
        if TEST_DEVICE == "cpu":  # pages are committed as positions are first written: it grew with the load
            bytes_per_token = after.kv_capacity_bytes // after.kv_capacity_tokens
            assert after.kv_resident_bytes > before.kv_resident_bytes
            assert after.kv_resident_bytes >= (len(PROMPT) + 60 + 23) * bytes_per_token  # the longest session
            assert resident_mib == round(before.kv_resident_bytes / 2**20)
        else:  # a GPU takes the whole pool at start
            assert after.kv_resident_bytes == before.kv_resident_bytes
