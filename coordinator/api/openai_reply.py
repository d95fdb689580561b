"""OpenAI response objects for one request of the HTTP API: chat.completion(.chunk) or text_completion, with
one choice per generation (n > 1 runs n generations: coordinator.api.openai_api) and, when asked, the
tokens' logprobs in OpenAI's shapes (chat: choices[i].logprobs.content; completions: choices[i].logprobs
with tokens / token_logprobs / top_logprobs / text_offset). The logprobs come from the gRPC TokenChunks
(generate_pb2.TokenLogprob: the target's processed distribution); this is the one place they are converted."""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator, Sequence

from coordinator.api.frontend import finish_reason_name
from coordinator.api.openai_tools import ToolUse
from specdec.core.errors import RequestError
from specdec.proto import generate_pb2

# Our finish reasons -> OpenAI's.
FINISH_REASON = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
# ... and what ended it, in each final choice's `finish_details.type` (OpenAI's "length" covers both the
# request's max_tokens and the model's context; this tells them apart).
FINISH_DETAIL = {"eos": "eos", "stop": "stop", "length": "max_tokens", "context": "context_length"}
NEG_INF_LOGPROB = -9999.0  # what a logprob of -inf (probability 0) is sent as: JSON has no -inf (vLLM's choice)
Indexed = tuple[int, generate_pb2.GenerateResponse]  # (choice index, event)


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


