"""Structured output in vLLM's words through the OpenAI API (the official `openai` client): `guided_choice`,
`guided_regex`, `guided_json`, `guided_grammar` and `structured_outputs` on chat and completions become the gRPC
API's response_format, so each request gets what the gRPC API gives for the same grammar (whose exactness
tests/test_structured_output.py proves), and its text belongs to the language; a bad one is a 400 naming the field
it came in."""

from __future__ import annotations

import json
import re

import openai
import pytest

from specdec.client import Client

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

CHOICES = ["yes", "no", 'a "quoted" ünï choice\\']
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Is the sky blue?"}]
LARK_CHOICES = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in CHOICES)


def grpc_text(cluster, fmt: dict, chat: bool, max_new: int) -> str:
    prompt = {"messages": MESSAGES} if chat else {"prompt": "The answer is"}
    with Client(cluster.address) as client:
        return client.generate(**prompt, max_new_tokens=max_new, response_format=fmt).text


CASES = [  # (extra body, the gRPC response_format it means, max tokens)
    ({"guided_choice": CHOICES}, {"lark": LARK_CHOICES}, 24),
    ({"structured_outputs": {"choice": CHOICES}}, {"lark": LARK_CHOICES}, 24),
    ({"guided_regex": "[a-c]{2,5}"}, {"regex": "[a-c]{2,5}"}, 8),
    ({"structured_outputs": {"regex": "[a-c]{2,5}"}}, {"regex": "[a-c]{2,5}"}, 8),
    ({"guided_json": SCHEMA}, {"json_schema": json.dumps(SCHEMA)}, 24),
    ({"guided_json": json.dumps(SCHEMA)}, {"json_schema": json.dumps(SCHEMA)}, 24),
    ({"guided_grammar": 'start: "x" | "y" "z"'}, {"lark": 'start: "x" | "y" "z"'}, 8),
    ({"structured_outputs": {"json_object": True}}, {"json_object": True}, 6),
    ({"guided_choice": CHOICES, "response_format": {"type": "text"}}, {"lark": LARK_CHOICES}, 24),  # (text: none)
]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("extra, fmt, max_new", CASES)
def test_vllms_fields_are_the_grpc_apis_response_format(cluster, oai, model, chat, extra, fmt, max_new):
    if chat:
        r = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=max_new, extra_body=extra)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    else:
        r = oai.completions.create(model=model, prompt="The answer is", max_tokens=max_new, extra_body=extra)
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert text == grpc_text(cluster, fmt, chat, max_new)
    if "lark" in fmt and "choice" in json.dumps(extra):
        assert text in CHOICES and finish == "stop"
    if "regex" in fmt:
        assert re.fullmatch("[a-c]{2,5}", text) and finish == "stop"
    if "json_schema" in fmt and finish == "stop":
        assert set(json.loads(text)) == {"ok", "n"}


@pytest.mark.parametrize("extra, param", [
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),  # (the second of the two, in CONSTRAINTS order)
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "wrong"}}, "guided_json"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"guided_grammar": "start: nothing_defined"}, "guided_grammar"),
])
def test_a_bad_guided_field_is_a_400_naming_it(oai, model, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt="hi", max_tokens=4, extra_body=extra)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert oai.completions.create(model=model, prompt="hi", max_tokens=2).choices[0].text is not None  # healthy
