"""An EAGLE-3 head as the draft tier, through real servers: the target returns its features with each verdict, the
coordinator forwards them, the head drafts chains and trees from them, and greedy output equals the target's own
generate(), token for token, at a fixed K, with the adaptive policy, in the hybrid proposer, under several sessions at
once, with a prompt sent in parts, after the prompt was scored, and after the draft replica lost its sessions.

The target here is the tiny random model with its layers' outputs scaled down (its residual stream stays near the
token's embedding, and its LM head is the embedding, tied), so it often repeats its last token and sometimes does not;
the head is specdec.engine.eagle3.echo_head, whose guess is the target's own prediction one position early (the
last token again): its drafts are accepted in runs and rejected between them."""

import concurrent.futures

import pytest
import torch

from specdec.client import Client
from specdec.engine.eagle3 import echo_head, write_checkpoint
from specdec.models import ModelConfig, load_model, make_tiny_model
from tests.helpers import Cluster, device_model, reference_greedy

pytestmark = pytest.mark.servers

PROMPTS = [[1, 9038, 2115, 253, 1345], [1, 504, 3937, 282, 4193, 314, 30, 2600, 28, 540, 29, 15, 216]]
MAX_NEW = 40


@pytest.fixture(scope="module")
def repeating(tmp_path_factory) -> tuple[str, str]:
    """(a tiny target that often repeats its last token, an echo head for it)."""
    root = tmp_path_factory.mktemp("repeating")
    path = make_tiny_model(root / "target", seed=0)
    model = load_model(ModelConfig(path))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
    model.save_pretrained(path)
    write_checkpoint(echo_head(model), root / "head")
    return path, str(root / "head")


@pytest.fixture(scope="module")
def tiny_target(repeating) -> str:  # this module's target (the session's tiny target is another)
    return repeating[0]


@pytest.fixture(scope="module")
def tiny_target_model(repeating):
    return load_model(device_model(repeating[0]))


@pytest.fixture(scope="module")
def head_cluster(repeating):
    cluster = Cluster(*repeating)
    yield cluster
    cluster.close()


def test_the_coordinator_sees_a_feature_draft(head_cluster):
    info = head_cluster.pipeline.draft_info
    assert list(info.feature_layers) == [0, 1, 1] and head_cluster.pipeline.feature_draft


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_equals_target_generate_with_the_head(head_cluster, tiny_target_model, k):
    drafted = accepted = 0
    with Client(head_cluster.address) as client:
        for prompt in PROMPTS:
            expected = reference_greedy(tiny_target_model, prompt, MAX_NEW, [2])
            out = client.generate(token_ids=prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=k, proposer="draft")
            assert out.token_ids == expected
            drafted += int(out.stats["draft_tokens"])
            accepted += int(out.stats["accepted_tokens"])
    assert drafted >= MAX_NEW  # the head drafted (every round after the first, whose verdict brings the prompt's rows)
    assert 0 < accepted < drafted  # some of it accepted, some not


@pytest.fixture(scope="module")
def head_direct_cluster(repeating):
    """The head's replica given the target's address: fixed-K sessions run as direct rounds."""
    cluster = Cluster(*repeating, direct=True)
    yield cluster
    cluster.close()


def test_direct_rounds_with_the_head_give_the_coordinators_rounds_tokens(head_cluster, head_direct_cluster,
                                                                           tiny_target_model):
    """The head's replica runs the session's rounds itself, the target's rows going straight to it (the first round
    the target's alone, as the coordinator's): greedy output is the target's own, and seeded sampling gives the
    coordinator's rounds' tokens draw for draw."""
    assert head_direct_cluster.pipeline.direct_rounds and not head_cluster.pipeline.direct_rounds
    with Client(head_direct_cluster.address) as direct, Client(head_cluster.address) as own:
        for prompt in PROMPTS:
            for k in (1, 3):
                out = direct.generate(token_ids=prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=k,
                                      proposer="draft")
                assert out.token_ids == reference_greedy(tiny_target_model, prompt, MAX_NEW, [2])
                s = out.stats
                assert s["direct_rounds"] == s["rounds"] > 0 and 0 < s["accepted_tokens"] < s["draft_tokens"]
            kw = dict(token_ids=prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=3, proposer="draft",
                      temperature=0.9, seed=11)
            sampled, theirs = direct.generate(**kw), own.generate(**kw)
            assert sampled.token_ids == theirs.token_ids and sampled.stats["direct_rounds"] == sampled.stats["rounds"]
            assert theirs.stats["direct_rounds"] == 0


