"""min_tokens (coordinator.min_tokens, vLLM's): the masks, case by case; then through real servers the output equals
transformers' generate with min_new_tokens (the target's own under the same rule), greedy, for the coordinator's
proposers, where the greedy answer would end sooner; and bad values are 400s / INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import grpc
import openai
import pytest
import torch

from coordinator.min_tokens import MinTokens
from coordinator.proposers.base import Proposal
from specdec.client import Client
from specdec.core.proposer_names import DRAFT_MODEL
from specdec.models import load_model, make_tiny_model
from tests.helpers import Cluster, device_model, reference_greedy

V = 64
EOS, STOP = 2, 9


def allowed(mask: bytes, t: int) -> bool:
    return bool(mask[t // 8] >> (t % 8) & 1)


def test_masks_refuse_the_end_until_the_output_is_long_enough():
    c = MinTokens(3, {EOS, STOP}, V)
    p, masks = c.check(Proposal(DRAFT_MODEL, [5, 6, 7, 8], run_on=4), greedy=True)
    assert p.tokens == [5, 6, 7, 8] and p.run_on == 0 and len(masks) == 5
    assert [allowed(m, EOS) or allowed(m, STOP) for m in masks] == [False, False, False, True, True]
    assert all(allowed(m, t) for m in masks for t in range(V) if t not in (EOS, STOP))
    c.commit([5, 6])  # one position left before the end is allowed
    p, masks = c.check(Proposal(DRAFT_MODEL, [7, EOS, 8]), greedy=True)
    assert p.tokens == [7, EOS, 8] and [allowed(m, EOS) for m in masks] == [False, True, True, True]
    p, masks = c.check(Proposal(DRAFT_MODEL, [EOS, 8]), greedy=True)  # greedy: cut at a refused draft
    assert p.tokens == [] and len(masks) == 1
    c.commit([7])
    assert c.check(Proposal(DRAFT_MODEL, [EOS], run_on=3), greedy=True) == (Proposal(DRAFT_MODEL, [EOS], run_on=3), [])


def test_a_sampled_chain_is_kept_and_a_tree_masked_by_depth():
    c = MinTokens(2, {EOS}, V)
    q = [object(), object()]  # (a sampled draft's rows: a refused draft is kept, the target rejects it)
    p, masks = c.check(Proposal(DRAFT_MODEL, [EOS, 4], q=q), greedy=False)
    assert p.tokens == [EOS, 4] and [allowed(m, EOS) for m in masks] == [False, False, True]
    p, masks = c.check(Proposal(DRAFT_MODEL, [4, 5, 6, EOS], parents=[-1, -1, 0, 2]), greedy=True)
    assert [allowed(m, EOS) for m in masks] == [False, False, False, True, True]  # root, depths 1, 1, 2, 3


@pytest.fixture(scope="module")
def ending(tmp_path_factory, tiny_target_model):
    """(a cluster whose target declares a token of its greedy answer to PROMPT EOS, that target, the index)."""
    ref = reference_greedy(tiny_target_model, PROMPT, 24, None)
    idx = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i] and ref[i] != 2)
    path = make_tiny_model(tmp_path_factory.mktemp("min-tokens") / "target", seed=0, eos_token_ids=[2, ref[idx]])
    cluster = Cluster(path, path)
    yield cluster, load_model(device_model(path)), idx
    cluster.close()


PROMPT = [1, 504, 3937, 282, 4193, 314, 30]


def reference(model, least: int, max_new: int) -> list[int]:
    eos = list(model.generation_config.eos_token_id) if isinstance(model.generation_config.eos_token_id, list) \
        else [model.generation_config.eos_token_id]
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                             max_new_tokens=max_new, min_new_tokens=least, do_sample=False, eos_token_id=eos,
                             pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


@pytest.mark.servers
@pytest.mark.parametrize("proposer, k", [("draft", 3), ("draft", None), ("suffix", 2)])
def test_greedy_with_min_tokens_is_the_targets_own(ending, proposer, k):
    cluster, model, idx = ending
    least = idx + 4
    want = reference(model, least, 24)
    assert len(want) > least  # the rule moved the end: the answer without it ends at idx
    with Client(cluster.address) as client:
        plain = client.generate(token_ids=PROMPT, max_new_tokens=24, num_speculative_tokens=k, proposer=proposer)
        out = client.generate(token_ids=PROMPT, max_new_tokens=24, num_speculative_tokens=k, proposer=proposer,
                              min_tokens=least)
    assert len(plain.token_ids) == idx + 1 and plain.finish_reason == "eos"
    assert out.token_ids == want and len(out.token_ids) >= least


@pytest.mark.servers
def test_min_tokens_through_the_openai_api_and_bad_values(ending):
    cluster, model, idx = ending
    oai = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="x", max_retries=0)
    name = cluster.coordinator.frontend.model_name
    with Client(cluster.address) as client:
        want = client.generate(token_ids=PROMPT, max_new_tokens=24, min_tokens=idx + 4)
        with pytest.raises(grpc.RpcError) as e:
            client.generate(token_ids=PROMPT, max_new_tokens=4, min_tokens=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_tokens must be in [0, " in e.value.details()
    r = oai.completions.create(model=name, prompt=PROMPT, max_tokens=24, extra_body={"min_tokens": idx + 4})
    assert r.choices[0].text == want.text and r.usage.completion_tokens == len(want.token_ids)
    for extra in ({"min_tokens": -1}, {"min_tokens": 2, "guided_regex": "a+"}):
        with pytest.raises(openai.BadRequestError) as bad:
            oai.completions.create(model=name, prompt=PROMPT, max_tokens=4, extra_body=extra)
        assert bad.value.body["param"] == "min_tokens", bad.value.body
