"""OpenAI's Responses API (`POST /v1/responses`) on the chat path: a request becomes the chat completion it
amounts to (instructions as the system message, the input's messages after it; text.format as response_format),
so the shared validation, generation and lossless rounds are the chat's; the reply is a `response` object, or
streamed as its events (response.created ... response.output_text.delta ... response.completed).

What this server keeps nothing of is refused rather than ignored: previous_response_id (nothing is stored: send
the conversation in `input`), tools and function-call items (use /v1/chat/completions, which has them), images and
files (the model reads text), reasoning (the model does not reason). `store` is accepted and nothing is stored.
specdec's and vLLM's extras (seed, top_k, num_speculative_tokens, ...) travel as on the chat route.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import Field

from coordinator.api.frontend import finish_reason_name
from coordinator.api.openai_schema import BadRequest, Body, ChatCompletionRequest, Message, ProposerName
from specdec.core.errors import RequestError
from specdec.proto import generate_pb2

INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")  # a message's text parts (output_text: an earlier answer's)
# The gRPC request's fields (RequestError.field) and the chat request's (BadRequest.param) -> this API's, for errors
WORDS = {"max_new_tokens": "max_output_tokens", "chat.messages": "input", "prompt": "input",
         **{f"response_format.{f}": "text.format" for f in ("json_schema", "json_object", "regex", "lark")}}
CHAT_PARAMS = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens",
               "max_tokens": "max_output_tokens", "messages": "input"}


class ResponsesRequest(Body):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None  # the system message, before the input's
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None  # accepted: nothing is stored
    metadata: dict[str, str] | None = None  # returned as given
    user: str | None = None
    prompt_cache_key: str | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    truncation: Literal["disabled"] | None = None  # ("auto" would drop the conversation's start: refused)
    tool_choice: Literal["none", "auto"] | None = None  # (no tools: nothing to choose)
    parallel_tool_calls: bool | None = None
    tools: list[Any] | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    # specdec's and vLLM's extras, as on the chat route
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    num_speculative_tokens: int | None = None
    num_speculative_nodes: int | None = None
    proposer: ProposerName | None = None

    def to_generate_requests(self) -> list[generate_pb2.GenerateRequest]:
        """The GenerateRequest of the chat completion this request amounts to, or BadRequest naming this API's field."""
        try:
            return self.to_chat().to_generate_requests()
        except BadRequest as e:
            param, message = e.param, str(e)
            for chat, ours in CHAT_PARAMS.items():
                if param is not None and param.startswith(chat):
                    message, param = message.replace(param, ours), ours
                    break
            raise BadRequest(message, param) from None

    def to_chat(self) -> ChatCompletionRequest:
        """The chat completion this request amounts to, or BadRequest naming what is not served."""
        for name, why in (("previous_response_id", "this server stores no responses: send the conversation in input"),
                          ("tools", "not served on /v1/responses: use /v1/chat/completions, which has tools"),
                          ("reasoning", "this model does not reason"),
                          ("include", "nothing more can be included here")):
            if getattr(self, name):
                raise BadRequest(f"{name}: {why}", name)
        messages = [Message(role="system", content=self.instructions)] if self.instructions is not None else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        messages += [_message(item, f"input[{i}]") for i, item in enumerate(items)]
        extras = {k: getattr(self, k) for k in ("seed", "top_k", "min_p", "repetition_penalty", "num_speculative_tokens",
                                                "num_speculative_nodes", "proposer", "temperature", "top_p", "user",
                                                "prompt_cache_key") if getattr(self, k) is not None}
        return ChatCompletionRequest(model=self.model, messages=messages, max_completion_tokens=self.max_output_tokens,
                                     stream=self.stream, ignore_eos=self.ignore_eos,
                                     response_format=_format(self.text), **extras)

    def echo(self) -> dict:
        """The request's settings as a response object repeats them."""
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata or {}, "parallel_tool_calls": True, "previous_response_id": None,
                "store": False, "temperature": self.temperature if self.temperature is not None else 0.0,
                "top_p": self.top_p if self.top_p is not None else 1.0, "text": {"format": (self.text or {}).get(
                    "format", {"type": "text"})}, "tool_choice": self.tool_choice or "auto", "tools": [],
                "truncation": "disabled", "user": self.user}


