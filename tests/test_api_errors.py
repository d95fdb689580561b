"""The OpenAI-compatible API's errors in its own words, and a finish that says what ended a generation,
through the official `openai` client and raw httpx against a real cluster: a parameter out of range is
named as the request named it (max_tokens / max_completion_tokens, top_p, messages[i].role) in `param`
and in the message; a body that is not JSON gets its line and column; a generation cut short by the
model's context says so (finish_details), and /v1/models, `specdec info` and the validator agree on the
context."""

from __future__ import annotations

import httpx
import openai
import pytest

from specdec.client import Client

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

CONTEXT = 1024  # the tiny models' max_position_embeddings (tests/helpers.make_tiny_model)


@pytest.fixture(scope="module")
def cluster(self_draft_cluster):
    return self_draft_cluster


def bad_request(call) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.status_code == 400
    return e.value.body


def test_parameters_are_named_as_the_request_named_them(cluster, oai, model):
    cap = cluster.coordinator.frontend.config.max_new_tokens_cap
    chat = [{"role": "user", "content": "Hi"}]
    err = bad_request(lambda: oai.completions.create(model=model, prompt="Hi", max_tokens=cap + 1))
    assert err["param"] == "max_tokens" and err["type"] == "invalid_request_error"
    assert err["message"] == f"max_tokens must be in [1, {cap}], got {cap + 1}"
    err = bad_request(lambda: oai.chat.completions.create(model=model, messages=chat, max_tokens=cap + 1))
    assert err["param"] == "max_tokens" and "max_new_tokens" not in err["message"]
    err = bad_request(lambda: oai.chat.completions.create(model=model, messages=chat, max_completion_tokens=cap + 1))
    assert err["param"] == "max_completion_tokens" and err["message"].startswith("max_completion_tokens must be in")
    err = bad_request(lambda: oai.chat.completions.create(model=model, messages=chat, top_p=0))
    assert err["param"] == "top_p" and err["message"] == "top_p must be in (0, 1], got 0.0"
    err = bad_request(lambda: oai.chat.completions.create(model=model, messages=[{"role": "robot", "content": "Hi"}]))
    assert err["param"] == "messages[0].role" and err["message"].startswith("messages[0].role must be one of")
    err = bad_request(lambda: oai.completions.create(model=model, prompt="Hi", extra_body={"num_speculative_tokens": 99}))
    assert err["param"] == "num_speculative_tokens"
    err = bad_request(lambda: oai.completions.create(model=model, prompt="Hi", extra_body={"num_speculative_nodes": 99}))
    assert err["param"] == "num_speculative_nodes" and err["message"].startswith("num_speculative_nodes must be in [0, ")
    err = bad_request(lambda: oai.completions.create(model=model, prompt=[7] * CONTEXT, max_tokens=4))
    assert err["param"] == "prompt" and f"context is {CONTEXT}" in err["message"]


def test_invalid_json_says_where(cluster, model):
    body = '{\n  "model": "%s",\n  "prompt": "Hi",\n  "max_tokens": ,\n}' % model
    r = httpx.post(cluster.http_url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_json" and err["param"] is None and err["type"] == "invalid_request_error"
    assert "line 4 column 17" in err["message"] and err["message"].startswith("the request body is not valid JSON")
    # the server is fine afterwards
    assert httpx.get(cluster.http_url + "/health", timeout=10).status_code == 200


def test_finish_says_whether_the_context_or_max_tokens_ended_it(cluster, oai, model):
    prompt = [7] * (CONTEXT - 20)
    r = oai.completions.create(model=model, prompt=prompt, max_tokens=500, extra_body={"ignore_eos": True})
    (choice,) = r.choices
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 20
    details = choice.model_extra["finish_details"]
    assert details["type"] == "context_length" and f"context of {CONTEXT} tokens is full" in details["message"]
    chunks = list(oai.completions.create(model=model, prompt=prompt, max_tokens=500, stream=True,
                                         extra_body={"ignore_eos": True}))
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1].choices[0]
    assert last.finish_reason == "length" and last.model_extra["finish_details"]["type"] == "context_length"
    r = oai.completions.create(model=model, prompt="Hi", max_tokens=3, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.choices[0].model_extra["finish_details"] == {"type": "max_tokens"}


def test_the_context_is_reported_alike(cluster, oai):
    (m,) = oai.models.list().data
    with Client(cluster.address) as client:
        info = client.info()
    assert m.model_extra["max_model_len"] == info["max_context"] == CONTEXT
    assert info["max_prompt_tokens"] == CONTEXT - 1  # a longer prompt leaves no room to generate: refused
