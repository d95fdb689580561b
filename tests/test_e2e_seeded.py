"""A seed fixes a sampled request's output through the real servers, whatever was proposed (specdec.math.race):
K = 0, a fixed K from the draft model, prompt lookup or suffix decoding, the adaptive default, token trees, the draft
tier's direct rounds, other sessions' traffic in between, and the OpenAI API give the same tokens. The draft races
the target's own keys, so a draft equal to the target is accepted almost always."""

import openai
import pytest

from specdec.client import Client
from tests.helpers import Cluster

pytestmark = pytest.mark.servers  # in-process servers (make test, not make test-fast)

PROMPT = [1, 504, 3937, 282, 4193, 314, 30, 2600, 28]
SAMPLING = dict(temperature=0.9, top_k=20)  # (q's support inside the draft's top-64 truncation: a self-draft's q is p)


@pytest.fixture(scope="module")
def direct_self_cluster(tiny_target):
    """The target as its own draft, its fixed-K draft-model sessions run by the draft tier (direct rounds)."""
    cluster = Cluster(tiny_target, tiny_target, direct=True)
    yield cluster
    cluster.close()


def test_a_seed_gives_one_output_whatever_was_proposed(self_draft_cluster, random_draft_cluster, direct_self_cluster):
    kw = dict(token_ids=PROMPT, max_new_tokens=40, ignore_eos=True, seed=1234, **SAMPLING)
    with Client(self_draft_cluster.address) as c:
        alone = c.generate(num_speculative_tokens=0, **kw)
        runs = {f"draft K={k}": c.generate(num_speculative_tokens=k, proposer="draft", **kw) for k in (1, 3, 6)}
        runs["adaptive"] = c.generate(**kw)
        runs["draft tree"] = c.generate(num_speculative_tokens=3, num_speculative_nodes=6, proposer="draft", **kw)
        runs["suffix K=4"] = c.generate(num_speculative_tokens=4, proposer="suffix", **kw)
        runs["lookup tree"] = c.generate(num_speculative_tokens=4, num_speculative_nodes=8, proposer="lookup", **kw)
        for seed in range(3):  # other sessions' traffic: the shared suffix tree and priors learn from it
            c.generate(**{**kw, "seed": seed})
        runs["adaptive, later"] = c.generate(**kw)
        other = c.generate(**{**kw, "seed": 99})
    with Client(random_draft_cluster.address) as c:
        runs["random draft K=3"] = c.generate(num_speculative_tokens=3, proposer="draft", **kw)
    with Client(direct_self_cluster.address) as c:
        runs["direct K=4"] = direct = c.generate(num_speculative_tokens=4, proposer="draft", **kw)
    assert len(alone.token_ids) == 40 and alone.token_ids != other.token_ids
    assert {name: run.token_ids for name, run in runs.items()} == {name: alone.token_ids for name in runs}
    assert direct.stats["direct_rounds"] == direct.stats["rounds"] > 0
    # The self-draft races the target's keys over q = p: nearly every draft is the target's token
    assert runs["draft K=3"].stats["acceptance_rate"] > 0.9 and direct.stats["acceptance_rate"] > 0.9
    assert runs["draft K=3"].stats["rounds"] <= 14


def test_the_openai_api_gives_a_seeds_output(self_draft_cluster):
    """The seed of the OpenAI API is the same key: completions with a seed give the gRPC request's tokens, streamed
    or not; with n = 2 choice i samples with seed + i."""
    with Client(self_draft_cluster.address) as c:
        grpc_text = [c.generate(token_ids=PROMPT, max_new_tokens=24, ignore_eos=True, seed=s, **SAMPLING).text
                     for s in (77, 78)]
    oai = openai.OpenAI(base_url=self_draft_cluster.http_url + "/v1", api_key="x", max_retries=0)
    ask = dict(model=self_draft_cluster.coordinator.frontend.model_name, prompt=PROMPT, max_tokens=24, seed=77,
               temperature=SAMPLING["temperature"], extra_body={"top_k": SAMPLING["top_k"], "ignore_eos": True})
    assert [ch.text for ch in oai.completions.create(n=2, **ask).choices] == grpc_text
    streamed = "".join(chunk.choices[0].text for chunk in oai.completions.create(stream=True, **ask) if chunk.choices)
    assert streamed == grpc_text[0]
