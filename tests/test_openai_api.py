"""The OpenAI-compatible HTTP API, driven by the official `openai` client (and raw httpx where the wire
format itself is checked) against real uvicorn + gRPC servers on loopback: output equal to the gRPC
API's, usage, streaming with [DONE] and include_usage, errors with OpenAI's shape and the right status
(400, 401, 404, 429, 503), and a client disconnect mid-stream that frees the sessions on both tiers."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from coordinator.api.admission import AdmissionConfig
from specdec.core.proposer_names import NAMES, Proposer
from specdec.client import Client
from tests.helpers import Cluster
from tests.test_metrics import scrape, value

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

PROMPT = "Write a short story about a lighthouse keeper"


@pytest.fixture(scope="module")
def cluster(self_draft_cluster):
    return self_draft_cluster


def grpc_generate(cluster, **kw):
    with Client(cluster.address) as client:
        return client.generate(**kw)


def test_models_and_health(cluster, oai, model):
    assert [m.id for m in oai.models.list().data] == [model]
    r = httpx.get(cluster.http_url + "/health", timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_chat_equals_grpc_greedy_with_usage(cluster, oai, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    ref = grpc_generate(cluster, messages=messages, max_new_tokens=12, ignore_eos=True)
    r = oai.chat.completions.create(model=model, messages=messages, max_completion_tokens=12,
                                    extra_body={"ignore_eos": True, "num_speculative_tokens": 3, "proposer": "draft"})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == ref.stats["prompt_tokens"]
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12

    # streamed: the deltas add up to the same text; the role comes first; the finish reason last
    chunks = list(oai.chat.completions.create(model=model, messages=messages, max_tokens=12, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.usage is None for c in chunks)


def test_completion_stream_include_usage_and_done(cluster, oai, model):
    ref = grpc_generate(cluster, prompt=PROMPT, max_new_tokens=10, ignore_eos=True)
    r = oai.completions.create(model=model, prompt=PROMPT, max_tokens=10, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref.stats["prompt_tokens"], 10)

    # the raw wire: SSE events, a usage chunk with no choices, then data: [DONE]
    body = {"model": model, "prompt": PROMPT, "max_tokens": 10, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", cluster.http_url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line]
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    assert "".join(o["choices"][0]["text"] for o in objs if o["choices"]) == ref.text
    assert objs[-1]["choices"] == [] and objs[-1]["usage"]["completion_tokens"] == 10
    assert all(o["usage"] is None for o in objs[:-1])
    assert objs[-2]["choices"][0]["finish_reason"] == "length"

    # token-id prompts, as in the gRPC API
    ids = [int(x) for x in range(100, 110)]
    r = oai.completions.create(model=model, prompt=ids, max_tokens=6, extra_body={"ignore_eos": True})
    assert r.choices[0].text == grpc_generate(cluster, token_ids=ids, max_new_tokens=6, ignore_eos=True).text
    assert r.usage.prompt_tokens == len(ids)


def test_stop_strings_and_seeded_sampling(cluster, oai, model):
    ref = grpc_generate(cluster, prompt=PROMPT, max_new_tokens=16, ignore_eos=True)
    stop = ref.text[len(ref.text) // 2: len(ref.text) // 2 + 3]
    assert stop.strip(), "the reference must give a usable stop string"
    for s in (stop, [stop, "never-appears"]):
        r = oai.completions.create(model=model, prompt=PROMPT, max_tokens=16, stop=s, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].text == ref.text[: ref.text.index(stop)]
    # the same seed and K give the same sample (adaptive K would follow timings)
    spec = {"num_speculative_tokens": 2, "proposer": "draft"}
    sampled = [oai.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.9, top_p=0.95, seed=7,
                                      extra_body=spec).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]
    assert sampled[0] == grpc_generate(cluster, prompt=PROMPT, max_new_tokens=8, temperature=0.9, top_p=0.95, seed=7,
                                       **spec).text


def test_every_proposer_name_the_grpc_api_accepts(cluster, oai, model):
    """Each name and alias in the one table is accepted over HTTP, and runs that proposer: the output is
    the gRPC API's with the same proposer (greedy: the target's own), and the stats name the proposer."""
    for name in NAMES:
        proposer = Proposer.parse(name)
        ref = grpc_generate(cluster, prompt=PROMPT, max_new_tokens=6, ignore_eos=True, proposer=name)
        assert ref.stats["proposer"] == proposer.value
        r = oai.completions.create(model=model, prompt=PROMPT, max_tokens=6,
                                   extra_body={"ignore_eos": True, "proposer": name})
        assert r.choices[0].text == ref.text and r.usage.completion_tokens == 6, name


@pytest.mark.parametrize("kwargs, param", [
    ({"n": 0}, "n"),  # n > 1 is served (tests/test_openai_controls.py); out of range is not
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": 10**6}, None),  # over the server's cap: the shared validation's message
    ({"top_p": 1.5}, None),
    ({"extra_body": {"num_speculative_tokens": 99}}, None),
    ({"extra_body": {"proposer": "oracle"}}, "proposer"),
    ({"extra_body": {"not_a_field": 1}}, "not_a_field"),
    ({"presence_penalty": 2.5}, "presence_penalty"),  # out of [-2, 2]
    ({"logprobs": True, "top_logprobs": 25}, "top_logprobs"),  # over OpenAI's 20
])
def test_bad_requests_are_400_in_openai_shape(oai, model, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], **kwargs)
    err = e.value.body
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error" and err["message"]
    if param:
        assert err["param"] == param or param in err["message"], err


def test_more_bad_requests(cluster, oai, model):
    with pytest.raises(openai.BadRequestError, match="num_speculative_tokens"):
        oai.completions.create(model=model, prompt="hi", extra_body={"num_speculative_tokens": 99})
    with pytest.raises(openai.BadRequestError, match="role"):
        oai.chat.completions.create(model=model, messages=[{"role": "function", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="a batch of 9 prompts x n = 2 is 18 generations; at most 16"):
        oai.completions.create(model=model, prompt=["a"] * 9, n=2)
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="gpt-4o", prompt="hi")
    assert e.value.body["code"] == "model_not_found"
    r = httpx.post(cluster.http_url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(cluster.http_url + "/v1/nothing-here", json={})
    assert r.status_code == 404 and "error" in r.json()


def test_a_batch_of_prompts_gets_each_prompts_own_choices(cluster, oai, model):
    texts = [PROMPT, "The capital of France is"]
    refs = [grpc_generate(cluster, prompt=p, max_new_tokens=6, ignore_eos=True) for p in texts]
    r = oai.completions.create(model=model, prompt=texts, max_tokens=6, n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]  # OpenAI's numbering: prompt by prompt, n each
    assert [c.text for c in r.choices] == [refs[0].text] * 2 + [refs[1].text] * 2  # greedy: each as it alone gets
    assert r.usage.prompt_tokens == sum(ref.stats["prompt_tokens"] for ref in refs)  # each prompt once
    assert r.usage.completion_tokens == 24

    # token arrays, streamed with usage: each index's deltas are its prompt's text
    ids = [[1, 9690, 198, 2683, 359], [1, 4093, 198, 504]]
    refs = [grpc_generate(cluster, token_ids=p, max_new_tokens=5, ignore_eos=True) for p in ids]
    chunks = list(oai.completions.create(model=model, prompt=ids, max_tokens=5, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            text[choice.index] += choice.text
    assert text == {0: refs[0].text, 1: refs[1].text}
    assert chunks[-1].usage.prompt_tokens == 9 and chunks[-1].usage.completion_tokens == 10

    # sampled with a seed and a fixed K: a prompt in a batch draws what it draws alone
    kw = {"max_tokens": 8, "temperature": 1.0, "seed": 5, "extra_body": {"ignore_eos": True, "num_speculative_tokens": 2}}
    alone = oai.completions.create(model=model, prompt=texts[1], **kw).choices[0].text
    assert oai.completions.create(model=model, prompt=texts, **kw).choices[1].text == alone


def test_echo_puts_each_prompt_before_its_completion(cluster, oai, model):
    """echo (OpenAI's completions): the prompt, then the completion, whole or streamed; token ids echoed as their
    text; with logprobs, the prompt's tokens' first."""
    kw = {"max_tokens": 6, "extra_body": {"ignore_eos": True}}
    plain = oai.completions.create(model=model, prompt=PROMPT, **kw).choices[0].text
    assert oai.completions.create(model=model, prompt=PROMPT, echo=True, **kw).choices[0].text == PROMPT + plain
    chunks = list(oai.completions.create(model=model, prompt=PROMPT, echo=True, stream=True, **kw))
    assert chunks[0].choices[0].text == PROMPT and "".join(c.choices[0].text for c in chunks) == PROMPT + plain
    ids = [1, 9690, 198, 2683, 359]
    ref = grpc_generate(cluster, token_ids=ids, max_new_tokens=6, ignore_eos=True)
    text = cluster.pipeline.tokenizer.decode(ids)
    r = oai.completions.create(model=model, prompt=[ids, ids], n=1, echo=True, **kw)
    assert [c.text for c in r.choices] == [text + ref.text] * 2
    scored = oai.completions.create(model=model, prompt=PROMPT, echo=True, logprobs=1, **kw).choices[0]
    assert scored.text == PROMPT + plain  # with logprobs the prompt comes scored (tests/test_prompt_logprobs.py)
    lp, prompt_len = scored.logprobs, len(cluster.pipeline.tokenizer(PROMPT)["input_ids"])
    assert len(lp.tokens) == prompt_len + 6 and lp.token_logprobs[0] is None
    assert "".join(lp.tokens) == scored.text and lp.text_offset[-1] == len(scored.text) - len(lp.tokens[-1])


def test_client_disconnect_mid_stream_frees_sessions_on_both_tiers(cluster, model):
    before = scrape(cluster.metrics_url)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True,
            "num_speculative_tokens": 0}  # target-only: one token per round, a long stream
    with httpx.stream("POST", cluster.http_url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [line for line, _ in zip((l for l in lines if l.startswith("data: ")), range(3))]
        assert len(got) == 3
        assert cluster.status("target").num_sessions >= 1, "the generation must still be running"
    # the response is closed: the connection drops mid-stream
    cluster.wait_no_sessions()
    after = scrape(cluster.metrics_url)
    generated = value(after, "vllm:generation_tokens_total") - value(before, "vllm:generation_tokens_total")
    assert 3 <= generated < 900
    assert value(after, "vllm:request_success_total", finished_reason="abort") - \
        value(before, "vllm:request_success_total", finished_reason="abort") == 1


@pytest.fixture(scope="module")
def guarded(tiny_target):
    """A coordinator with a bearer token, one generation at a time, and a short target retry."""
    c = Cluster(tiny_target, tiny_target, coordinator_overrides={
        "auth_token": "s3cret-token", "admission": AdmissionConfig(max_concurrency=1), "tier_retry_s": 0.3})
    yield c
    c.close()


def test_auth_admission_and_unavailable_tier(guarded):
    c = guarded
    model = c.coordinator.frontend.model_name
    url = c.http_url + "/v1"
    msg = [{"role": "user", "content": "hi"}]
    assert httpx.get(c.http_url + "/health").status_code == 200  # probes need no token
    with openai.OpenAI(base_url=url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as e:
            bad.chat.completions.create(model=model, messages=msg, max_tokens=2)
        assert e.value.status_code == 401 and e.value.body["message"] == "invalid bearer token"
    r = httpx.post(url + "/chat/completions", json={"model": model, "messages": msg})  # no token at all
    assert r.status_code == 401 and "missing credentials" in r.json()["error"]["message"]
    assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(url + "/models").status_code == 401

    with openai.OpenAI(base_url=url, api_key="s3cret-token", max_retries=0, timeout=60) as oai:
        assert oai.chat.completions.create(model=model, messages=msg, max_tokens=2).usage.completion_tokens >= 1
        # one generation in flight (max_concurrency=1): a second one is refused with 429
        body = {"model": model, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True,
                "num_speculative_tokens": 0}
        with httpx.stream("POST", url + "/completions", json=body, timeout=60,
                          headers={"authorization": "Bearer s3cret-token"}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()  # (kept: dropping the iterator would close the response)
            next(lines)
            with pytest.raises(openai.RateLimitError) as e:
                oai.chat.completions.create(model=model, messages=msg, max_tokens=2)
            assert "max_concurrency" in e.value.body["message"]
        c.wait_no_sessions()
        before = scrape(c.metrics_url, token="s3cret-token")  # with a token set, /metrics asks for it
        c.stop_target()
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as e:
            oai.chat.completions.create(model=model, messages=msg, max_tokens=2)
        assert e.value.status_code == 503 and "target" in e.value.body["message"]
        assert time.monotonic() - t0 < 30
    after = scrape(c.metrics_url, token="s3cret-token")
    assert value(after, "specdec_rpc_errors_total", rpc="POST /v1/chat/completions", code="503") - \
        value(before, "specdec_rpc_errors_total", rpc="POST /v1/chat/completions", code="503") == 1
    assert value(after, "specdec_rpc_errors_total", rpc="POST /v1/chat/completions", code="401") == 2
    assert value(after, "specdec_rpc_errors_total", rpc="POST /v1/chat/completions", code="429") == 1


def test_client_gone_before_a_whole_answer_frees_sessions(cluster, model):
    """Not streamed: the client times out and closes the connection; the generation stops too."""
    before = scrape(cluster.metrics_url)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "num_speculative_tokens": 0}
    with pytest.raises(httpx.ReadTimeout):  # 0.1 s: the tiny model's 900 tokens can take as little as ~0.5 s
        httpx.post(cluster.http_url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.1))
    assert cluster.status("target").num_sessions >= 1, "the generation must still be running when the client leaves"
    cluster.wait_no_sessions()
    after = scrape(cluster.metrics_url)
    assert value(after, "vllm:generation_tokens_total") - value(before, "vllm:generation_tokens_total") < 900
    assert value(after, "vllm:request_success_total", finished_reason="abort") - \
        value(before, "vllm:request_success_total", finished_reason="abort") == 1


def test_an_answer_continues_a_prefilled_assistant_message(cluster, oai, model):
    """continue_final_message (vLLM's): the template renders the last (assistant's) message open and the answer is
    the continuation of exactly those tokens, as the gRPC API gives it for them; with add_generation_prompt, or a
    last message that is not the assistant's, a 400 naming it."""
    tok = cluster.coordinator.frontend.pipeline.tokenizer
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My answer is"}]
    ids = tok.apply_chat_template(messages, continue_final_message=True, tokenize=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    assert tok.decode(ids).endswith("My answer is")
    with Client(cluster.address) as client:
        want = client.generate(token_ids=ids, max_new_tokens=8, ignore_eos=True)
        got = client.generate(messages=messages, continue_final_message=True, max_new_tokens=8, ignore_eos=True)
    assert got.token_ids == want.token_ids and got.stats["prompt_tokens"] == len(ids)
    r = oai.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                    extra_body={"continue_final_message": True, "ignore_eos": True})
    assert r.choices[0].message.content == want.text and r.usage.prompt_tokens == len(ids)
    for extra, bad in (({"continue_final_message": True, "add_generation_prompt": True}, messages),
                       ({"continue_final_message": True}, messages[:1])):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=model, messages=bad, max_tokens=2, extra_body=extra)
        assert e.value.body["param"] == "continue_final_message", e.value.body