def _message(item: dict[str, Any], where: str) -> Message:
    """An input item (a message: role and content, a string or text parts) as a chat message."""
    kind = item.get("type", "message")
    if kind != "message":
        raise BadRequest(f"{where}.type: {kind!r} items are not served here (messages only: no tools on "
                         "/v1/responses)", f"{where}.type")
    role, content = item.get("role"), item.get("content")
    if role not in INPUT_ROLES:
        raise BadRequest(f"{where}.role must be one of {', '.join(INPUT_ROLES)}, got {role!r}", f"{where}.role")
    if isinstance(content, str):
        return Message(role=role, content=content)
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content: a string or a list of text parts is required", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRequest(f"{where}.content[{j}]: {kind!r} is not served (the model reads text: input_text parts)",
                             f"{where}.content[{j}]")
        texts.append(part["text"])
    return Message(role=role, content="".join(texts))


def _format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as the chat's response_format: json_schema's name, schema and strict move into its json_schema."""
    fmt = (text or {}).get("format")
    if fmt is None or not isinstance(fmt, dict):
        if fmt is not None:
            raise BadRequest("text.format: an object is required", "text.format")
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return fmt


class ResponseReply:
    """A response object for one request, whole or as its stream of events."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.id, self.item = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.model, self.settings = model, body.echo()
        self.created = int(time.time())
        self._sequence = 0

    def response(self, text: str | None = None, result: generate_pb2.GenerationResult | None = None) -> dict:
        """The response object: in progress (no result yet), or finished with its text."""
        out = {"id": self.id, "object": "response", "created_at": self.created, "model": self.model, "error": None,
               "incomplete_details": None, "output": [], "status": "in_progress", "usage": None, **self.settings}
        if result is None:
            return out
        done = finish_reason_name(result.finish_reason) in ("eos", "stop")
        s = result.stats
        out.update(status="completed" if done else "incomplete", output=[self._message(text, done)],
                   incomplete_details=None if done else {"reason": "max_output_tokens"},
                   usage={"input_tokens": s.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens": s.generated_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": s.prompt_tokens + s.generated_tokens})
        return out

    def _message(self, text: str | None, done: bool = True) -> dict:
        content = [] if text is None else [self._part(text)]
        return {"id": self.item, "type": "message", "status": "completed" if done else "incomplete",
                "role": "assistant", "content": content}

    @staticmethod
    def _part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _event(self, kind: str, **fields) -> str:
        """One server-sent event: its type named on the event line and in the data, numbered."""
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"

    async def stream(self, events: AsyncIterator[tuple[int, generate_pb2.GenerateResponse]], scope: dict,
                     error_key: str, on_error) -> AsyncIterator[str]:
        """The events of one generation as the Responses API streams them. A RequestError inside the stream becomes
        an error event and response.failed (on_error(e) -> (status, body)); its status is left in scope[error_key]."""
        where = {"item_id": self.item, "output_index": 0, "content_index": 0}
        text: list[str] = []
        try:
            yield self._event("response.created", response=self.response())
            yield self._event("response.in_progress", response=self.response())
            in_progress = {**self._message(None), "status": "in_progress"}
            yield self._event("response.output_item.added", output_index=0, item=in_progress)
            yield self._event("response.content_part.added", **where, part=self._part(""))
            async for _, event in events:
                if event.HasField("chunk"):
                    if event.chunk.text:
                        text.append(event.chunk.text)
                        yield self._event("response.output_text.delta", **where, delta=event.chunk.text, logprobs=[])
                elif event.HasField("result"):
                    whole = "".join(text)
                    final = self.response(whole, event.result)
                    yield self._event("response.output_text.done", **where, text=whole, logprobs=[])
                    yield self._event("response.content_part.done", **where, part=self._part(whole))
                    yield self._event("response.output_item.done", output_index=0, item=final["output"][0])
                    kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
                    yield self._event(kind, response=final)
        except RequestError as e:
            status, body = on_error(e)
            scope[error_key] = status
            yield self._event("error", **body["error"])
            yield self._event("response.failed", response={**self.response(), "status": "failed", "error": {
                "code": body["error"]["code"], "message": body["error"]["message"]}})
        finally:
            await events.aclose()
