"""The OpenAI-compatible HTTP API on the coordinator (FastAPI): POST /v1/chat/completions, POST
/v1/completions, POST /v1/responses (on the chat path: openai_responses), GET /v1/models, GET /health, and GET /metrics (the coordinator's Prometheus metrics, as
vLLM serves them on its API port; behind the token like the routes, unless metrics_public).

In front of the routes (coordinator.api.http_guard): the bearer token (the gRPC API's check) before the
body is read, and the body's size limit (413). Thin handlers: parse the body (openai_schema), convert it to
a GenerateRequest and hand it to the Frontend, the generation path the gRPC API uses too (same
validation, admission control, metrics, logs and session clean-up). Responses and errors follow OpenAI's
shapes: errors are {"error": {"message", "type", "param", "code"}} with 400 (bad input), 401 (missing or
wrong token), 404 (unknown model or path), 413 (a body over max_body_bytes), 429 (admission refusal), 503 (a tier unavailable), 504 (a
tier's deadline), 500. Streams are server-sent events ending with `data: [DONE]`; an error after the
stream started arrives as one `data: {"error": ...}` event before it. A client that disconnects (mid-stream,
or while waiting for a whole answer) cancels the generation, which ends its sessions on both tiers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from coordinator.api.frontend import Frontend
from coordinator.api.http_guard import BearerGuard, BodyLimit
from coordinator.api.openai_reply import Choice, Indexed, Reply
from coordinator.api.openai_responses import WORDS as RESPONSES_WORDS, ResponseReply, ResponsesRequest
from coordinator.api.openai_schema import (STRUCTURED_KINDS, BadRequest, ChatCompletionRequest, CompletionRequest,
                                           DetokenizeRequest, TokenizeRequest)
from specdec.proto import generate_pb2
from specdec.serving.metrics import METRICS_CONTENT_TYPE, RpcMetrics, exposition
from specdec.core.errors import RequestError

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
              405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}
# gRPC field names the OpenAI API spells otherwise, also in error messages.
RENAMED_IN_MESSAGES = ("max_new_tokens", "chat.messages", "chat.continue_final_message")
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/tokenize", "/detokenize")
CHAT_WORDS = {"chat.messages": "messages", "chat.continue_final_message": "continue_final_message"}  # (the chat's fields)
STREAM_ERROR = "specdec.stream_error"  # scope key: the status of an error sent inside a started stream
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @classmethod
    def from_request_error(cls, e: RequestError, words: dict[str, str] | None = None) -> "ApiError":
        """words: the request's field names (RequestError.field, the gRPC message's) -> this API's, for the
        param and the message (max_new_tokens -> max_tokens; chat.messages[1].role -> messages[1].role)."""
        param, message = e.field, e.message
        for ours, theirs in (words or {}).items():
            if param is not None and (param == ours or param.startswith((ours + "[", ours + "."))):
                param = theirs + param[len(ours):]
                if ours in RENAMED_IN_MESSAGES or ours.startswith("response_format."):
                    message = message.replace(ours, theirs)
                break
        return cls(HTTP_STATUS.get(e.code, 500), message, param=param, code=e.code.name.lower())

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPE.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class EventStream(StreamingResponse):
    """Server-sent events whose generator is always closed, also when the client goes away while the
    stream waits at a yield (so the generation is cancelled and its tier sessions ended at once)."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class HttpMetrics:
    """ASGI middleware: specdec_rpc_duration_seconds / specdec_rpc_errors_total for each API route, with the
    HTTP status as the code (an error inside a started stream counts with that error's status)."""

    def __init__(self, app, rpc: RpcMetrics) -> None:
        self.app = app
        self.rpc = rpc

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in ("/health", "/metrics"):
            return await self.app(scope, receive, send)
        route = f"{scope['method']} {scope['path']}" if scope["path"] in ROUTES else "other"
        status = {"code": "500"}

        async def send_status(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = str(message["status"])
            await send(message)

        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, send_status)
        finally:
            self.rpc.observe(route, str(scope.get(STREAM_ERROR) or status["code"]), time.perf_counter() - t0)


def invalid_json(body: bytes, err: dict) -> ApiError:
    """400 for a body that is not JSON, saying where: line and column (1-based), as json.loads does."""
    pos = err["loc"][-1] if isinstance(err.get("loc", [None])[-1], int) else 0
    text = body.decode("utf-8", errors="replace")
    line = text.count("\n", 0, pos) + 1
    column = pos - (text.rfind("\n", 0, pos) + 1) + 1
    reason = (err.get("ctx") or {}).get("error") or err.get("msg", "invalid JSON")
    return ApiError(400, f"the request body is not valid JSON: {reason} at line {line} column {column} (char {pos})",
                    code="invalid_json")