def test_include_stop_str_in_output_keeps_the_stop_string(oai, model):
    """vLLM's include_stop_str_in_output: the same answer cut at the same stop string, which it keeps."""
    kw = {"model": model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    whole = oai.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    stop = whole[6:9]
    assert stop and whole.index(stop) == 6
    cut = oai.completions.create(**kw, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    kept = oai.completions.create(**kw, stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert cut.text == whole[:6] and kept.choices[0].text == whole[:9]
    assert cut.finish_reason == kept.choices[0].finish_reason == "stop"


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(cluster, oai, model):
    """vLLM's truncate_prompt_tokens: the answer a prompt of its last k tokens gets; k < 1 a 400 naming it."""
    ids = [1, 9690, 198, 2683, 359, 504, 3937, 282]
    want = grpc_generate(cluster, token_ids=ids[-5:], max_new_tokens=6, ignore_eos=True)
    r = oai.completions.create(model=model, prompt=ids, max_tokens=6, extra_body={"truncate_prompt_tokens": 5,
                                                                                  "ignore_eos": True})
    assert r.choices[0].text == want.text and r.usage.prompt_tokens == 5
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt=ids, max_tokens=2, extra_body={"truncate_prompt_tokens": 0})
    assert e.value.body["param"] == "truncate_prompt_tokens"


def test_tokenize_and_detokenize_as_vllm_serves_them(cluster, oai, model):
    """/tokenize gives a prompt's ids as a request gets them (a chat's through the template: the usage's prompt
    tokens), /detokenize the text of ids; bad input a 400 naming the field, another model a 404."""
    tok = cluster.pipeline.tokenizer
    url = cluster.http_url
    r = httpx.post(url + "/tokenize", json={"model": model, "prompt": "Hello world"}, timeout=30).json()
    assert r["tokens"] == tok("Hello world")["input_ids"] and r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
    messages = [{"role": "user", "content": "Hi there"}]
    chat = httpx.post(url + "/tokenize", json={"messages": messages}, timeout=30).json()
    usage = oai.chat.completions.create(model=model, messages=messages, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens and tok.decode(chat["tokens"]).endswith("assistant\n")
    back = httpx.post(url + "/detokenize", json={"model": model, "tokens": r["tokens"]}, timeout=30).json()
    assert back == {"prompt": "Hello world"}
    for path, body, status, param in (("/tokenize", {"prompt": "a", "messages": messages}, 400, "prompt"),
                                      ("/detokenize", {"tokens": [10**7]}, 400, "tokens"),
                                      ("/detokenize", {"tokens": "x"}, 400, "tokens"),
                                      ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model")):
        bad = httpx.post(url + path, json=body, timeout=30)
        assert bad.status_code == status and bad.json()["error"]["param"] == param, bad.text
