"""Prompt logprobs (scoring a text: lm-eval's loglikelihood, OpenAI's completions with echo and logprobs): each
prompt token's log-probability after the first, and its top alternatives, equal the log-softmax of transformers'
own forward over the prompt at the position before it; over the target's wire (a prompt fed in several prefill
chunks, not taken from the prefix cache, beside plain requests in the same steps, with the verdict unchanged),
the gRPC API (max_new_tokens 0: the prompt alone; more: the output unchanged) and the OpenAI API (the official
`openai` client, whole and streamed, max_tokens 0 and 1 as lm-eval sends them)."""

from __future__ import annotations

import asyncio

import grpc
import openai
import pytest
import torch

from specdec.client import Client
from specdec.core.prefix import PrefixHashes
from specdec.proto import common_pb2, target_pb2, target_pb2_grpc
from tests.helpers import reference_greedy
from tests.test_tree_wire import target_cluster  # noqa: F401 (the target-only cluster fixture, per module)

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

TOP = 3


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(model, ids: list[int], top: int = TOP) -> list[tuple[int, float, list[int], list[float]]]:
    """transformers' forward over ids: for each token after the first, (token, logprob, top ids, top logprobs) under
    the log-softmax of the logits at the position before it."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids], device=model.device)).logits[0, :-1].float().cpu()
    lp = logits.log_softmax(dim=-1)
    vals, top_ids = lp.topk(top, dim=-1)
    chosen = lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return [(t, float(c), i, v) for t, c, i, v in zip(ids[1:], chosen.tolist(), top_ids.tolist(), vals.tolist())]


def assert_scores(got, want) -> None:
    """got: TokenLogprobs / TokenLogprob messages (or (token, logprob, ids, logprobs) tuples); want: reference()'s."""
    got = [g if isinstance(g, tuple) else (g.token_id, g.logprob, *_top(g)) for g in got]
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, lp, ids, vals), (_, wlp, wids, wvals) in zip(got, want):
        assert lp == pytest.approx(wlp, abs=2e-3)
        assert ids == wids
        assert vals == pytest.approx(wvals, abs=2e-3)


def _top(t) -> tuple[list[int], list[float]]:
    if hasattr(t, "top_token_ids"):  # the target's wire
        return list(t.top_token_ids), list(t.top_logprobs)
    return [a.token_id for a in t.top_logprobs], [a.logprob for a in t.top_logprobs]


def verify(sid: str, ids: list[int], drafts: list[int] = (), *, scored: bool = True, top: int = TOP,
           prefix: list[int] = ()) -> target_pb2.VerifyRequest:
    ctx = common_pb2.SessionContext(session_id=sid, prefix_len=len(prefix), new_tokens=ids,
                                    prefix_hash=PrefixHashes(list(prefix)).at(len(prefix)) if prefix else 0)
    return target_pb2.VerifyRequest(context=ctx, draft_tokens=drafts, sampling=common_pb2.SamplingParams(),
                                    logprobs=True, top_logprobs=top, prompt_logprobs=scored)


def call(cluster, requests):
    async def run():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{cluster.target_port}") as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            return await asyncio.gather(*(stub.Verify(r, timeout=60) for r in requests), return_exceptions=True)
    return asyncio.run(run())


def test_a_long_prompt_is_scored_over_its_chunks_and_the_verdict_is_unchanged(target_cluster, tiny_target_model):
    """300 tokens (three prefill chunks of 128) with three drafts, one wrong, beside a plain request of the same
    session shape in the same steps: every prompt token after the first scored as the plain forward scores it, and
    both verdicts (accepted count, next token, the committed tokens' logprobs) what a request without scoring gets."""
    ids = prompt(801, 300)
    assert target_cluster.target_tier.config.batch.prefill_chunk_tokens < len(ids)
    g = reference_greedy(tiny_target_model, ids, 3, None)
    drafts = [g[0], g[1], (g[2] + 29) % 40000 + 3]
    other = prompt(802, 40)
    scored, beside = call(target_cluster, [verify("score-long", ids, drafts), verify("score-beside", other, scored=False)])
    assert (scored.num_accepted, scored.next_token, scored.cached_len) == (2, g[2], len(ids) + 2)
    assert_scores(scored.prompt_logprobs, reference(tiny_target_model, ids))
    assert list(beside.prompt_logprobs) == []
    plain, alone = call(target_cluster, [verify("score-plain", ids, drafts, scored=False),
                                         verify("score-beside-alone", other, scored=False)])
    for a, b in ((scored, plain), (beside, alone)):
        assert (a.num_accepted, a.next_token, a.cached_len) == (b.num_accepted, b.next_token, b.cached_len)
        assert_scores(list(a.logprobs), [(t.token_id, t.logprob, *_top(t)) for t in b.logprobs])


