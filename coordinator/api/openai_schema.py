"""Request bodies of the OpenAI-compatible API (pydantic), and their conversion to the gRPC GenerateRequest
that the shared validation and generation path take. Only shapes are checked here; limits (prompt
length, max tokens, K, stop strings, sampling ranges) are the shared validator's.

specdec's own options travel as extra body fields (openai client: `extra_body={...}`):
num_speculative_tokens (K; 0 = target-only; unset = the server's default, adaptive), num_speculative_nodes
(a token tree's node budget N; 0 = chains; unset = the server's default), proposer (any name
or alias of specdec.core.proposer_names, the gRPC API's table), top_k, ignore_eos, and vLLM's
repetition_penalty and min_p. n > 1 becomes n GenerateRequests (n generations; with a seed, choice i
samples with seed + i, as vLLM does).
"""

from __future__ import annotations

import json

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from coordinator.api.openai_tools import ToolError, ToolUse, call_text
from coordinator.params import MAX_CACHE_KEY_LEN
from specdec.core.proposer_names import NAMES, Proposer
from specdec.proto import generate_pb2

ProposerName = Literal[NAMES]  # every name and alias the gRPC API accepts
# OpenAI's newer "developer" role is the system prompt of older models.
ROLE_ALIASES = {"developer": "system"}
MAX_N = 16  # generations per request, choices x prompts (each a session on both tiers)
MAX_TOP_LOGPROBS = 20  # OpenAI's cap on top_logprobs (the gRPC API's too)


