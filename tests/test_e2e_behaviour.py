"""Round-loop behaviour through the real servers: seeds, EOS and stop strings inside an accepted
block, the token budget, client cancellation and concurrent sessions."""

import threading

import grpc
import pytest
from transformers import AutoTokenizer

from specdec.client import Client
from specdec.models import make_tiny_model
from tests.helpers import Cluster, reference_greedy

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

PROMPT = [1, 504, 3937, 282, 4193, 314, 30]


def test_seeded_sampling_is_reproducible(random_draft_cluster, self_draft_cluster):
    for cluster in (random_draft_cluster, self_draft_cluster):
        with Client(cluster.address) as c:
            kw = dict(token_ids=PROMPT, max_new_tokens=30, temperature=1.0, top_p=0.95, num_speculative_tokens=3, proposer="draft")
            a = c.generate(seed=1234, **kw)
            b = c.generate(seed=1234, **kw)
            other = c.generate(seed=99, **kw)
        assert a.token_ids == b.token_ids and a.text == b.text
        assert len(a.token_ids) == 30
        assert other.token_ids != a.token_ids


def test_self_draft_sampling_accepts_everything(self_draft_cluster):
    """p == q (up to float rounding of batched vs single-token forwards): acceptance ~1.

    top_k=20 keeps q's support inside the draft's top-64 truncation. Without it the tiny random
    model's nearly flat distribution loses most of its mass to the truncation, and acceptance
    equals the kept mass (~0.2): correct, but not a test of p == q."""
    with Client(self_draft_cluster.address) as c:
        kw = dict(token_ids=PROMPT, max_new_tokens=40, temperature=0.8, seed=7, num_speculative_tokens=4, proposer="draft")
        out = c.generate(top_k=20, **kw)
        flat = c.generate(**kw)
    assert out.stats["acceptance_rate"] > 0.95
    assert flat.stats["acceptance_rate"] < 0.6


@pytest.mark.parametrize("direct", [False, True], ids=["coordinator-rounds", "direct-rounds"])
def test_a_stop_token_inside_an_accepted_block(self_draft_cluster, tiny_target_model, direct):
    """stop_token_ids (vLLM's): a token of the greedy output, inside a block the self-draft has accepted whole, ends
    the output there with finish reason stop, also with ignore_eos, in the coordinator's rounds, at a fixed K whose
    rounds the draft tier may run (direct), and through the OpenAI API with the official client."""
    import openai

    ref = reference_greedy(tiny_target_model, PROMPT, 24, None)
    idx = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i] and ref[i] != 2)
    kw = dict(token_ids=PROMPT, max_new_tokens=24, stop_token_ids=[ref[idx], 7], ignore_eos=True, proposer="draft")
    with Client(self_draft_cluster.address) as c:
        out = c.generate(num_speculative_tokens=5 if direct else None, **kw)
    assert out.token_ids == ref[: idx + 1] and out.finish_reason == "stop"
    oai = openai.OpenAI(base_url=self_draft_cluster.http_url + "/v1", api_key="x", max_retries=0)
    r = oai.completions.create(model=self_draft_cluster.coordinator.frontend.model_name, prompt=PROMPT, max_tokens=24,
                               extra_body={"stop_token_ids": [ref[idx]], "ignore_eos": True})
    assert r.choices[0].text == out.text and r.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=self_draft_cluster.coordinator.frontend.model_name, prompt=PROMPT, max_tokens=4,
                               extra_body={"stop_token_ids": [10**6]})
    assert e.value.body["param"] == "stop_token_ids"


def test_eos_inside_an_accepted_block(tiny_dir, tiny_target_model):
    """Declare a token of the greedy output to be EOS: with the target as its own draft the block that
    contains it is accepted whole, and the coordinator must truncate right after it."""
    ref = reference_greedy(tiny_target_model, PROMPT, 24, None)
    idx = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i] and ref[i] != 2)
    eos = ref[idx]
    path = make_tiny_model(tiny_dir / f"target-eos-{eos}", seed=0, eos_token_ids=[2, eos])
    cluster = Cluster(path, path)
    try:
        with Client(cluster.address) as c:
            out = c.generate(token_ids=PROMPT, max_new_tokens=24, num_speculative_tokens=5, proposer="draft")
    finally:
        cluster.close()
    assert out.token_ids == ref[: idx + 1]
    assert out.finish_reason == "eos"
    # The last round's block ran past the EOS; the tokens after it were dropped, not counted.
    assert out.stats["generated_tokens"] == idx + 1
    assert out.stats["mean_tokens_per_forward"] * out.stats["rounds"] > idx + 1


def test_stop_string_truncates_text_and_tokens(self_draft_cluster, tiny_target_model, tiny_target):
    tok = AutoTokenizer.from_pretrained(tiny_target)
    ref = reference_greedy(tiny_target_model, PROMPT, 30, [2])
    texts = [tok.decode(ref[: i + 1], skip_special_tokens=True) for i in range(len(ref))]
    full = texts[-1]
    # a stop string that first appears in the text completed by token j (j in the middle)
    j, stop = next((j, texts[j][len(texts[j - 1]):].strip()[:3]) for j in range(6, len(ref))
                   if len(texts[j][len(texts[j - 1]):].strip()) >= 2
                   and texts[j][len(texts[j - 1]):].strip()[:3] not in texts[j - 1])
    with Client(self_draft_cluster.address) as c:
        out = c.generate(token_ids=PROMPT, max_new_tokens=30, num_speculative_tokens=4, stop=[stop, "never-in-text-zzz"])
    assert out.finish_reason == "stop"
    assert out.text == full[: full.find(stop)]
    assert out.token_ids == ref[: j + 1]