def test_a_scored_prompt_is_not_taken_from_the_prefix_cache(target_cluster, tiny_target_model):
    """A fresh send that scores its prompt feeds every token though the prefix cache holds most of them (as a plain
    send of the same tokens shows), and the next round goes on from the cache it left."""
    ids = prompt(803, 70)
    call(target_cluster, [verify("score-donor", ids, scored=False)])
    (plain,) = call(target_cluster, [verify("score-reuser", ids, scored=False)])
    (r,) = call(target_cluster, [verify("score-fresh", ids, top=0)])
    assert plain.prefix_reused > 0 and r.prefix_reused == 0
    assert_scores(r.prompt_logprobs, reference(tiny_target_model, ids, top=0))
    g = reference_greedy(tiny_target_model, ids, 2, None)
    assert r.next_token == g[0]
    (after,) = call(target_cluster, [verify("score-fresh", [g[0]], scored=False, prefix=ids)])
    assert after.next_token == g[1] and list(after.prompt_logprobs) == []


@pytest.mark.parametrize("change, message", [
    (lambda r: r.context.MergeFrom(common_pb2.SessionContext(prefix_len=5, prefix_hash=PrefixHashes(
        prompt(804, 5)).at(5))), "prompt_logprobs: only on a full send"),
    (lambda r: setattr(r, "top_logprobs", 21), "top_logprobs must be in [0, 20]"),
])
def test_bad_prompt_logprobs_requests_are_refused(target_cluster, change, message):
    r = verify("score-bad", prompt(805, 12))
    change(r)
    (err,) = call(target_cluster, [r])
    assert isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.details()
    (ok,) = call(target_cluster, [verify("score-after-bad", prompt(806, 12))])  # the server is healthy
    assert len(ok.prompt_logprobs) == 11


PROMPT = [1, 504, 3937, 282, 4193, 314, 30, 2600, 28, 540, 29, 15, 216]


@pytest.mark.parametrize("max_new", [0, 12])
def test_grpc_generate_scores_the_prompt_first(random_draft_cluster, tiny_target_model, max_new):
    """max_new_tokens 0: the prompt's scores and a result, no token; 12: the same scores, then the output a request
    without them gets (greedy, the draft model at K = 3)."""
    with Client(random_draft_cluster.address) as client:
        out = client.generate(token_ids=PROMPT, max_new_tokens=max_new, prompt_logprobs=True, top_logprobs=TOP,
                              num_speculative_tokens=3, proposer="draft", ignore_eos=True)
        if max_new:
            plain = client.generate(token_ids=PROMPT, max_new_tokens=max_new, num_speculative_tokens=3,
                                    proposer="draft", ignore_eos=True)
            assert out.token_ids == plain.token_ids and out.logprobs == []
    assert list(out.prompt_logprobs.token_ids) == PROMPT
    assert_scores(out.prompt_logprobs.logprobs, reference(tiny_target_model, PROMPT))
    assert (out.finish_reason, out.stats["generated_tokens"], len(out.token_ids)) == ("length", max_new, max_new)


def test_grpc_generate_refuses_max_new_tokens_0_without_prompt_logprobs(random_draft_cluster):
    with Client(random_draft_cluster.address) as client:
        with pytest.raises(grpc.RpcError) as e:
            client.generate(token_ids=PROMPT, max_new_tokens=0)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_new_tokens must be in [1, " in e.value.details()


@pytest.fixture(scope="module")
def client(random_draft_cluster):
    return openai.OpenAI(base_url=random_draft_cluster.http_url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def model_name(random_draft_cluster):
    return random_draft_cluster.coordinator.frontend.model_name


def completion_scores(logprobs) -> list[tuple[int, float, list[int], list[float]]]:
    """A completions logprobs object's entries after the first, as (token text, logprob, top texts, logprobs)."""
    return [(t, lp, list(top), list(top.values())) for t, lp, top in
            zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:])]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_openai_echo_with_logprobs_scores_the_prompt(client, model_name, random_draft_cluster, tiny_target_model,
                                                     max_tokens):
    """As lm-eval's loglikelihood asks (a batch of token prompts, echo, logprobs 1, max_tokens 1, temperature 0;
    or max_tokens 0): each choice's logprobs start with its prompt's tokens, the first null, then the scores the
    plain forward gives, then (max_tokens 1) the generated token's; the text is the prompt's, then the completion."""
    tok = random_draft_cluster.coordinator.frontend.pipeline.tokenizer
    prompts = [PROMPT, PROMPT[:7]]
    r = client.completions.create(model=model_name, prompt=prompts, echo=True, logprobs=1, max_tokens=max_tokens,
                                  temperature=0)
    for choice, ids in zip(r.choices, prompts):
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + max_tokens and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = [(tok.decode([t]), v, [tok.decode([i]) for i in wi], wv)
                for t, v, wi, wv in reference(tiny_target_model, ids, top=1)]
        assert_scores(completion_scores(lp)[: len(ids) - 1], want)
        assert lp.text_offset[: 2] == [0, len(lp.tokens[0])]
        assert choice.text.startswith(tok.decode(ids))
        if max_tokens:
            g = reference_greedy(tiny_target_model, ids, 1, None)
            assert lp.tokens[-1] == tok.decode(g)
    assert r.usage.prompt_tokens == sum(len(p) for p in prompts) and r.usage.completion_tokens == 2 * max_tokens