def api_words(body: ChatCompletionRequest | CompletionRequest, chat: bool) -> dict[str, str]:
    """GenerateRequest field -> this request's parameter, for errors (ApiError.from_request_error)."""
    max_param = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
    words = {"max_new_tokens": max_param, **CHAT_WORDS, "prompt": "messages" if chat else "prompt"}
    constraint = body.constraint_param()  # (vLLM's fields: a grammar that does not compile is named as it came)
    if constraint == "structured_outputs":
        kind = next(k for k in STRUCTURED_KINDS if body.structured_outputs.get(k) is not None)
        constraint = f"structured_outputs.{kind}"
    if constraint != "response_format":
        words.update({f"response_format.{f}": constraint for f in ("json_schema", "json_object", "regex", "lark")})
    return words


def create_app(frontend: Frontend, auth_token: str | None = None, max_body_bytes: int = 4 * 2**20,
               metrics_public: bool = False) -> FastAPI:
    """auth_token: set = every path but /health (and /metrics where metrics_public) needs it, checked before
    the body is read. max_body_bytes: larger bodies get 413 (by Content-Length before they are read)."""
    app = FastAPI(title="specdec", docs_url=None, redoc_url=None, openapi_url=None)

    def refuse(status: int, message: str, code: str):
        return ApiError(status, message, code=code).response()

    # The last added is the outermost: HttpMetrics (counting refusals too), the token, then the body's size.
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, refuse=refuse)
    if auth_token:
        app.add_middleware(BearerGuard, token=auth_token.encode(), metrics_public=metrics_public, refuse=refuse)
    app.add_middleware(HttpMetrics, rpc=frontend.metrics.rpc)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        if err.get("type") == "json_invalid":  # loc = ("body", character offset)
            return invalid_json(await request.body(), err).response()
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        field = ".".join(loc) or None
        message = f"{field}: {err.get('msg', 'invalid')}" if field else err.get("msg", "invalid request body")
        return ApiError(400, message, param=field, code="invalid_argument").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 413:  # BodyLimit, cutting a chunked body
            return ApiError(413, str(e.detail), code="request_too_large").response()
        return ApiError(e.status_code, str(e.detail)).response()

    @app.get("/health")
    async def health():
        """200 while the coordinator can serve; 503 while draining or while no target replica answers (the
        readiness a load balancer needs). A missing draft tier only degrades: 200, saying so."""
        if not frontend.accepting:
            return JSONResponse({"status": "draining"}, status_code=503)
        target, draft = frontend.pipeline.target_reachability, frontend.pipeline.draft_reachability
        if not target.reachable:
            return JSONResponse({"status": "unavailable", "message": target.why()}, status_code=503)
        if draft is not None and not draft.reachable:
            return {"status": "ok", "draft": f"{draft.why()}: drafting by prompt lookup"}
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(exposition(frontend.metrics.registry), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": frontend.model_name, "object": "model", "created": created, "owned_by": "specdec",
            "root": frontend.model_name, "max_model_len": frontend.pipeline.target_info.max_context}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """vLLM's: the prompt's token ids as a generation request gets them (a chat through the validator's template
        rendering, its checks included)."""
        _check_model(frontend, body.model)
        try:
            chat = body.chat()
        except BadRequest as e:
            raise ApiError(400, str(e), param=e.param, code="invalid_argument") from None
        tok = frontend.pipeline.tokenizer

        def ids() -> list[int]:
            if chat is None:
                return list(tok(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
            return frontend.validate.prompt_ids(chat)

        try:
            tokens = await asyncio.get_running_loop().run_in_executor(None, ids)  # (the tokenizer drops the GIL)
        except RequestError as e:
            raise ApiError.from_request_error(e, CHAT_WORDS) from None
        return {"count": len(tokens), "max_model_len": frontend.pipeline.target_info.max_context, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        """vLLM's: token ids as text (special tokens included)."""
        _check_model(frontend, body.model)
        vocab = frontend.pipeline.target_info.vocab_size
        if bad := [t for t in body.tokens if not 0 <= t < vocab]:
            raise ApiError(400, f"tokens: ids must be in [0, {vocab}), got {bad[:5]}", param="tokens",
                           code="invalid_argument")
        return {"prompt": frontend.pipeline.tokenizer.decode(body.tokens)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _generate(frontend, body, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _generate(frontend, body, request, chat=False)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await _respond(frontend, body, request)

    return app


def _check_model(frontend: Frontend, name: str | None) -> None:
    """404 model_not_found unless `name` is the served model (None: not given, as /tokenize allows)."""
    if name is not None and name != frontend.model_name:
        raise ApiError(404, f"The model `{name}` does not exist; this server serves `{frontend.model_name}`",
                       param="model", code="model_not_found")


async def _generate(frontend: Frontend, body: ChatCompletionRequest | CompletionRequest, request: Request, chat: bool):
    _check_model(frontend, body.model)
    greqs = _requests(body)  # one per choice (n per prompt)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    words = api_words(body, chat)
    events = await _start(frontend, greqs, rid, words)
    tools = body.tool_use() if chat else None
    reply = Reply(rid, frontend.model_name, chat, frontend.pipeline.tokenizer, logprobs=greqs[0].logprobs,
                  max_context=frontend.pipeline.target_info.max_context,
                  tools=tools if tools is not None and tools.active else None, per_prompt=body.n,
                  echoed=() if chat else body.echoed(frontend.pipeline.tokenizer), top=body.top,
                  prompt_top=body.prompt_logprobs)
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return EventStream(reply.stream(len(greqs), events, usage, request.scope, STREAM_ERROR, _stream_error))
    return reply.whole(await _collected(request, len(greqs), events, words))


async def _respond(frontend: Frontend, body: ResponsesRequest, request: Request):
    """/v1/responses: the request as the chat completion it amounts to (coordinator.api.openai_responses)."""
    _check_model(frontend, body.model)
    reply = ResponseReply(body, frontend.model_name)
    events = await _start(frontend, _requests(body), reply.id, RESPONSES_WORDS)
    if body.stream:
        return EventStream(reply.stream(events, request.scope, STREAM_ERROR, _stream_error))
    (choice,) = await _collected(request, 1, events, RESPONSES_WORDS)
    return reply.response("".join(choice.text), choice.result)


def _requests(body: ChatCompletionRequest | CompletionRequest | ResponsesRequest) -> list[generate_pb2.GenerateRequest]:
    """The body's GenerateRequests, one per choice, or a 400 naming the field."""
    try:
        return body.to_generate_requests()
    except BadRequest as e:
        raise ApiError(400, str(e), param=e.param, code="invalid_argument") from None


async def _start(frontend: Frontend, greqs: list[generate_pb2.GenerateRequest], rid: str,
                 words: dict[str, str]) -> AsyncIterator[Indexed]:
    """The generations started and their first events awaited, so that bad input, admission and a first round that
    fails get their HTTP status, not a broken stream; then their events, merged (_merge)."""
    streams, firsts = [], []
    try:
        for i, greq in enumerate(greqs):
            streams.append(frontend.generate(greq, api="http", request_id=rid if len(greqs) == 1 else f"{rid}-{i}"))
            firsts.append(await streams[-1].__anext__())
    except RequestError as e:
        for events in streams:
            await events.aclose()
        raise ApiError.from_request_error(e, words) from None
    return _merge(firsts, streams)


async def _collected(request: Request, n: int, events: AsyncIterator[Indexed], words: dict[str, str]) -> list[Choice]:
    """Each choice collected, the generations stopped (499) if the client goes away meanwhile."""
    collect = asyncio.ensure_future(_collect(n, events))
    try:
        while not (await asyncio.wait({collect}, timeout=DISCONNECT_POLL_S))[0]:
            if await request.is_disconnected():  # nobody will read the answer: stop generating
                raise ApiError(499, "the client closed the request", code="cancelled")
        return collect.result()
    except RequestError as e:
        raise ApiError.from_request_error(e, words) from None
    finally:
        if not collect.done():
            collect.cancel()  # cancels the generations inside it: their sessions are ended
            with contextlib.suppress(BaseException):
                await collect
        await events.aclose()


def _stream_error(e: RequestError) -> tuple[int, dict]:
    err = ApiError.from_request_error(e)
    return err.status, err.body()


async def _merge(firsts: list[generate_pb2.GenerateResponse],
                 streams: list[AsyncIterator[generate_pb2.GenerateResponse]]) -> AsyncIterator[Indexed]:
    """The events of the choices' generations as (index, event), in the order they arrive. One choice runs
    inline; several run as tasks feeding a queue. Closing this closes every generation (ending its sessions)."""
    if len(streams) == 1:
        try:
            yield 0, firsts[0]
            async for event in streams[0]:
                yield 0, event
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            await queue.put((i, firsts[i]))
            async for event in streams[i]:
                await queue.put((i, event))
            await queue.put((i, None))
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
    try:
        running = len(streams)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for events in streams:
            await events.aclose()


async def _collect(n: int, events: AsyncIterator[Indexed]) -> list[Choice]:
    """Each choice's text, logprobs and result."""
    choices = [Choice() for _ in range(n)]
    async for i, event in events:
        if event.HasField("chunk"):
            choices[i].text.append(event.chunk.text)
            choices[i].logprobs.extend(event.chunk.logprobs)
        elif event.HasField("prompt_logprobs"):
            choices[i].prompt = event.prompt_logprobs
        else:
            choices[i].result = event.result
    return choices
