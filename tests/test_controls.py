"""The sampling controls through real servers: greedy output with penalties / logit_bias equals the target
alone with the same processing (transformers' generate with its own logits processors where they have the
same semantics: repetition_penalty, sequence_bias; our math in a plain one-token loop for the rest), for
every proposer, several K and batched; bad values are INVALID_ARGUMENT naming the field before any token."""

from __future__ import annotations

import concurrent.futures
import functools

import grpc
import pytest
import torch

from specdec.client import Client
from specdec.math.params import SamplingParams
from specdec.proto import common_pb2, generate_pb2, target_pb2
from tests.controls_reference import reference_greedy_processed as _reference

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

PROMPT = [1, 504, 3937, 282, 4193, 314, 30, 2600, 28, 540, 29, 15, 216]
MAX_NEW = 24
CONTROLS = [
    SamplingParams(presence_penalty=-2.0),
    SamplingParams(frequency_penalty=-0.8, presence_penalty=0.5),
    SamplingParams(frequency_penalty=-1.0, repetition_penalty=1.3, logit_bias=((1000, 4.0), (7, -100.0)), min_p=0.3),
]


@functools.lru_cache(maxsize=None)
def _cached_reference(model, prompt: tuple[int, ...], max_new: int, params: SamplingParams) -> list[int]:
    return _reference(model, list(prompt), max_new, params)


def reference_greedy_processed(model, prompt, max_new, params) -> list[int]:
    """The target alone with the controls (a one-token loop), each case computed once per run."""
    return list(_cached_reference(model, tuple(prompt), max_new, params))


def hf_generate(model, prompt, max_new, **kw) -> list[int]:
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt], device=model.device),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
                             max_new_tokens=max_new, do_sample=False, eos_token_id=[2], pad_token_id=2, **kw)
    ids = out[0, len(prompt):].tolist()
    return ids[: ids.index(2) + 1] if 2 in ids else ids


def test_the_controls_change_the_output(tiny_target_model):
    """The cases below are not vacuous: each control changes the tiny target's greedy output (a random model
    rarely repeats a token unasked, so the presence / frequency cases encourage repeats with negative values)."""
    plain = hf_generate(tiny_target_model, PROMPT, MAX_NEW)
    assert hf_generate(tiny_target_model, PROMPT, MAX_NEW, repetition_penalty=1.5) != plain
    for i, params in enumerate(CONTROLS):
        out = reference_greedy_processed(tiny_target_model, PROMPT, MAX_NEW, params)
        assert out != plain, params
        if i < 2:  # and the output counts matter: tokens repeat
            assert len(set(out)) < len(out), params


@pytest.mark.parametrize("proposer, k", [("draft", 1), ("draft", 4), ("lookup", 3), ("hybrid", None)])
@pytest.mark.parametrize("cluster_name", ["self_draft_cluster", "random_draft_cluster"])
def test_repetition_penalty_and_logit_bias_equal_transformers(request, tiny_target_model, cluster_name, proposer, k):
    cluster = request.getfixturevalue(cluster_name)
    plain = hf_generate(tiny_target_model, PROMPT, MAX_NEW)
    bias = {plain[1]: -100.0, 1000: 5.0}  # forbid the second greedy token, favour another
    with Client(cluster.address) as client:
        out = client.generate(token_ids=PROMPT, max_new_tokens=MAX_NEW, num_speculative_tokens=k, proposer=proposer,
                              repetition_penalty=1.5)
        assert out.token_ids == hf_generate(tiny_target_model, PROMPT, MAX_NEW, repetition_penalty=1.5)
        out = client.generate(token_ids=PROMPT, max_new_tokens=MAX_NEW, num_speculative_tokens=k, proposer=proposer,
                              logit_bias=bias)
        expected = hf_generate(tiny_target_model, PROMPT, MAX_NEW, sequence_bias={(t,): b for t, b in bias.items()})
        assert out.token_ids == expected and expected != plain




def _kwargs(p: SamplingParams) -> dict:
    return dict(presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                repetition_penalty=p.repetition_penalty, min_p=p.min_p, logit_bias=dict(p.logit_bias))


