"""Greedy output through the real servers equals the target's own generate(), token for token."""

import pytest

from specdec.client import Client
from tests.helpers import reference_greedy

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

PROMPTS = [[1, 9038, 2115, 253, 1345], [1, 504, 3937, 282, 4193, 314, 30, 2600, 28, 540, 29, 15, 216]]
MAX_NEW = 40


@pytest.mark.parametrize("k", [1, 3, 5, 8])
@pytest.mark.parametrize("cluster_name", ["self_draft_cluster", "random_draft_cluster"])
def test_greedy_equals_target_generate(request, tiny_target_model, cluster_name, k):
    cluster = request.getfixturevalue(cluster_name)
    with Client(cluster.address) as client:
        for prompt in PROMPTS:
            expected = reference_greedy(tiny_target_model, prompt, MAX_NEW, [2])
            out = client.generate(token_ids=prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=k, proposer="draft")
            assert out.token_ids == expected
            st = out.stats
            assert st["generated_tokens"] == len(expected)
            assert st["num_speculative_tokens"] == k
            if cluster_name == "self_draft_cluster":
                assert st["accepted_tokens"] == st["draft_tokens"], "the target as its own draft must be accepted always"
                # every round but the clamped last ones commits K + 1 tokens
                assert st["rounds"] <= -(-MAX_NEW // (k + 1)) + 1
            else:
                assert st["acceptance_rate"] < 0.1
                assert st["rounds"] >= MAX_NEW * 0.9


def test_target_only_k0_equals_generate(random_draft_cluster, tiny_target_model):
    prompt = PROMPTS[1]
    with Client(random_draft_cluster.address) as client:
        out = client.generate(token_ids=prompt, max_new_tokens=20, num_speculative_tokens=0)
    assert out.token_ids == reference_greedy(tiny_target_model, prompt, 20, [2])
    assert out.stats["rounds"] == 5 and out.stats["draft_tokens"] == 0  # 1 + 2 + 4 + 8 + 5 tokens: the target runs on


# A prompt that repeats itself, so prompt lookup finds matches (random models rarely copy, so most
# lookup proposals are rejected: the point is exactness on both outcomes).
REPETITIVE = [1, 504, 3937, 282, 4193, 314, 30, 504, 3937, 282, 4193, 314, 30, 504, 3937, 282]


@pytest.mark.parametrize("proposer", ["lookup", "hybrid"])
@pytest.mark.parametrize("k", [1, 3, 8, None])
def test_greedy_equals_target_generate_with_lookup_proposers(self_draft_cluster, tiny_target_model, proposer, k):
    with Client(self_draft_cluster.address) as client:
        for prompt in (REPETITIVE, PROMPTS[0]):
            expected = reference_greedy(tiny_target_model, prompt, MAX_NEW, [2])
            out = client.generate(token_ids=prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=k, proposer=proposer)
            assert out.token_ids == expected
            assert out.stats["proposer"] == {"lookup": "prompt_lookup", "hybrid": "hybrid"}[proposer]


def test_adaptive_k_greedy_equals_target_generate(self_draft_cluster, random_draft_cluster, tiny_target_model):
    prompt = PROMPTS[1]
    expected = reference_greedy(tiny_target_model, prompt, MAX_NEW, [2])
    for cluster in (self_draft_cluster, random_draft_cluster):
        with Client(cluster.address) as client:
            out = client.generate(token_ids=prompt, max_new_tokens=MAX_NEW, proposer="draft")  # K unset: adaptive
        assert out.token_ids == expected
        assert out.stats["num_speculative_tokens"] == -1
