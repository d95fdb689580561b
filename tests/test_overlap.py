"""Overlapped drafting: the draft tier pre-drafts round r+1 while the target verifies round r, for the likeliest
outcomes of round r (its speculation cache, specdec.engine.propose_tree). Draws are keyed by position and
node, so output with overlap equals output without it, greedy and sampled alike."""

import pytest

from specdec.client import Client
from tests.helpers import Cluster, reference_greedy

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

PROMPT = [1, 504, 3937, 282, 4193, 314, 30, 2600, 28]


@pytest.fixture(scope="module")
def random_draft_overlap_cluster(tiny_target, tiny_random_draft):
    cluster = Cluster(tiny_target, tiny_random_draft, coordinator_overrides={"overlap": True})
    yield cluster
    cluster.close()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_overlap_greedy_equals_target_generate(self_draft_overlap_cluster, random_draft_overlap_cluster, tiny_target_model, k):
    expected = reference_greedy(tiny_target_model, PROMPT, 40, [2])
    with Client(self_draft_overlap_cluster.address) as c:
        out = c.generate(token_ids=PROMPT, max_new_tokens=40, num_speculative_tokens=k, proposer="draft")
    assert out.token_ids == expected
    # The target as its own draft accepts every block and its bonus guess is the target's argmax: every
    # round after the first starts with drafts already made, but for a last round whose K the token budget
    # cut (another request than the one pre-drafted).
    assert out.stats["overlapped_rounds"] >= out.stats["rounds"] - 2 > 0
    with Client(random_draft_overlap_cluster.address) as c:
        out = c.generate(token_ids=PROMPT, max_new_tokens=40, num_speculative_tokens=k, proposer="draft")
    assert out.token_ids == expected
    assert out.stats["overlapped_rounds"] == 0  # a random draft never guesses the whole block


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_k=20), dict(temperature=0.7, top_p=0.9),
                                      dict(temperature=0.05, top_k=20)])
def test_overlap_sampled_output_equals_sequential(self_draft_cluster, self_draft_overlap_cluster, sampling):
    """With sampling the draft's guess of the bonus is an independent draw, so it holds only as often
    as two draws agree; at a low temperature they mostly do, and the pre-drafted blocks that are
    used must be exactly what a sequential Propose would have drafted."""
    kw = dict(token_ids=PROMPT, max_new_tokens=40, num_speculative_tokens=3, proposer="draft", seed=4242, **sampling)
    with Client(self_draft_cluster.address) as c:
        sequential = c.generate(**kw)
    with Client(self_draft_overlap_cluster.address) as c:
        overlapped = c.generate(**kw)
    assert overlapped.token_ids == sequential.token_ids
    assert sequential.stats["overlapped_rounds"] == 0
    if sampling["temperature"] < 0.1:
        assert overlapped.stats["overlapped_rounds"] > overlapped.stats["rounds"] // 2


def test_overlap_sessions_are_freed(self_draft_overlap_cluster):
    with Client(self_draft_overlap_cluster.address) as c:
        c.generate(token_ids=PROMPT, max_new_tokens=20, num_speculative_tokens=4, proposer="draft")
    self_draft_overlap_cluster.wait_no_sessions()