def test_streamed_text_never_contains_the_stop_string(self_draft_cluster):
    with Client(self_draft_cluster.address) as c:
        baseline = c.generate(token_ids=PROMPT, max_new_tokens=30, num_speculative_tokens=2)
        stop = baseline.text[10:13]
        chunks = [e.chunk.text for e in c.stream(token_ids=PROMPT, max_new_tokens=30, num_speculative_tokens=2, stop=[stop])
                  if e.HasField("chunk")]
    assert stop not in "".join(chunks)
    assert "".join(chunks) == baseline.text[: baseline.text.find(stop)]


def test_max_new_tokens_reached_mid_block(self_draft_cluster, tiny_target_model):
    with Client(self_draft_cluster.address) as c:
        out = c.generate(token_ids=PROMPT, max_new_tokens=7, num_speculative_tokens=5, proposer="draft")
    assert out.token_ids == reference_greedy(tiny_target_model, PROMPT, 7, [2])
    assert out.finish_reason == "length"
    # round 1: K=5 -> 6 tokens; round 2: K clamped to remaining - 1 = 0 -> 1 token
    assert out.stats["rounds"] == 2 and out.stats["draft_tokens"] == 5


def test_client_cancellation_frees_sessions_on_both_tiers(random_draft_cluster):
    cluster = random_draft_cluster
    cluster.wait_no_sessions()
    with grpc.insecure_channel(cluster.address) as channel:
        from specdec.client import build_request
        from specdec.proto import generate_pb2_grpc

        call = generate_pb2_grpc.GenerationStub(channel).Generate(
            build_request(token_ids=PROMPT, max_new_tokens=1000, ignore_eos=True, num_speculative_tokens=2, proposer="draft"))
        first = next(call)
        assert first.HasField("chunk")
        assert cluster.status("target").num_sessions == 1 and cluster.status("draft").num_sessions == 1
        call.cancel()
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:
                pass
        assert err.value.code() == grpc.StatusCode.CANCELLED
    cluster.wait_no_sessions()


def test_finished_generations_free_their_sessions(random_draft_cluster):
    with Client(random_draft_cluster.address) as c:
        for _ in range(3):
            c.generate(token_ids=PROMPT, max_new_tokens=5, num_speculative_tokens=2)
    random_draft_cluster.wait_no_sessions()


def test_concurrent_sessions_do_not_disturb_each_other(random_draft_cluster, self_draft_cluster):
    prompts = [PROMPT, [1, 9038, 2115, 253, 1345], [1, 22, 333, 4444]]
    kinds = [dict(num_speculative_tokens=3), dict(num_speculative_tokens=5, temperature=0.9, seed=11)]
    for cluster in (random_draft_cluster, self_draft_cluster):
        with Client(cluster.address) as c:
            solo = {(i, j): c.generate(token_ids=p, max_new_tokens=25, **kw).token_ids
                    for i, p in enumerate(prompts) for j, kw in enumerate(kinds)}
            together, errors = {}, []

            def run(i, j):
                try:
                    together[(i, j)] = c.generate(token_ids=prompts[i], max_new_tokens=25, **kinds[j]).token_ids
                except Exception as e:  # surfaced below
                    errors.append(e)

            threads = [threading.Thread(target=run, args=key) for key in solo]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        assert not errors
        assert together == solo


def test_each_proposers_rounds_add_up_to_the_generations(self_draft_cluster):
    """GenerationStats.by_proposer: each proposer that drafted, its rounds, drafts and accepted tokens; together
    they are the generation's (target-only rounds are under none)."""
    repetitive = PROMPT + PROMPT[1:] + PROMPT[1:]  # prompt lookup and suffix decoding find matches
    with Client(self_draft_cluster.address) as c:
        fixed = c.generate(token_ids=PROMPT, max_new_tokens=24, temperature=0.0, num_speculative_tokens=3,
                           proposer="draft").stats
        lookup = c.generate(token_ids=repetitive, max_new_tokens=24, temperature=0.0, num_speculative_tokens=3,
                            proposer="prompt_lookup").stats
        hybrid = c.generate(token_ids=repetitive, max_new_tokens=48, temperature=0.0).stats
    assert fixed["by_proposer"] == {"draft_model": {"rounds": fixed["rounds"], "draft_tokens": fixed["draft_tokens"],
                                                    "accepted_tokens": fixed["accepted_tokens"]}}
    assert set(lookup["by_proposer"]) == {"prompt_lookup"}
    for stats in (lookup, hybrid):
        parts = stats["by_proposer"].values()
        assert sum(p["rounds"] for p in parts) <= stats["rounds"]
        assert sum(p["draft_tokens"] for p in parts) == stats["draft_tokens"] > 0
        assert sum(p["accepted_tokens"] for p in parts) == stats["accepted_tokens"]