@pytest.mark.parametrize("params", CONTROLS)
@pytest.mark.parametrize("proposer, k", [("draft", 1), ("draft", 5), ("lookup", 4), ("suffix", None), ("draft", 0)])
def test_penalties_greedy_equal_the_target_alone(self_draft_cluster, random_draft_cluster, tiny_target_model,
                                                 params, proposer, k):
    expected = reference_greedy_processed(tiny_target_model, PROMPT, MAX_NEW, params)
    for cluster in (self_draft_cluster, random_draft_cluster):
        with Client(cluster.address) as client:
            out = client.generate(token_ids=PROMPT, max_new_tokens=MAX_NEW, num_speculative_tokens=k,
                                  proposer=proposer, **_kwargs(params))
        assert out.token_ids == expected, (proposer, k)
        if cluster is self_draft_cluster and proposer == "draft" and k:  # q processed exactly as p: all accepted
            assert out.stats["accepted_tokens"] == out.stats["draft_tokens"] > 0


def test_penalised_sessions_batched_with_others(self_draft_cluster, tiny_target_model):
    """Sessions with different controls (and none) verified in the same steps each get their own output."""
    prompts = [PROMPT, PROMPT[:7], PROMPT[3:]]
    cases = [(p, c) for p in prompts for c in (SamplingParams(), *CONTROLS)]
    expected = [reference_greedy_processed(tiny_target_model, p, MAX_NEW, c) for p, c in cases]

    def run(case):
        prompt, params = case
        with Client(self_draft_cluster.address) as client:
            return client.generate(token_ids=prompt, max_new_tokens=MAX_NEW, num_speculative_tokens=3,
                                   proposer="draft", **_kwargs(params)).token_ids

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        assert list(pool.map(run, cases)) == expected


@pytest.mark.parametrize("field, value, words", [
    ("presence_penalty", 2.5, ["presence_penalty", "[-2, 2]"]),
    ("frequency_penalty", -3.0, ["frequency_penalty"]),
    ("repetition_penalty", 0.0, ["repetition_penalty", "(0, 2]"]),
    ("min_p", 1.5, ["min_p", "[0, 1]"]),
    ("logit_bias", {10**6: 1.0}, ["logit_bias", "1000000", "vocabulary"]),
    ("logit_bias", {5: 150.0}, ["logit_bias", "[-100, 100]"]),
    ("top_logprobs", 21, ["top_logprobs", "20"]),
])
def test_bad_controls_are_invalid_argument_before_any_token(generation_stub, field, value, words):
    req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=PROMPT), max_new_tokens=4, logprobs=True)
    if isinstance(value, dict):
        req.logit_bias.update(value)
    else:
        setattr(req, field, value)
    events = []
    with pytest.raises(grpc.RpcError) as e:
        for ev in generation_stub.Generate(req, timeout=30):
            events.append(ev)
    assert events == [] and e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for w in words:
        assert w in e.value.details(), e.value.details()


@pytest.mark.parametrize("sampling, words", [
    (common_pb2.SamplingParams(presence_penalty=9), ["sampling.presence_penalty"]),
    (common_pb2.SamplingParams(logit_bias={99999: 1.0}), ["sampling.logit_bias", "99999"]),
    (common_pb2.SamplingParams(min_p=-1), ["sampling.min_p"]),
    (common_pb2.SamplingParams(prompt_len=99), ["sampling.prompt_len"]),
])
def test_tiers_refuse_bad_controls(target_stub, draft_stub, sampling, words):
    from specdec.proto import draft_pb2
    context = common_pb2.SessionContext(session_id="controls-bad", new_tokens=PROMPT)
    for call, req in ((target_stub.Verify, target_pb2.VerifyRequest(context=context, draft_tokens=[5], sampling=sampling)),
                      (draft_stub.Propose, draft_pb2.ProposeRequest(context=context, num_tokens=2, sampling=sampling))):
        with pytest.raises(grpc.RpcError) as e:
            call(req, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        for w in words:
            assert w in e.value.details(), e.value.details()
    # the tier stays healthy
    ok = target_stub.Verify(target_pb2.VerifyRequest(context=context, draft_tokens=[5],
                                                     sampling=common_pb2.SamplingParams(frequency_penalty=1.0)), timeout=30)
    assert ok.num_accepted in (0, 1)
    target_stub.EndSession(common_pb2.EndSessionRequest(session_id="controls-bad"), timeout=30)  # the cluster is shared
