"""logprobs / top_logprobs and n > 1 through real servers: every committed token's log-probability (accepted
drafts, corrections and bonus tokens alike) and its top alternatives equal what the target alone reports at
that position (a one-token reference loop over the model: tests/controls_reference.py), over the gRPC API and
the OpenAI API (the official `openai` client, streamed and whole); n choices as n generations with seeds
seed + i; the OpenAI API's penalties and logit_bias equal the gRPC API's."""

from __future__ import annotations

import math

import openai
import pytest

from specdec.client import Client
from specdec.math.params import SamplingParams
from tests.controls_reference import reference_greedy_processed, reference_logprobs

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

PROMPT = [1, 504, 3937, 282, 4193, 314, 30, 2600, 28, 540, 29, 15, 216]
MAX_NEW = 16
TOP = 4


@pytest.fixture(scope="module")
def cluster(self_draft_cluster):
    return self_draft_cluster


@pytest.fixture(scope="module")
def tokenizer(self_draft_cluster):
    return self_draft_cluster.coordinator.frontend.pipeline.tokenizer


def assert_logprobs_equal(got, expected):
    """got: [(logprob, top ids, top logprobs)] from a server; expected: the reference loop's."""
    assert len(got) == len(expected)
    for (lp, ids, vals), (elp, eids, evals) in zip(got, expected):
        assert lp == pytest.approx(elp, abs=2e-3)
        assert ids == eids
        assert vals == pytest.approx(evals, abs=2e-3)


def grpc_logprobs(out):
    return [(t.logprob, [a.token_id for a in t.top_logprobs], [a.logprob for a in t.top_logprobs]) for t in out.logprobs]


CASES = [
    pytest.param(SamplingParams(), {}, id="greedy"),
    pytest.param(SamplingParams(presence_penalty=-2.0, logit_bias=((1000, 3.0),)), {}, id="greedy-penalised"),
    pytest.param(SamplingParams(temperature=0.8, frequency_penalty=-0.5), {"seed": 3}, id="sampled-penalised"),
]


@pytest.mark.parametrize("params, extra", CASES)
@pytest.mark.parametrize("proposer, k", [("draft", 3), ("lookup", 2), ("draft", 0)])
def test_grpc_logprobs_equal_the_target_alone(self_draft_cluster, random_draft_cluster, tiny_target_model,
                                              params, extra, proposer, k):
    """The self-draft's rounds commit accepted drafts plus a bonus; the random draft's mostly corrections."""
    kwargs = dict(temperature=params.temperature, presence_penalty=params.presence_penalty,
                  frequency_penalty=params.frequency_penalty, logit_bias=dict(params.logit_bias), **extra)
    for cluster in (self_draft_cluster, random_draft_cluster):
        with Client(cluster.address) as client:
            out = client.generate(token_ids=PROMPT, max_new_tokens=MAX_NEW, num_speculative_tokens=k, proposer=proposer,
                                  logprobs=True, top_logprobs=TOP, ignore_eos=True, **kwargs)
            plain = client.generate(token_ids=PROMPT, max_new_tokens=MAX_NEW, num_speculative_tokens=k,
                                    proposer=proposer, ignore_eos=True, **kwargs)
        assert out.token_ids == plain.token_ids  # asking for logprobs changes no output
        assert [t.token_id for t in out.logprobs] == out.token_ids
        expected = reference_logprobs(tiny_target_model, PROMPT, out.token_ids, params, TOP)
        assert_logprobs_equal(grpc_logprobs(out), expected)
        if params.greedy:  # the greedy token is the most likely under the reported distribution
            assert all(t.token_id == t.top_logprobs[0].token_id for t in out.logprobs)


def test_openai_chat_logprobs_whole_and_streamed(oai, model, tokenizer, tiny_target_model):
    messages = [{"role": "user", "content": "Tell me about lighthouses"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
    params = SamplingParams(frequency_penalty=-1.0)
    ids = reference_greedy_processed(tiny_target_model, prompt, MAX_NEW, params, eos=None)
    expected = reference_logprobs(tiny_target_model, prompt, ids, params, TOP)
    r = oai.chat.completions.create(model=model, messages=messages, max_tokens=MAX_NEW, logprobs=True, top_logprobs=TOP,
                                    frequency_penalty=-1.0, extra_body={"ignore_eos": True, "num_speculative_tokens": 3})
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in ids]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    got = [(c.logprob, [tokenizer.decode([i]) for i in e[1]], [a.logprob for a in c.top_logprobs]) for c, e in zip(content, expected)]
    assert [[a.token for a in c.top_logprobs] for c in content] == [g[1] for g in got]
    assert_logprobs_equal([(g[0], e[1], g[2]) for g, e in zip(got, expected)], expected)
    chunks = list(oai.chat.completions.create(model=model, messages=messages, max_tokens=MAX_NEW, logprobs=True,
                                              top_logprobs=TOP, frequency_penalty=-1.0, stream=True,
                                              extra_body={"ignore_eos": True, "num_speculative_tokens": 3}))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=2e-3)  # other batches
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == r.choices[0].message.content
    # without logprobs: none in the response
    r = oai.chat.completions.create(model=model, messages=messages, max_tokens=4)
    assert r.choices[0].logprobs is None


