"""Tool calls in OpenAI's shape through the official openai client (coordinator.api.openai_tools):
tool_choice required or naming a function constrains the answer to a call (message.tool_calls,
finish_reason tool_calls, arguments valid JSON for the tool's parameters), streamed or not; auto answers
with content or a call; a conversation carrying earlier calls and tool results is accepted; bad tools and
tool_choice are 400s naming the field."""

from __future__ import annotations

import json

import openai
import pytest

from coordinator.api.openai_tools import ToolUse

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string", "maxLength": 20},
                                                                          "days": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 7}},
                                                           "required": ["city", "days"],
                                                           "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def cluster(random_draft_cluster):
    return random_draft_cluster


def check_call(call, tools=(WEATHER, TIME)):
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in spec
    args = json.loads(call.function.arguments)
    assert set(args) == set(spec[call.function.name]["required"])
    return call.function.name, args


@pytest.mark.parametrize("choice,names", [("required", {"get_weather", "get_time"}),
                                          ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})])
def test_a_forced_tool_choice_answers_with_a_call(oai, model, choice, names):
    r = oai.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                    max_tokens=96, extra_body={"proposer": "draft"})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
    name, args = check_call(c.message.tool_calls[0])
    assert name in names


def test_a_streamed_forced_call_arrives_as_a_tool_calls_delta(oai, model):
    chunks = list(oai.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                              max_tokens=96, stream=True))
    calls = [tc for ch in chunks for c in ch.choices if c.delta.tool_calls for tc in c.delta.tool_calls]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert set(json.loads(calls[0].function.arguments)) == {"city", "days"}
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["tool_calls"]


def test_auto_and_none_answer_and_a_tool_conversation_continues(oai, model):
    auto = oai.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=16)
    c = auto.choices[0]
    assert (c.finish_reason == "tool_calls") == bool(c.message.tool_calls)  # a call, or content: either is a valid answer
    none = oai.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "length"
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": json.dumps({"city": "Paris", "days": 3})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    after = oai.chat.completions.create(model=model, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert after.choices[0].finish_reason == "length" and after.usage.prompt_tokens > none.usage.prompt_tokens


@pytest.mark.parametrize("tools,choice,param", [
    ([{"type": "function", "function": {"name": "bad name!"}}], None, "tools[0].function.name"),
    ([{"type": "retrieval"}], None, "tools[0]"),
    ([WEATHER], {"type": "function", "function": {"name": "missing"}}, "tool_choice"),
    (None, "required", "tool_choice"),
    ([WEATHER, WEATHER], None, "tools")])
def test_bad_tools_are_400s_naming_the_field(oai, model, tools, choice, param):
    kw = {"tools": tools} if tools is not None else {}
    if choice is not None:
        kw["tool_choice"] = choice
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=ASK, max_tokens=4, **kw)
    assert e.value.body["param"] == param, e.value.body


def test_the_call_schema_and_parsing():
    use = ToolUse.parse([WEATHER, TIME], "required")
    schema = use.call_schema()
    assert [c["properties"]["name"]["const"] for c in schema["anyOf"]] == ["get_weather", "get_time"]
    assert schema["x-guidance"]["whitespace_flexible"] is False
    assert ToolUse.parse([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}).call_schema()[
        "properties"]["name"] == {"const": "get_time"}
    (call,) = use.parse_call('{"name": "get_time", "arguments": {"zone": "UTC"}}')
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    assert use.parse_call('{"name": "other", "arguments": {}}') is None and use.parse_call("hello") is None