class BadRequest(ValueError):
    """A body that parses but asks for something this server does not do; param names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400 naming it, as OpenAI answers


class StreamOptions(Body):
    include_usage: bool = False  # one last chunk with the usage and no choices
    continuous_usage_stats: bool = False  # accepted for vLLM clients; usage is only sent at the end


class TextPart(Body):
    type: Literal["text"]
    text: str


class Message(Body):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None  # accepted, not used
    tool_calls: list[Any] | None = None  # an earlier assistant turn's calls (coordinator.api.openai_tools)
    tool_call_id: str | None = None  # a "tool" message: the call it answers (accepted, not used)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


CONSTRAINTS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")  # structured_outputs' keys


class _Common(Body):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)  # default: the server's default_max_new_tokens
    temperature: float | None = Field(default=None, ge=0.0)  # 0 = greedy (the default)
    top_p: float | None = None
    n: int = 1  # choices: n generations, 1..MAX_N
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extra: tokens that end the output (finish_reason stop)
    include_stop_str_in_output: bool = False  # vLLM's extra: the text keeps the stop string it ends at
    truncate_prompt_tokens: int | None = None  # vLLM's extra: keep only the prompt's last this many tokens
    min_tokens: int | None = None  # vLLM's extra: EOS and the stop tokens refused until the output holds this many
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None  # [-2, 2]; ranges are the shared validator's
    frequency_penalty: float | None = None  # [-2, 2]
    logit_bias: dict[str, float] | None = None  # {token id (as a string, OpenAI's form): bias in [-100, 100]}
    user: str | None = None  # routes like prompt_cache_key when that is absent
    prompt_cache_key: str | None = None  # requests with the same key reach the same replicas (their prefix caches)
    # specdec's extras
    num_speculative_tokens: int | None = None
    num_speculative_nodes: int | None = None
    proposer: ProposerName | None = None
    top_k: int | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = None  # vLLM's extra: (0, 2], 1 = off
    min_p: float | None = None  # vLLM's extra: [0, 1], 0 = off
    prompt_logprobs: int | None = None  # vLLM's extra: score the prompt, with this many alternatives a token (0..20)
    # Structured output, at most one of: OpenAI's response_format; vLLM's structured_outputs ({"json" | "regex" |
    # "choice" | "grammar" | "json_object": ...}) or its older guided_json / guided_regex / guided_choice / guided_grammar
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _check_common(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise BadRequest(f"n must be in [1, {MAX_N}], got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream=true", "stream_options")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}",
                             "prompt_logprobs")

    def _per_choice(self, req: generate_pb2.GenerateRequest) -> list[generate_pb2.GenerateRequest]:
        """n copies of the request; with a seed, choice i's is seed + i (mod 2^64), so choices differ and the
        request stays reproducible. Without one each choice draws its own random seed."""
        reqs = []
        for i in range(self.n):
            r = generate_pb2.GenerateRequest()
            r.CopyFrom(req)
            if self.seed is not None:
                r.seed = (self.seed + i) % 2**64
            reqs.append(r)
        return reqs

    def _constraints(self) -> list[str]:
        """The structured output fields the request sets (response_format {"type": "text"} sets none)."""
        plain = not self.response_format or self.response_format.get("type") == "text"
        return [name for name in CONSTRAINTS
                if getattr(self, name) is not None and not (name == "response_format" and plain)]

    def constraint_param(self) -> str:
        """The field the request's structured output came in (response_format when none)."""
        return next(iter(self._constraints()), "response_format")

    def _constrain(self, req: generate_pb2.GenerateRequest) -> None:
        """The request's structured output, in whichever field it came, into GenerateRequest.response_format."""
        given = self._constraints()
        if len(given) > 1:
            raise BadRequest(f"structured output: at most one of {', '.join(CONSTRAINTS)}, got {', '.join(given)}",
                             given[1])
        if not given:
            return
        if given[0] == "response_format":
            return _response_format(self.response_format, req)
        if given[0] == "structured_outputs":
            spec = self.structured_outputs
            kinds = [k for k in STRUCTURED_KINDS if spec.get(k) is not None]
            if len(kinds) != 1 or set(spec) - set(kinds):  # (its whitespace options are not applied: refused)
                raise BadRequest(f"structured_outputs: exactly one of {', '.join(STRUCTURED_KINDS)}, and nothing else "
                                 f"(got {sorted(spec)})", "structured_outputs")
            kind, value, param = kinds[0], spec[kinds[0]], f"structured_outputs.{kinds[0]}"
        else:
            kind, value, param = given[0].removeprefix("guided_"), getattr(self, given[0]), given[0]
        fmt = req.response_format
        if kind == "json_object":
            fmt.json_object = True
        elif kind == "json":
            fmt.json_schema = _json_text(value, param)
        elif kind == "regex" and isinstance(value, str):
            fmt.regex = value
        elif kind == "grammar" and isinstance(value, str):
            fmt.lark = value
        elif kind == "choice" and isinstance(value, list) and value and all(isinstance(c, str) and c for c in value):
            fmt.lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)  # the choices, literally
        else:
            raise BadRequest(f"{param}: a {'non-empty list of non-empty strings' if kind == 'choice' else 'string'} is "
                             "required", param)

    def _fill(self, req: generate_pb2.GenerateRequest, max_new_tokens: int | None) -> generate_pb2.GenerateRequest:
        if self.prompt_logprobs is not None:  # (one count for both: each reply trims its own, Reply.top)
            req.prompt_logprobs, req.top_logprobs = True, max(req.top_logprobs, self.prompt_logprobs)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        req.stop.extend(stop)
        req.include_stop_str_in_output = self.include_stop_str_in_output
        try:
            req.stop_token_ids.extend(self.stop_token_ids or [])
        except (ValueError, TypeError):
            raise BadRequest("stop_token_ids: token ids must be 32-bit integers", "stop_token_ids") from None
        req.ignore_eos = self.ignore_eos
        req.whole_result = not self.stream  # nothing reads the tokens before the end: rounds may run on further
        key_field = "prompt_cache_key" if self.prompt_cache_key else "user"
        key = self.prompt_cache_key or self.user or ""
        if len(key) > MAX_CACHE_KEY_LEN:
            raise BadRequest(f"{key_field}: at most {MAX_CACHE_KEY_LEN} characters, got {len(key)}", key_field)
        req.prompt_cache_key = key
        if self.proposer is not None:
            req.proposer = Proposer.parse(self.proposer).proto
        for key, bias in (self.logit_bias or {}).items():
            try:
                req.logit_bias[int(key)] = bias
            except (ValueError, TypeError):
                raise BadRequest(f"logit_bias: keys must be token ids, got {key!r}", "logit_bias") from None
        values = {"max_new_tokens": max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "truncate_prompt_tokens": self.truncate_prompt_tokens, "min_tokens": self.min_tokens,
                  "top_k": self.top_k, "seed": self.seed, "num_speculative_tokens": self.num_speculative_tokens,
                  "num_speculative_nodes": self.num_speculative_nodes, "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                  "repetition_penalty": self.repetition_penalty, "min_p": self.min_p}
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
    continue_final_message: bool = False  # vLLM's extra: the answer continues the last (assistant's) message
    add_generation_prompt: bool | None = None  # vLLM's extra: the template's assistant opening (default: unless the above)

    @property
    def top(self) -> int:
        """Alternatives a generated token's logprobs carry."""
        return self.top_logprobs or 0

    def tool_use(self) -> ToolUse | None:
        """The request's tools and tool_choice (None: no tools), or BadRequest naming the field."""
        try:
            return ToolUse.parse(self.tools, self.tool_choice)
        except ToolError as e:
            raise BadRequest(str(e), e.param) from None

    def to_generate_requests(self) -> list[generate_pb2.GenerateRequest]:
        """One GenerateRequest per choice."""
        self._check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}", "top_logprobs")
        tools = self.tool_use()
        req = generate_pb2.GenerateRequest()
        self._constrain(req)
        if tools is not None and tools.constrained:
            if req.HasField("response_format"):
                raise BadRequest(f"{self.constraint_param()} cannot be combined with a tool_choice that forces a call",
                                 self.constraint_param())
            req.response_format.json_schema = json.dumps(tools.call_schema())
        messages = [(ROLE_ALIASES.get(m.role, m.role),
                     call_text(m.tool_calls) if m.tool_calls and not m.text() else m.text()) for m in self.messages]
        if tools is not None and tools.active:  # the tools, described in the system message
            if messages and messages[0][0] == "system":
                messages[0] = ("system", messages[0][1] + "\n\n" + tools.system_text())
            else:
                messages.insert(0, ("system", tools.system_text()))
        _chat(req, messages, self.continue_final_message, self.add_generation_prompt)
        max_new = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        req.logprobs = self.logprobs
        req.top_logprobs = self.top_logprobs or 0
        return self._per_choice(self._fill(req, max_new))