def test_openai_completion_logprobs(oai, model, tokenizer, tiny_target_model):
    ids = reference_greedy_processed(tiny_target_model, PROMPT, MAX_NEW, SamplingParams(), eos=None)
    expected = reference_logprobs(tiny_target_model, PROMPT, ids, SamplingParams(), TOP)
    r = oai.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_NEW, logprobs=TOP,
                               extra_body={"ignore_eos": True, "proposer": "lookup"})
    lp = r.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs == pytest.approx([e[0] for e in expected], abs=2e-3)
    assert [list(d.keys()) for d in lp.top_logprobs] == [[tokenizer.decode([i]) for i in e[1]] for e in expected]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert "".join(lp.tokens) == r.choices[0].text
    r = oai.completions.create(model=model, prompt=PROMPT, max_tokens=3, logprobs=0)  # the chosen token's only
    assert all(d == {} for d in r.choices[0].logprobs.top_logprobs) and len(r.choices[0].logprobs.token_logprobs) == 3


def test_n_choices_are_n_generations_with_derived_seeds(self_draft_cluster, oai, model):
    # a fixed K and proposer: sampled output is then reproducible from the seed
    kw = dict(max_tokens=8, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True, "num_speculative_tokens": 3, "proposer": "draft"})
    r = oai.completions.create(model=model, prompt=PROMPT, n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    with Client(self_draft_cluster.address) as client:
        singles = [client.generate(token_ids=PROMPT, max_new_tokens=8, temperature=1.0, seed=7 + i, ignore_eos=True,
                                   num_speculative_tokens=3, proposer="draft").text
                   for i in range(3)]
    assert [c.text for c in r.choices] == singles
    assert len(set(singles)) > 1  # the seeds differ, so do the samples
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(PROMPT)
    # streamed: each choice's deltas, by index, add up to its text; one finish per choice
    chunks = list(oai.completions.create(model=model, prompt=PROMPT, n=3, stream=True,
                                         stream_options={"include_usage": True}, **kw))
    texts, finishes = ["", "", ""], [None] * 3
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.text
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == singles and finishes == ["length"] * 3
    assert chunks[-1].usage.completion_tokens == 24
    # chat, greedy: n identical choices
    r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=6)
    assert len(r.choices) == 2 and r.choices[0].message.content == r.choices[1].message.content
    self_draft_cluster.wait_no_sessions()  # every choice's sessions were ended


def test_openai_penalties_and_logit_bias_equal_grpc(self_draft_cluster, oai, model, tokenizer):
    body = dict(presence_penalty=-2.0, frequency_penalty=0.3, logit_bias={"1000": 5.0, "7": -100.0})
    extra = {"ignore_eos": True, "repetition_penalty": 1.2, "min_p": 0.1}
    extra.update(num_speculative_tokens=2, proposer="draft")  # reproducible from the seed
    r = oai.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0.9, seed=5,
                               extra_body=extra, **body)
    with Client(self_draft_cluster.address) as client:
        ref = client.generate(token_ids=PROMPT, max_new_tokens=MAX_NEW, temperature=0.9, seed=5, ignore_eos=True,
                              num_speculative_tokens=2, proposer="draft",
                              presence_penalty=-2.0, frequency_penalty=0.3, logit_bias={1000: 5.0, 7: -100.0},
                              repetition_penalty=1.2, min_p=0.1)
    assert r.choices[0].text == ref.text
    for kwargs, param in [({"logit_bias": {"abc": 1.0}}, "logit_bias"), ({"logit_bias": {"999999": 1.0}}, "logit_bias"),
                          ({"extra_body": {"min_p": 2.0}}, "min_p"), ({"n": 17}, "n"),
                          ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty")]:
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(model=model, prompt=PROMPT, max_tokens=2, **kwargs)
        assert e.value.body["param"] == param or param in e.value.body["message"], e.value.body
    assert not math.isnan(oai.completions.create(model=model, prompt=PROMPT, max_tokens=1, logprobs=1)
                          .choices[0].logprobs.token_logprobs[0])
