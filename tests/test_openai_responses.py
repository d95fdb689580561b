"""OpenAI's Responses API (`/v1/responses`), driven by the official `openai` client against real servers: the
output the chat completion of the same conversation gives, its usage and status, the stream's events in OpenAI's
order (and the client's own stream helper), text.format as structured output, a seed's one output, and what is not
served refused with 400 naming the field."""

from __future__ import annotations

import json

import openai
import pytest

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

STORY = "Write a short story about a lighthouse keeper"


def test_a_response_is_the_chat_completion_of_its_conversation(oai, model):
    r = oai.responses.create(model=model, instructions="Be brief.", max_output_tokens=12,
                             input=[{"role": "user", "content": [{"type": "input_text", "text": STORY}]}])
    chat = oai.chat.completions.create(model=model, max_tokens=12, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": STORY}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == model
    assert r.output_text == chat.choices[0].message.content and len(r.output) == 1
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens == 12
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # the budget ended it
    plain = oai.responses.create(model=model, input=STORY, max_output_tokens=12)  # a string input: one user message
    assert plain.output_text == oai.chat.completions.create(model=model, max_tokens=12, messages=[
        {"role": "user", "content": STORY}]).choices[0].message.content


def test_the_stream_sends_openais_events_in_order(oai, model):
    whole = oai.responses.create(model=model, input=STORY, max_output_tokens=20)
    events = list(oai.responses.create(model=model, input=STORY, max_output_tokens=20, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-4].text == whole.output_text == events[-1].response.output_text
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1
    with oai.responses.stream(model=model, input=STORY, max_output_tokens=20) as stream:  # the client's helper
        assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == whole.output_text


def test_text_format_is_structured_output(oai, model):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    r = oai.responses.create(model=model, input="Is the sea salty?", max_output_tokens=40,
                             text={"format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}})
    assert r.status == "completed" and json.loads(r.output_text)["answer"] in ("yes", "no")


def test_a_seed_gives_one_output(oai, model):
    ask = dict(model=model, input=STORY, max_output_tokens=16, temperature=1.0)
    runs = [oai.responses.create(**ask, extra_body={"seed": 9, **kw}).output_text
            for kw in ({}, {"num_speculative_tokens": 0}, {"num_speculative_tokens": 3})]
    assert runs == [runs[0]] * 3 and runs[0] != oai.responses.create(**ask, extra_body={"seed": 10}).output_text


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}, "tools"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}}, "text.format"),
], ids=["previous_response_id", "tools", "reasoning", "image", "function_call_output", "role", "max_output_tokens",
        "bad_schema"])
def test_what_is_not_served_is_refused_naming_the_field(oai, model, extra, param):
    ask = {"model": model, "input": "hi", "max_output_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(**ask)
    assert e.value.body["param"] == param, e.value.body
    assert oai.responses.create(model=model, input="hi", max_output_tokens=2).usage.output_tokens == 2  # still serving


def test_a_client_leaving_mid_stream_frees_the_sessions_and_the_wire_names_each_event(cluster, model):
    """Raw server-sent events: each an `event:` line naming its type and the same type in its data; a client that
    closes the stream after three events cancels the generation, whose sessions end on both tiers."""
    import httpx

    body = {"model": model, "input": STORY, "max_output_tokens": 900, "ignore_eos": True, "stream": True,
            "num_speculative_tokens": 0}  # target-only: a long stream
    with httpx.stream("POST", cluster.http_url + "/v1/responses", json=body, timeout=60) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        lines = resp.iter_lines()
        events = []
        for line in lines:
            if line.startswith("event: "):
                data = next(lines)
                assert data.startswith("data: ") and json.loads(data[6:])["type"] == line[7:]
                events.append(line[7:])
            if len(events) == 5:
                break
        assert events[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                              "response.content_part.added"]
        assert cluster.status("target").num_sessions >= 1, "the generation must still be running"
    cluster.wait_no_sessions()