def test_a_scored_prompt_leaves_the_head_every_row(head_cluster, head_direct_cluster, tiny_target_model):
    """Prompt logprobs first (a target call that asks no features): the next round sends the prompt again for its
    rows, so the head drafts as without scoring, in the coordinator's rounds and in direct rounds, with no resend
    counted as a lost session's; greedy output is the target's own and the scores are the plain forward's."""
    from tests.test_metrics import scrape, value
    from tests.test_prompt_logprobs import assert_scores, reference
    for cluster in (head_cluster, head_direct_cluster):
        resent = lambda: value(scrape(cluster.metrics_url), "specdec_reprefills_total", tier="target")  # noqa: E731
        before = resent()
        with Client(cluster.address) as client:
            for prompt in PROMPTS:
                out = client.generate(token_ids=prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=3,
                                      proposer="draft", prompt_logprobs=True, top_logprobs=2)
                assert out.token_ids == reference_greedy(tiny_target_model, prompt, MAX_NEW, [2])
                assert 0 < out.stats["accepted_tokens"] < out.stats["draft_tokens"]
                assert_scores(out.prompt_logprobs.logprobs, reference(tiny_target_model, prompt, top=2))
        assert resent() == before


def test_adaptive_and_hybrid_and_concurrent_sessions(head_cluster, tiny_target_model):
    def run(i):
        prompt = PROMPTS[i % 2] + [100 + i]
        with Client(head_cluster.address) as client:
            out = client.generate(token_ids=prompt, max_new_tokens=24, proposer="hybrid" if i % 3 == 0 else "draft")
        return prompt, out.token_ids

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        for prompt, got in pool.map(run, range(6)):
            assert got == reference_greedy(tiny_target_model, prompt, 24, [2])


def test_a_draft_replica_that_lost_the_session_gets_every_row_again(head_cluster, tiny_target_model):
    """The draft tier forgets every session between two generations' rounds (its sessions dropped under the stream):
    each resend carries the rows from position 0 and the output is unchanged."""
    from tests.test_metrics import scrape, value

    engine = head_cluster.draft_tier
    prompt = PROMPTS[1]
    expected = reference_greedy(tiny_target_model, prompt, MAX_NEW, [2])
    before = value(scrape(head_cluster.metrics_url), "specdec_reprefills_total", tier="draft")
    with Client(head_cluster.address) as client:
        stream = client.stream(token_ids=prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=3, proposer="draft")
        ids = []
        for i, event in enumerate(stream):
            if event.HasField("chunk"):
                ids.extend(event.chunk.token_ids)
                if i % 3 == 1:
                    with engine._lock:
                        engine._sessions.clear()
    assert ids == expected
    assert value(scrape(head_cluster.metrics_url), "specdec_reprefills_total", tier="draft") > before


@pytest.fixture(scope="module")
def head_tree_cluster(repeating):
    cluster = Cluster(*repeating, coordinator_overrides={"draft_tree_nodes": 6, "draft_tree_branching": 2})
    yield cluster
    cluster.close()


def test_greedy_trees_from_the_head_equal_target_generate(head_tree_cluster, tiny_target_model):
    with Client(head_tree_cluster.address) as client:
        for prompt in PROMPTS:
            expected = reference_greedy(tiny_target_model, prompt, MAX_NEW, [2])
            out = client.generate(token_ids=prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=3, proposer="draft")
            assert out.token_ids == expected
            assert 0 < int(out.stats["accepted_tokens"]) < int(out.stats["draft_tokens"])


def test_a_prompt_longer_than_one_part_is_sent_in_parts(head_cluster, tiny_target_model, monkeypatch):
    """With features asked, the coordinator sends an uncached part longer than FEATURE_PART_BYTES of rows in parts
    (the target refuses a request whose rows could exceed one response); the rows and the output are unchanged."""
    from coordinator.tiers import target

    monkeypatch.setattr(target, "FEATURE_PART_BYTES", 5 * 2 * 3 * tiny_target_model.config.hidden_size)  # 5 rows
    prompt = PROMPTS[1] * 3 + [17]  # 40 tokens: 8 parts
    expected = reference_greedy(tiny_target_model, prompt, 16, [2])
    with Client(head_cluster.address) as client:
        out = client.generate(token_ids=prompt, max_new_tokens=16, num_speculative_tokens=2, proposer="draft")
    assert out.token_ids == expected
    assert int(out.stats["draft_tokens"]) > 0