class Choice:
    """What one choice collected: its text, its logprobs and its result."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.logprobs: list[generate_pb2.TokenLogprob] = []
        self.prompt: generate_pb2.PromptLogprobs | None = None  # the prompt's scores (echo with logprobs, prompt_logprobs)
        self.result: generate_pb2.GenerationResult | None = None


class Reply:
    """OpenAI response objects for one request: chat.completion(.chunk) or text_completion."""

    def __init__(self, rid: str, model: str, chat: bool, tokenizer, logprobs: bool = False,
                 max_context: int = 0, tools: ToolUse | None = None, per_prompt: int = 1,
                 echoed: Sequence[str] = (), top: int = 20, prompt_top: int | None = None) -> None:
        """per_prompt: choices per prompt (n; a batch of prompts numbers its choices prompt by prompt); echoed:
        completions' echo, each prompt's text, sent before its choices' completions (whole: prepended);
        logprobs: the request asked for them (each choice then carries a logprobs object; with echo, the prompt's
        tokens first, the first with none, as OpenAI's echo gives them); top: the alternatives each carries (the
        gRPC request asked for as many as any use here needs); prompt_top: vLLM's prompt_logprobs, with this many
        alternatives a prompt token (None: not asked); max_context:
        the target's context (prompt + generated tokens), for the message of a generation it ended; tools:
        the request's tools (coordinator.api.openai_tools): an answer that is a call becomes tool_calls, and
        a stream holds each choice's text back until its end, when it is known whether it is a call."""
        self.rid, self.model, self.chat = rid, model, chat
        self.tools, self.per_prompt, self.echoed = tools, per_prompt, list(echoed)
        self.scored = bool(self.echoed) and logprobs  # echo with logprobs: each prompt comes scored (PromptLogprobs)
        self.top, self.prompt_top = top, prompt_top
        self.max_context = max_context
        self.tokenizer, self.logprobs = tokenizer, logprobs
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # completions' text_offset: characters so far, per choice

    def _envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.rid, "object": kind, "created": self.created, "model": self.model}

    def usage(self, results: dict[int, generate_pb2.GenerationResult]) -> dict:
        """Choice index -> result: each prompt counted once (its n choices share it; a batch's prompts summed),
        the completions of every choice summed (OpenAI's usage)."""
        prompt = sum(r.stats.prompt_tokens for i, r in results.items() if i % self.per_prompt == 0)
        completion = sum(r.stats.generated_tokens for r in results.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _echo(self, index: int) -> str:
        """Choice `index`'s echoed prompt ("" without echo)."""
        return self.echoed[index // self.per_prompt] if self.echoed else ""

    # --- logprobs ---------------------------------------------------------------------------------

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token_id])
        return text, list(text.encode("utf-8"))

    @staticmethod
    def _value(logprob: float) -> float:
        return logprob if math.isfinite(logprob) else NEG_INF_LOGPROB

    def _logprobs(self, index: int, items: Sequence[generate_pb2.TokenLogprob],
                  prompt: generate_pb2.PromptLogprobs | None = None) -> dict | None:
        """The logprobs object of a choice (or of a chunk's tokens), None when not asked for; prompt: completions'
        echo, the prompt's scores, whose tokens come first (the first one unscored: null)."""
        if not self.logprobs:
            return None
        if self.chat:
            content = []
            for t in items:
                text, raw = self._token(t.token_id)
                top = []
                for alt in t.top_logprobs[: self.top]:
                    alt_text, alt_raw = self._token(alt.token_id)
                    top.append({"token": alt_text, "logprob": self._value(alt.logprob), "bytes": alt_raw})
                content.append({"token": text, "logprob": self._value(t.logprob), "bytes": raw, "top_logprobs": top})
            return {"content": content, "refusal": None}
        scored = [*(prompt.logprobs if prompt is not None else ()), *items]  # the echoed prompt's, then the chunk's
        ids = ([prompt.token_ids[0]] if prompt is not None else []) + [t.token_id for t in scored]
        tokens, offsets = [], []
        offset = self._offsets.get(index, 0)
        for token_id in ids:
            text, _ = self._token(token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        self._offsets[index] = offset
        first = [None] if prompt is not None else []
        return {"tokens": tokens, "token_logprobs": first + [self._value(t.logprob) for t in scored],
                "top_logprobs": first + [{self._token(a.token_id)[0]: self._value(a.logprob) for a in t.top_logprobs[: self.top]}
                                         for t in scored],
                "text_offset": offsets}

    def _vllm_prompt(self, prompt: generate_pb2.PromptLogprobs | None) -> dict:
        """vLLM's prompt_logprobs field ({} when not asked): per prompt token, null for the first, then {token id: {logprob,
        rank, decoded_token}} for the token and its prompt_top alternatives."""
        if self.prompt_top is None or prompt is None:
            return {}
        def item(token_id: int, logprob: float, rank: int) -> dict:
            return {"logprob": self._value(logprob), "rank": rank, "decoded_token": self._token(token_id)[0]}

        entries: list[dict | None] = [None]
        for t in prompt.logprobs:
            entry = {str(t.token_id): item(t.token_id, t.logprob, t.rank)}
            for rank, a in enumerate(t.top_logprobs[: self.prompt_top], 1):
                entry.setdefault(str(a.token_id), item(a.token_id, a.logprob, rank))
            entries.append(entry)
        return {"prompt_logprobs": entries}

    # --- choices ----------------------------------------------------------------------------------

    def _choice(self, index: int, text: str | None, finish: str | None, chunk: bool, role: bool = False,
                logprobs: dict | None = None) -> dict:
        if not self.chat:
            return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        if chunk:
            delta = {"role": "assistant", "content": text or ""} if role else ({"content": text} if text else {})
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish}

    def _final(self, index: int, text: str | None, result: generate_pb2.GenerationResult, chunk: bool,
               logprobs: dict | None = None, calls: list[dict] | None = None) -> dict:
        """The choice that ends a generation: OpenAI's finish_reason, and finish_details saying what ended it
        (max_tokens or the model's context both read "length"); with calls, the answer was a tool call."""
        ours = finish_reason_name(result.finish_reason)
        if calls is not None:
            choice = self._choice(index, None, "tool_calls", chunk, logprobs=logprobs)
            if not chunk:
                choice["message"]["tool_calls"] = calls
            return {**choice, "finish_details": {"type": FINISH_DETAIL[ours]}}
        details = {"type": FINISH_DETAIL[ours]}
        if ours == "context":
            s = result.stats
            details["message"] = (f"the model's context of {self.max_context} tokens is full: {s.prompt_tokens} prompt "
                                  f"+ {s.generated_tokens} generated tokens, before max_tokens was reached")
        return {**self._choice(index, text, FINISH_REASON[ours], chunk, logprobs=logprobs), "finish_details": details}

    def _calls(self, text: str) -> list[dict] | None:
        return self.tools.parse_call(text) if self.tools is not None else None

    def whole(self, choices: Sequence[Choice]) -> dict:
        out = []
        for i, c in enumerate(choices):
            text = self._echo(i) + "".join(c.text)
            logprobs = self._logprobs(i, c.logprobs, c.prompt if self.scored else None)
            out.append({**self._final(i, text, c.result, chunk=False, logprobs=logprobs, calls=self._calls(text)),
                        **({} if self.chat else self._vllm_prompt(c.prompt))})
        top = self._vllm_prompt(choices[0].prompt) if self.chat else {}  # (vLLM's chat: one, at the top level)
        return {**self._envelope(False), "choices": out, **top,
                "usage": self.usage({i: c.result for i, c in enumerate(choices)})}

    async def stream(self, n: int, events: AsyncIterator[Indexed], include_usage: bool, scope: dict,
                     error_key: str, on_error) -> AsyncIterator[str]:
        """Server-sent events of n choices' events (interleaved, each with its index), then [DONE]. A
        RequestError inside the stream becomes one error event (on_error(e) -> (status, body)); its status
        is left in scope[error_key] for the metrics."""
        extra = {"usage": None} if include_usage else {}
        results: dict[int, generate_pb2.GenerationResult] = {}
        try:
            if self.chat and self.prompt_top is None:  # OpenAI's first chunk of each choice announces the role
                for i in range(n):
                    yield sse({**self._envelope(True), "choices": [self._choice(i, "", None, True, role=True)], **extra})
            for i in range(n if self.echoed and not self.scored else 0):  # completions' echo: each choice's prompt first
                yield sse({**self._envelope(True), "choices": [self._choice(i, self._echo(i), None, True)], **extra})
            held: dict[int, Choice] = {}  # with tools: each choice's text and logprobs until its end
            async for i, event in events:
                if event.HasField("prompt_logprobs"):  # the prompt, scored, first (with the role; with the echo)
                    p = event.prompt_logprobs
                    if self.chat:
                        choice, vllm = self._choice(i, "", None, True, role=True), self._vllm_prompt(p)
                    else:
                        echo = self._echo(i) if self.scored else ""
                        logprobs = self._logprobs(i, [], p) if self.scored else None
                        choice, vllm = {**self._choice(i, echo, None, True, logprobs=logprobs), **self._vllm_prompt(p)}, {}
                    yield sse({**self._envelope(True), "choices": [choice], **vllm, **extra})
                elif event.HasField("chunk"):
                    c = event.chunk
                    if self.tools is not None:
                        held.setdefault(i, Choice()).text.append(c.text)
                        held[i].logprobs.extend(c.logprobs)
                    elif c.text or (self.logprobs and c.logprobs):
                        choice = self._choice(i, c.text, None, True, logprobs=self._logprobs(i, c.logprobs))
                        yield sse({**self._envelope(True), "choices": [choice], **extra})
                else:
                    results[i] = event.result
                    calls = None
                    if self.tools is not None:
                        h = held.pop(i, Choice())
                        text, logprobs = "".join(h.text), self._logprobs(i, h.logprobs)
                        calls = self._calls(text)
                        if calls is not None:
                            delta = {"tool_calls": [{"index": j, **call} for j, call in enumerate(calls)]}
                            choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": None}
                        else:
                            choice = self._choice(i, text, None, True, logprobs=logprobs)
                        yield sse({**self._envelope(True), "choices": [choice], **extra})
                    final = self._final(i, None, event.result, True, calls=calls)
                    yield sse({**self._envelope(True), "choices": [final], **extra})
            if include_usage:
                yield sse({**self._envelope(True), "choices": [], "usage": self.usage(results)})
        except RequestError as e:
            status, body = on_error(e)
            scope[error_key] = status
            yield sse(body)
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"