def _chat(req: generate_pb2.GenerateRequest, messages: list[tuple[str, str]], continue_final_message: bool,
          add_generation_prompt: bool | None) -> None:
    """req's prompt: the chat of these (role, content) messages, with vLLM's template flags."""
    req.chat.SetInParent()
    for role, content in messages:
        req.chat.messages.add(role=role, content=content)
    req.chat.continue_final_message = continue_final_message
    if add_generation_prompt is not None:
        req.chat.add_generation_prompt = add_generation_prompt


def _json_text(schema, param: str) -> str:
    """A JSON Schema given as an object or as JSON text, as text (BadRequest naming param when it is neither)."""
    if isinstance(schema, dict):
        return json.dumps(schema)
    try:
        if isinstance(schema, str) and isinstance(json.loads(schema), dict):
            return schema
    except ValueError:
        pass
    raise BadRequest(f"{param}: a JSON Schema (an object, or its JSON text) is required", param)


def _response_format(fmt: dict[str, Any] | None, req: generate_pb2.GenerateRequest) -> None:
    """OpenAI's response_format into GenerateRequest.response_format: text (none), json_object, or
    json_schema {"name", "schema", "strict"} (the schema is enforced whatever strict says)."""
    if not fmt or fmt.get("type") == "text":
        return
    kind = fmt.get("type")
    if kind == "json_object":
        req.response_format.json_object = True
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise BadRequest("response_format.json_schema: an object with a schema object is required",
                             "response_format.json_schema")
        req.response_format.json_schema = json.dumps(spec.get("schema", {}))
    else:
        raise BadRequest(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                         "response_format.type")


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]  # one prompt, or a batch (texts or token ids)
    max_tokens: int | None = Field(default=None, ge=0)  # 0: the prompt scored only (echo with logprobs, prompt_logprobs)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @property
    def top(self) -> int:
        """Alternatives a generated token's logprobs carry."""
        return self.logprobs or 0

    def echoed(self, tokenizer) -> list[str]:
        """With echo: each prompt as text, which its choices' completions follow (a text prompt as given, token ids
        decoded as they are); without: none."""
        return [p if isinstance(p, str) else tokenizer.decode(p) for p in self.prompts()] if self.echo else []

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or a batch's in order (OpenAI's array of strings or of token arrays)."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [prompt]  # an empty list is refused below as an empty prompt
        return list(prompt)

    def to_generate_requests(self) -> list[generate_pb2.GenerateRequest]:
        """One GenerateRequest per choice: n per prompt, prompt by prompt (choice index = prompt index * n + i, as
        OpenAI numbers a batch's choices; each prompt's choices are what the prompt alone would get)."""
        self._check_common()
        if self.max_tokens == 0 and not (self.echo and self.logprobs is not None or self.prompt_logprobs is not None):
            raise BadRequest("max_tokens 0 scores the prompt only: it needs echo and logprobs, or prompt_logprobs",
                             "max_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}", "logprobs")
        if self.best_of not in (None, 1):
            raise BadRequest("best_of: only 1 is supported", "best_of")
        if self.suffix:
            raise BadRequest("suffix is not supported", "suffix")
        prompts = self.prompts()
        if len(prompts) * self.n > MAX_N:
            raise BadRequest(f"prompt: a batch of {len(prompts)} prompts x n = {self.n} is {len(prompts) * self.n} "
                             f"generations; at most {MAX_N} a request", "prompt")
        reqs = []
        for prompt in prompts:
            req = generate_pb2.GenerateRequest()
            if isinstance(prompt, str):
                req.text = prompt
            else:
                req.token_ids.SetInParent()
                try:
                    req.token_ids.ids.extend(prompt)
                except (ValueError, TypeError):
                    raise BadRequest("prompt: token ids must be 32-bit integers", "prompt") from None
            self._constrain(req)
            if self.logprobs is not None:  # OpenAI's completions: the number of alternatives, 0 = the chosen token only
                req.logprobs, req.top_logprobs = True, self.logprobs
                req.prompt_logprobs = self.echo  # echo with logprobs: the prompt's tokens scored too
            reqs += self._per_choice(self._fill(req, self.max_tokens))
        return reqs


class TokenizeRequest(Body):
    """vLLM's /tokenize: a prompt's tokens as a request with it would be given them."""

    model: str | None = None
    prompt: str | None = None  # text, tokenized with the tokenizer's special tokens unless add_special_tokens is false
    messages: list[Message] | None = None  # a chat, rendered with the template
    add_special_tokens: bool = True
    add_generation_prompt: bool | None = None  # default: true, unless continue_final_message
    continue_final_message: bool = False

    def chat(self) -> generate_pb2.GenerateRequest | None:
        """The messages as a chat request's prompt (None: a text prompt), or BadRequest: not exactly one form."""
        if (self.prompt is None) == (self.messages is None):
            raise BadRequest("give exactly one of prompt and messages", "prompt")
        if self.messages is None:
            return None
        req = generate_pb2.GenerateRequest()
        _chat(req, [(ROLE_ALIASES.get(m.role, m.role), m.text()) for m in self.messages], self.continue_final_message,
              self.add_generation_prompt)
        return req


class DetokenizeRequest(Body):
    """vLLM's /detokenize: token ids as text."""

    model: str | None = None
    tokens: list[int]