def test_openai_echo_with_logprobs_streams_the_scored_prompt_first(client, model_name, random_draft_cluster,
                                                                  tiny_target_model):
    tok = random_draft_cluster.coordinator.frontend.pipeline.tokenizer
    chunks = list(client.completions.create(model=model_name, prompt=PROMPT, echo=True, logprobs=2, max_tokens=4,
                                            temperature=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text == tok.decode(PROMPT) and first.logprobs.token_logprobs[0] is None
    want = [(tok.decode([t]), v, [tok.decode([i]) for i in wi], wv)
            for t, v, wi, wv in reference(tiny_target_model, PROMPT, top=2)]
    assert_scores(completion_scores(first.logprobs), want)
    generated = [t for c in chunks[1:] if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert generated == [tok.decode([t]) for t in reference_greedy(tiny_target_model, PROMPT, 4, None)]


def test_openai_max_tokens_0_needs_echo_and_logprobs(client, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt=PROMPT, echo=True, max_tokens=0)
    assert "max_tokens 0 scores the prompt only" in str(e.value)


def vllm_entries(entries, tok, model, ids: list[int], top: int) -> None:
    """vLLM's prompt_logprobs: null, then per token {id: {logprob, rank, decoded_token}} for the token (its rank in
    the whole vocabulary) and its top alternatives (ranks 1..top), as the plain forward has them."""
    assert len(entries) == len(ids) and entries[0] is None
    with torch.inference_mode():
        lp = model(input_ids=torch.tensor([ids], device=model.device)).logits[0, :-1].float().cpu().log_softmax(-1)
    for j, entry in enumerate(entries[1:]):
        token = ids[j + 1]
        chosen = entry[str(token)]
        assert chosen["logprob"] == pytest.approx(float(lp[j, token]), abs=2e-3)
        assert chosen["rank"] == int((lp[j] > lp[j, token]).sum()) + 1 and chosen["decoded_token"] == tok.decode([token])
        alternatives = lp[j].topk(top).indices.tolist()
        assert set(entry) == {str(token), *map(str, alternatives)}
        for rank, t in enumerate(alternatives, 1):
            if t != token:
                assert entry[str(t)]["rank"] == rank and entry[str(t)]["logprob"] == pytest.approx(float(lp[j, t]), abs=2e-3)


def test_vllm_prompt_logprobs_on_completions(client, model_name, random_draft_cluster, tiny_target_model):
    """vLLM's extra field on completions: each choice's prompt_logprobs, without echo and with max_tokens 0 too; the
    generated tokens' logprobs keep their own count of alternatives."""
    tok = random_draft_cluster.coordinator.frontend.pipeline.tokenizer
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=0, extra_body={"prompt_logprobs": 2})
    (choice,) = r.choices
    assert choice.text == "" and choice.logprobs is None and r.usage.completion_tokens == 0
    vllm_entries(choice.model_extra["prompt_logprobs"], tok, tiny_target_model, PROMPT, top=2)
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=3, logprobs=1, temperature=0,
                                  extra_body={"prompt_logprobs": 4})
    assert [len(alts) for alts in r.choices[0].logprobs.top_logprobs] == [1, 1, 1]
    vllm_entries(r.choices[0].model_extra["prompt_logprobs"], tok, tiny_target_model, PROMPT, top=4)


def test_vllm_prompt_logprobs_on_chat_whole_and_streamed(client, model_name, random_draft_cluster, tiny_target_model):
    """vLLM's chat form: the prompt (the rendered template) scored at the top level of the response, or of the
    stream's first chunk, which also announces the role; the answer is the one a request without it gets."""
    tok = random_draft_cluster.coordinator.frontend.pipeline.tokenizer
    messages = [{"role": "user", "content": "Tell me about lighthouses"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    kw = {"model": model_name, "messages": messages, "max_tokens": 6, "temperature": 0}
    plain = client.chat.completions.create(**kw).choices[0].message.content
    r = client.chat.completions.create(**kw, extra_body={"prompt_logprobs": 1})
    assert r.choices[0].message.content == plain
    vllm_entries(r.model_extra["prompt_logprobs"], tok, tiny_target_model, ids, top=1)
    chunks = list(client.chat.completions.create(**kw, stream=True, extra_body={"prompt_logprobs": 1}))
    assert chunks[0].choices[0].delta.role == "assistant"
    vllm_entries(chunks[0].model_extra["prompt_logprobs"], tok, tiny_target_model, ids, top=1)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain


def test_vllm_prompt_logprobs_out_of_range_is_refused(client, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 21})
    assert "prompt_logprobs must be in [0, 20]" in str(e.value)
