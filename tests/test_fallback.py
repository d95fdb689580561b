"""When the draft tier is unreachable, generation carries on with prompt lookup, output unchanged."""

import pytest

from specdec.client import Client
from tests.helpers import Cluster, reference_greedy

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

PROMPT = [1, 504, 3937, 282, 4193, 314, 30, 504, 3937, 282]


def test_draft_down_falls_back_to_prompt_lookup(tiny_target, tiny_target_model):
    cluster = Cluster(tiny_target, tiny_target, coordinator_overrides={"rpc_timeout_s": 5.0})
    try:
        expected = reference_greedy(tiny_target_model, PROMPT, 30, [2])
        with Client(cluster.address) as c:
            before = c.generate(token_ids=PROMPT, max_new_tokens=30, num_speculative_tokens=3, proposer="draft")
            assert before.token_ids == expected and before.stats["accepted_tokens"] > 0
            cluster.stop_draft()
            for proposer in ("draft", "hybrid"):
                after = c.generate(token_ids=PROMPT, max_new_tokens=30, num_speculative_tokens=3, proposer=proposer)
                assert after.token_ids == expected
                assert after.stats["draft_ms"] == 0.0  # the draft model did no work...
                assert after.stats["draft_tokens"] > 0  # ...yet rounds still speculated: prompt lookup
                assert after.finish_reason in ("length", "eos")
    finally:
        cluster.close()
