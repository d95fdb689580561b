"""Request bodies of the OpenAI-compatible API (pydantic), and their conversion to the gRPC GenerateRequest
that the shared validation and generation path take. Only shapes are checked here; limits (prompt
length, max tokens, K, stop strings, sampling ranges) are the shared validator's.

specdec's own options travel as extra body fields (openai client: `extra_body={...}`):
num_speculative_tokens (K; 0 = target-only; unset = the server's default, adaptive), proposer (any name
or alias of coordinator.proposers.names, the gRPC API's table), top_k, ignore_eos.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from coordinator.params import MAX_CACHE_KEY_LEN
from coordinator.proposers.names import NAMES, Proposer
from specdec.proto import generate_pb2

ProposerName = Literal[NAMES]  # every name and alias the gRPC API accepts
# OpenAI's newer "developer" role is the system prompt of older models.
ROLE_ALIASES = {"developer": "system"}


class BadRequest(ValueError):
    """A body that parses but asks for something this server does not do; param names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400 naming it, as OpenAI answers


class StreamOptions(_Body):
    include_usage: bool = False  # one last chunk with the usage and no choices
    continuous_usage_stats: bool = False  # accepted for vLLM clients; usage is only sent at the end


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None  # accepted, not used

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _Common(_Body):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)  # default: the server's default_max_new_tokens
    temperature: float | None = Field(default=None, ge=0.0)  # 0 = greedy (the default)
    top_p: float | None = None
    n: int = 1
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # routes like prompt_cache_key when that is absent
    prompt_cache_key: str | None = None  # requests with the same key reach the same replicas (their prefix caches)
    # specdec's extras
    num_speculative_tokens: int | None = None
    proposer: ProposerName | None = None
    top_k: int | None = None
    ignore_eos: bool = False

    def _check_common(self) -> None:
        if self.n != 1:
            raise BadRequest(f"n: only n=1 is supported, got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream=true", "stream_options")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise BadRequest(f"{name} is not supported (it would change the target's distribution)", name)
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported", "logit_bias")

    def _fill(self, req: generate_pb2.GenerateRequest, max_new_tokens: int | None) -> generate_pb2.GenerateRequest:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        req.stop.extend(stop)
        req.ignore_eos = self.ignore_eos
        key_field = "prompt_cache_key" if self.prompt_cache_key else "user"
        key = self.prompt_cache_key or self.user or ""
        if len(key) > MAX_CACHE_KEY_LEN:
            raise BadRequest(f"{key_field}: at most {MAX_CACHE_KEY_LEN} characters, got {len(key)}", key_field)
        req.prompt_cache_key = key
        if self.proposer is not None:
            req.proposer = Proposer.parse(self.proposer).proto
        values = {"max_new_tokens": max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "top_k": self.top_k, "seed": self.seed, "num_speculative_tokens": self.num_speculative_tokens}
        for name, value in values.items():
            if value is not None:
                try:
                    setattr(req, name, value)
                except (ValueError, TypeError):
                    param = "max_tokens" if name == "max_new_tokens" else name
                    raise BadRequest(f"{param}: {value} is out of range", param) from None
        return req


class ChatCompletionRequest(_Common):
    messages: list[Message]
    max_completion_tokens: int | None = Field(default=None, ge=1)  # wins over max_tokens (deprecated by OpenAI)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    def to_generate_request(self) -> generate_pb2.GenerateRequest:
        self._check_common()
        if self.logprobs or self.top_logprobs:
            raise BadRequest("logprobs are not supported", "logprobs")
        if self.tools or self.tool_choice not in (None, "none"):
            raise BadRequest("tools are not supported", "tools")
        if self.response_format and self.response_format.get("type") != "text":
            raise BadRequest("response_format: only {\"type\": \"text\"} is supported", "response_format")
        req = generate_pb2.GenerateRequest()
        req.chat.SetInParent()
        for m in self.messages:
            req.chat.messages.add(role=ROLE_ALIASES.get(m.role, m.role), content=m.text())
        max_new = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._fill(req, max_new)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def to_generate_request(self) -> generate_pb2.GenerateRequest:
        self._check_common()
        if self.echo:
            raise BadRequest("echo is not supported", "echo")
        if self.logprobs:
            raise BadRequest("logprobs are not supported", "logprobs")
        if self.best_of not in (None, 1):
            raise BadRequest("best_of: only 1 is supported", "best_of")
        if self.suffix:
            raise BadRequest("suffix is not supported", "suffix")
        req = generate_pb2.GenerateRequest()
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise BadRequest(f"prompt: one prompt per request (n=1), got a batch of {len(prompt)}", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.SetInParent()
            try:
                req.token_ids.ids.extend(prompt)
            except (ValueError, TypeError):
                raise BadRequest("prompt: token ids must be 32-bit integers", "prompt") from None
        return self._fill(req, self.max_tokens)
