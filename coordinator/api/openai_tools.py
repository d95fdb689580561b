"""Tool calls in OpenAI's shape (`tools`, `tool_choice`, `message.tool_calls`), built on structured output.

The default pair's chat template has no notion of tools, so the tools are described in the system
message, with the format of a call: a JSON object {"name": <function>, "arguments": {...}}. Then, by
`tool_choice`:
- "required", or a named function: the output is constrained (response_format json_schema) to a call of
  one of the tools (or of the named one), with its `parameters` as the arguments' schema, so it always is
  one: the reply carries it as `tool_calls`, finish_reason "tool_calls";
- "auto" (the default with tools): the output is not constrained; when the whole answer is a call of one
  of the tools it is returned as `tool_calls`, otherwise as content (the parsing a server does for a
  model's own tool format; vLLM's tool parsers do the same);
- "none": the tools are neither described nor parsed.
Earlier turns of a tool conversation come back as messages: an assistant message's tool_calls are shown
to the model as the call JSON it would have written, and role "tool" messages (a call's result) as they are.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
AUTO, NONE, REQUIRED = "auto", "none", "required"
# A call is written as json.dumps writes it (as the system message shows calls): no free whitespace
# (llguidance's JSON options), so a call always ends within a few tokens of its content.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolError(ValueError):
    """A tools / tool_choice the server cannot use; param names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # a JSON Schema of the arguments object


@dataclass(frozen=True)
class ToolUse:
    tools: tuple[Tool, ...]
    choice: str  # auto | none | required | a tool's name (forced)

    @classmethod
    def parse(cls, tools: list[Any] | None, tool_choice: Any) -> "ToolUse | None":
        """None when the request has no tools (then tool_choice must be absent or "none")."""
        if not tools:
            if tool_choice not in (None, NONE):
                raise ToolError("tool_choice needs tools", "tool_choice")
            return None
        parsed = []
        for i, t in enumerate(tools):
            where = f"tools[{i}]"
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
                raise ToolError(f'{where}: each tool is {{"type": "function", "function": {{...}}}}', where)
            f = t["function"]
            name = f.get("name")
            if not isinstance(name, str) or not NAME.match(name):
                raise ToolError(f"{where}.function.name must match {NAME.pattern}, got {name!r}", f"{where}.function.name")
            params = f.get("parameters", {"type": "object", "properties": {}})
            if not isinstance(params, dict):
                raise ToolError(f"{where}.function.parameters must be a JSON Schema object", f"{where}.function.parameters")
            parsed.append(Tool(name, str(f.get("description", "")), params))
        names = [t.name for t in parsed]
        if len(set(names)) != len(names):
            raise ToolError("tools: function names must be distinct", "tools")
        if tool_choice in (None, AUTO, NONE, REQUIRED):
            choice = tool_choice or AUTO
        elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
                and isinstance(tool_choice.get("function"), dict) and tool_choice["function"].get("name") in names:
            choice = tool_choice["function"]["name"]
        else:
            raise ToolError(f"tool_choice must be none, auto, required or {{\"type\": \"function\", \"function\": "
                            f"{{\"name\": one of {names}}}}}, got {tool_choice!r}", "tool_choice")
        return cls(tuple(parsed), choice)

    @property
    def active(self) -> bool:
        return self.choice != NONE

    @property
    def constrained(self) -> bool:
        return self.choice not in (AUTO, NONE)

    def system_text(self) -> str:
        """The tools as the model is told about them (appended to the system message)."""
        listing = json.dumps([{"name": t.name, "description": t.description, "parameters": t.parameters}
                              for t in self.tools], ensure_ascii=False)
        return ("You can call these functions: " + listing + "\nTo call one, reply with only a JSON object "
                '{"name": <function name>, "arguments": <arguments object>}.')

    def call_schema(self) -> dict:
        """The JSON Schema a constrained answer follows: a call of one tool (the named one when forced)."""
        tools = [t for t in self.tools if self.choice == REQUIRED or t.name == self.choice]
        calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return {**schema, "x-guidance": COMPACT}

    def parse_call(self, text: str) -> list[dict] | None:
        """The answer as OpenAI tool_calls when it is a call of one of the tools, else None."""
        try:
            doc = json.loads(text)
        except ValueError:
            return None
        names = {t.name for t in self.tools}
        if not isinstance(doc, dict) or doc.get("name") not in names or not isinstance(doc.get("arguments"), dict):
            return None
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": doc["name"], "arguments": json.dumps(doc["arguments"], ensure_ascii=False)}}]


def call_text(tool_calls: list[Any]) -> str:
    """An earlier assistant turn's tool_calls as the text the model would have written (one call each)."""
    out = []
    for c in tool_calls:
        f = c.get("function", {}) if isinstance(c, dict) else {}
        try:
            arguments = json.loads(f.get("arguments", "{}"))
        except ValueError:
            arguments = f.get("arguments", "")
        out.append(json.dumps({"name": f.get("name", ""), "arguments": arguments}, ensure_ascii=False))
    return "\n".join(out)
