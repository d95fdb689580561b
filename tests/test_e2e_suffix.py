"""Suffix decoding through the real servers: greedy output equals the target's own generate() with
the coordinator's shared tree cold and warm, and seeded sampling with a fixed K is reproducible.
(The request enum has no suffix value yet: the coordinator's default proposer is suffix.)"""

import pytest

from specdec.client import Client
from tests.helpers import Cluster, reference_greedy

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

PROMPTS = [[1, 9038, 2115, 253, 1345], [1, 504, 3937, 282, 4193, 314, 30, 2600, 28, 540, 29, 15, 216]]
REPETITIVE = [1, 504, 3937, 282, 4193, 314, 30, 504, 3937, 282, 4193, 314, 30, 504, 3937, 282]
UNSEEN = [1, 2115, 253, 9038, 30, 4193]
MAX_NEW = 40


@pytest.fixture(scope="module")
def suffix_cluster(tiny_target):
    """The target as its own draft (so hybrid may use the draft too), suffix by default."""
    cluster = Cluster(tiny_target, tiny_target, coordinator_overrides={"default_proposer": "suffix"})
    yield cluster
    cluster.close()


def _cache(cluster):
    return cluster.pipeline.suffix_cache


def _settle(cluster) -> None:
    """Wait for finished sessions' clean-ups: their outputs join the shared tree when they close."""
    cluster._call(cluster.pipeline.settle())


def _clear(cluster) -> None:
    """Empty the shared tree, once no session is left to add to it."""
    async def clear():
        await cluster.pipeline.settle()
        _cache(cluster).clear()

    cluster._call(clear())


@pytest.mark.parametrize("k", [1, 3, 8, None])
def test_greedy_equals_target_generate_with_suffix(suffix_cluster, tiny_target_model, k):
    with Client(suffix_cluster.address) as client:
        for prompt in (REPETITIVE, *PROMPTS):
            expected = reference_greedy(tiny_target_model, prompt, MAX_NEW, [2])
            out = client.generate(token_ids=prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=k)
            assert out.token_ids == expected
            assert out.stats["proposer"] == "suffix"


def test_greedy_equals_target_generate_with_the_shared_tree_warm(suffix_cluster, tiny_target_model):
    _clear(suffix_cluster)
    cold = {}
    with Client(suffix_cluster.address) as client:
        for i, prompt in enumerate(PROMPTS):
            out = client.generate(token_ids=prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=8)
            assert out.token_ids == reference_greedy(tiny_target_model, prompt, MAX_NEW, [2])
            cold[i] = out.stats
        _settle(suffix_cluster)
        assert _cache(suffix_cluster).entries == len(PROMPTS)
        # The same prompts again: the shared tree holds their outputs, so whole blocks are accepted.
        for i, prompt in enumerate(PROMPTS):
            expected = reference_greedy(tiny_target_model, prompt, MAX_NEW, [2])
            warm = client.generate(token_ids=prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=8)
            assert warm.token_ids == expected
            assert warm.stats["accepted_tokens"] >= 0.75 * len(expected) > cold[i]["accepted_tokens"]
            # Whole blocks a forward: under half a forward a token (cold rounds without a match are target-only,
            # one forward a token, however many tokens their run-on commits a round).
            assert warm.stats["rounds"] < len(expected) / 2
            for kw in (dict(), dict(proposer="hybrid"), dict(proposer="hybrid", num_speculative_tokens=3)):
                assert client.generate(token_ids=prompt, max_new_tokens=MAX_NEW, **kw).token_ids == expected
        # Other prompts with the tree warm with unrelated outputs: proposals are mostly wrong, output exact.
        for prompt in (UNSEEN, REPETITIVE):
            for kw in (dict(), dict(num_speculative_tokens=5), dict(proposer="hybrid")):
                out = client.generate(token_ids=prompt, max_new_tokens=MAX_NEW, **kw)
                assert out.token_ids == reference_greedy(tiny_target_model, prompt, MAX_NEW, [2])
    assert 0 < _cache(suffix_cluster).estimated_bytes <= suffix_cluster.pipeline.config.suffix.cache_bytes


def test_seeded_sampling_with_suffix_and_a_fixed_k_is_reproducible(suffix_cluster):
    """A seeded request is verified by the keyed race, so its output does not depend on its proposals: the second
    run finds the first run's output in the shared tree, drafts it, every draft accepted, and gives the same tokens."""
    kw = dict(token_ids=PROMPTS[1], max_new_tokens=30, temperature=1.0, top_p=0.95, num_speculative_tokens=3)
    _clear(suffix_cluster)
    with Client(suffix_cluster.address) as client:
        a = client.generate(seed=1234, **kw)
        _settle(suffix_cluster)
        assert _cache(suffix_cluster).entries == 1
        b = client.generate(seed=1234, **kw)
        other = client.generate(seed=99, **kw)
    assert a.token_ids == b.token_ids and a.text == b.text
    assert len(a.token_ids) == 30
    assert other.token_ids != a.token_ids
    assert b.stats["accepted_tokens"] == b.stats["draft_tokens"] >= 20 > a.stats["accepted_tokens"]
