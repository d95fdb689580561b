"""The real pretrained pair from ../shared/models through the real servers: greedy output equals the
GGUF target's own generate() token for token."""

import pytest
from transformers import AutoTokenizer

from specdec.client import Client
from specdec.models import load_model, load_tokenizer
from tests.helpers import Cluster, device_model, reference_greedy

pytestmark = pytest.mark.real_pair

QUESTIONS = ["Write a short poem about the sea.", "What is the capital of France? Answer in one sentence."]
MAX_NEW = 32


@pytest.fixture(scope="module")
def real_cluster(real_pair):
    target, draft = real_pair
    cluster = Cluster(target, draft, draft_quantize="auto")  # the draft as its service serves it by default
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def real_references(real_pair):
    target, _ = real_pair
    tok = load_tokenizer(target)
    model = load_model(device_model(target))
    refs = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        refs.append((q, list(ids), reference_greedy(model, list(ids), MAX_NEW, [tok.eos_token_id])))
    return refs


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_real_pair_greedy_equals_target_generate(real_cluster, real_references, k):
    accepted = proposed = 0
    with Client(real_cluster.address) as c:
        for question, prompt_ids, expected in real_references:
            out = c.generate(messages=[{"role": "user", "content": question}], max_new_tokens=MAX_NEW,
                             num_speculative_tokens=k, proposer="draft")
            assert out.stats["prompt_tokens"] == len(prompt_ids)  # chat template rendered like the reference
            assert out.token_ids == expected, f"K={k}: {question!r}"
            accepted += out.stats["accepted_tokens"]
            proposed += out.stats["draft_tokens"]
    # the distilled draft agrees with the target on ~30% of tokens: some, not all, drafts survive
    assert 0 < accepted < proposed


@pytest.mark.parametrize("proposer", ["lookup", "hybrid"])
def test_real_pair_greedy_with_lookup_proposers(real_cluster, real_references, proposer):
    with Client(real_cluster.address) as c:
        for question, _, expected in real_references:
            out = c.generate(messages=[{"role": "user", "content": question}], max_new_tokens=MAX_NEW, proposer=proposer)
            assert out.token_ids == expected, f"{proposer}: {question!r}"


CONCURRENT = ["Name three colours.", "Explain gravity to a child.", "Write a haiku about autumn.",
              "What is 12 times 7?", "Give me a tip for sleeping well.", "Describe a cat in two sentences.",
              "Why is the sky blue?", "Suggest a name for a goldfish."]


def test_real_pair_eight_concurrent_sessions_equal_their_solo_runs(real_cluster):
    """Batched in both tiers, eight sessions (K 1..4 and adaptive, draft and hybrid) give exactly their
    solo greedy outputs; the target's step counter shows the verifies were batched."""
    from concurrent.futures import ThreadPoolExecutor

    requests = [dict(messages=[{"role": "user", "content": q}], max_new_tokens=24,
                     num_speculative_tokens=[1, 2, 4, None][i % 4], proposer=["draft", "hybrid"][i % 2])
                for i, q in enumerate(CONCURRENT)]
    with Client(real_cluster.address) as c:
        solo = [c.generate(**r).token_ids for r in requests]
        steps_before = real_cluster.status("target").steps
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda r: c.generate(**r), requests))
        steps = real_cluster.status("target").steps - steps_before
    assert [o.token_ids for o in together] == solo
    assert steps < sum(o.stats["rounds"] for o in together), "the target batched no verifies"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_targets_own_low_precision_copy_as_draft_is_exact(real_pair, real_references, dtype):
    """The low-precision self-draft (draft service = the target at float16 / bfloat16): greedy output is
    still the float32 target's own, and the copy agrees with it far more than the distilled draft does."""
    target, _ = real_pair
    cluster = Cluster(target, target, draft_dtype=dtype)
    try:
        accepted = proposed = 0
        with Client(cluster.address) as c:
            for question, _, expected in real_references:
                out = c.generate(messages=[{"role": "user", "content": question}], max_new_tokens=MAX_NEW,
                                 num_speculative_tokens=3, proposer="draft")
                assert out.token_ids == expected, question
                accepted += out.stats["accepted_tokens"]
                proposed += out.stats["draft_tokens"]
        assert accepted > 0.8 * proposed, f"{dtype} self-draft acceptance {accepted}/{proposed}"
    finally:
        cluster.close()


def test_real_pair_seeded_sampling_is_reproducible(real_cluster):
    """A seed gives one output at a fixed K, at K = 0 and with the adaptive default (the keyed race)."""
    kw = dict(messages=[{"role": "user", "content": QUESTIONS[0]}], max_new_tokens=24, temperature=0.7, top_p=0.9,
              seed=2026)
    with Client(real_cluster.address) as c:
        a, b = c.generate(num_speculative_tokens=3, **kw), c.generate(num_speculative_tokens=3, **kw)
        alone, adaptive = c.generate(num_speculative_tokens=0, **kw), c.generate(**kw)
    assert a.token_ids == b.token_ids == alone.token_ids == adaptive.token_ids and len(a.token_ids) > 0


def test_refuses_a_pipeline_whose_tokenizers_differ(tiny_dir, tiny_target):
    from coordinator.pipeline import PipelineMismatch
    from specdec.models import make_tiny_model
    from tests.helpers import TOKENIZER_DIR

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    tok.add_tokens(["<specdec-extra-token>"])
    other = make_tiny_model(tiny_dir / "other-tokenizer", seed=3, tokenizer=tok)
    with pytest.raises(PipelineMismatch, match="tokenizer"):
        Cluster(tiny_target, other)
