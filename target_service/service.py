"""TargetService: Verify / VerifyStream / EndSession / GetModelInfo / GetStatus, over a batching engine.

The servicer is thin: to_work() holds every check of a VerifyRequest (q through specdec.serving.draft_probs,
the wire codec; a token tree through specdec.serving.token_tree) and its conversion to a VerifyWork, to_response() the conversion back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from specdec.core.errors import check_token_ids, invalid_argument
from specdec.core.items_until import items_until
from specdec.core.limits import MAX_RUN_ON
from specdec.engine.config import TierConfig
from specdec.engine.engine import Engine
from specdec.engine.eagle3_features import to_bytes
from specdec.engine.verify import MAX_FEATURE_LAYERS, MAX_TOP_LOGPROBS, TokenLogprobs, VerifyResult, VerifyWork
from specdec.proto import target_pb2, target_pb2_grpc
from specdec.serving import draft_probs, sampling_params, token_masks
from specdec.serving.token_tree import tree_of
from specdec.serving.server import Service, ServerConfig, handle_errors
from specdec.serving.tier_trace import traced
from specdec.serving.tier import TierRpcs, TierServer, create_tier_server, serve_session_stream
from specdec.serving.tier_checks import check_context, check_num_tokens

SERVICE_NAME = "specdec.v1.TargetService"


@dataclass(frozen=True)
class TargetConfig:
    """The target tier."""

    tier: TierConfig
    server: ServerConfig = ServerConfig()

    def __post_init__(self) -> None:
        if self.tier.step.quantize != "none":  # only a draft may run other weights than its checkpoint's
            raise ValueError(f"quantize {self.tier.step.quantize!r} would make the target another model than the "
                             "reference, and the output would no longer be the target's: only a draft tier takes it")
        if self.tier.step.draft_vocab.strip() != "0":  # likewise a head over part of the vocabulary
            raise ValueError(f"draft_vocab {self.tier.step.draft_vocab!r} would keep the target from ever emitting "
                             "the tokens outside it: only a draft tier takes it")


RESPONSE_HEADROOM = 64 * 1024  # bytes of a VerifyResponse besides its features (17 tokens' top-20 logprobs: ~3 KiB)


class TargetServicer(TierRpcs, target_pb2_grpc.TargetServiceServicer):
    def __init__(self, engine: Engine, max_message_bytes: int = ServerConfig.max_message_bytes) -> None:
        """max_message_bytes: the server's limit on a message it sends (ServerConfig): a request whose features
        could not fit in its response is refused before it runs."""
        self.engine = engine
        self.max_feature_bytes = max_message_bytes - RESPONSE_HEADROOM

    @handle_errors
    async def Verify(self, request, context):
        return await self._verify(request)

    async def VerifyStream(self, request_iterator, context):
        async for response in serve_session_stream(self, request_iterator, context, self._verify, self._in_parts):
            yield response

    async def _verify(self, request: target_pb2.VerifyRequest) -> target_pb2.VerifyResponse:
        return await traced(request, self._unparted, self.engine.submit, self.to_response)

    def _unparted(self, request: target_pb2.VerifyRequest) -> VerifyWork:
        work = self.to_work(request)
        work.part = 0  # (a unary Verify has no stream to send parts on)
        return work

    def _in_parts(self, request: target_pb2.VerifyRequest) -> AsyncIterator[target_pb2.VerifyResponse] | None:
        """A request that asks for its run-on in parts: its partial responses as the engine pushes them, then its
        response (None: any other request)."""
        return self._parts_then_response(request) if request.run_on_part > 0 and request.run_on_seeds else None

    async def _parts_then_response(self, request: target_pb2.VerifyRequest) -> AsyncIterator[target_pb2.VerifyResponse]:
        parts: asyncio.Queue = asyncio.Queue()

        def to_work(r: target_pb2.VerifyRequest) -> VerifyWork:
            work = self.to_work(r)
            work.on_push = lambda results: [parts.put_nowait(x) for x in results]
            return work

        answer = asyncio.ensure_future(traced(request, to_work, self.engine.submit, self.to_response))
        try:
            async for part in items_until(parts, answer):
                response = self.to_response(part)
                response.partial = True
                yield response
            yield answer.result()  # (the parts still queued are in it: dropped)
        finally:
            answer.cancel()

    def to_work(self, request: target_pb2.VerifyRequest) -> VerifyWork:
        """The request as the engine's work, or RequestError(INVALID_ARGUMENT) naming the field."""
        engine = self.engine
        k = len(request.draft_tokens)
        check_num_tokens(engine, k, "draft_tokens (count)", minimum=0)
        check_context(engine, request.context, extra_tokens=k)
        check_token_ids(request.draft_tokens, engine.vocab_size, "draft_tokens")
        q = draft_probs.decode(request.q, k, engine.vocab_size)
        if q is not None and request.race_seed:
            raise invalid_argument("q: not with race_seed (a keyed-race verification uses no draft distribution)")
        if (request.logprobs or request.prompt_logprobs) and not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise invalid_argument(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {request.top_logprobs}")
        ctx = request.context
        if request.prompt_logprobs:
            check_prompt_logprobs(request, self.max_feature_bytes)
        params, prompt_len = sampling_params.decode(request.sampling, engine.vocab_size,
                                                     ctx.prefix_len + len(ctx.new_tokens))
        parents, scheme = tree_of(request, q is not None, params.greedy or bool(request.race_seed), engine)
        allowed = token_masks.decode(request.token_masks, k + 1, engine.vocab_size)
        if parents is not None and params.penalized:
            raise invalid_argument("draft_parents: token trees take no presence, frequency or repetition penalty "
                                   "(send the drafts as a chain)")
        layers = feature_layers(request, engine, self.max_feature_bytes)
        if request.run_on_seeds and (request.token_masks or layers):
            raise invalid_argument("run_on_seeds: not with token_masks or feature_layers (the target decodes on by "
                                   "itself, with no grammar's masks and no features)")
        if len(request.run_on_seeds) > MAX_RUN_ON:
            raise invalid_argument(f"run_on_seeds: at most {MAX_RUN_ON} tokens a request, got {len(request.run_on_seeds)}")
        if request.run_on_part < 0:
            raise invalid_argument(f"run_on_part must be >= 0, got {request.run_on_part}")
        return VerifyWork.create(ctx.session_id, ctx.prefix_len, ctx.prefix_hash, list(ctx.new_tokens),
                                 list(request.draft_tokens), q, params, request.seed, prompt_len=prompt_len,
                                 logprobs=request.top_logprobs if request.logprobs else -1, parents=parents,
                                 scheme=scheme, allowed=allowed, feature_layers=layers,
                                 run_on_seeds=list(request.run_on_seeds), run_on_part=request.run_on_part,
                                 prompt_logprobs=request.top_logprobs if request.prompt_logprobs else -1,
                                 race_seed=request.race_seed)

    @staticmethod
    def to_response(r: VerifyResult) -> target_pb2.VerifyResponse:
        return target_pb2.VerifyResponse(num_accepted=r.num_accepted, next_token=r.next_token, cached_len=r.cached_len,
                                         compute_ms=r.compute_ms, batch_sessions=r.batch_sessions,
                                         batch_tokens=r.batch_tokens, step_ms=r.step_ms, queue_ms=r.queue_ms,
                                         prefix_reused=r.reused, accepted_path=r.path if r.tree else (),
                                         features=to_bytes(r.features) if r.features is not None else b"",
                                         features_start=r.features_start, run_on_tokens=r.run_on, step_id=r.step_id,
                                         logprobs=wire_logprobs(r.logprobs),
                                         prompt_logprobs=wire_logprobs(r.prompt_logprobs))


def wire_logprobs(items: list[TokenLogprobs]) -> list[target_pb2.TokenLogprobs]:
    return [target_pb2.TokenLogprobs(token_id=t.token_id, logprob=t.logprob, top_token_ids=t.top_ids,
                                     top_logprobs=t.top_logprobs, rank=t.rank) for t in items]


def check_prompt_logprobs(request: target_pb2.VerifyRequest, max_bytes: int) -> None:
    """INVALID_ARGUMENT naming prompt_logprobs: not on a full send, or more scores than one response can carry."""
    if request.context.prefix_len:
        raise invalid_argument(f"prompt_logprobs: only on a full send (context.prefix_len 0, got "
                               f"{request.context.prefix_len}): the first new token's score needs the row before it")
    per_token = 24 + 10 * request.top_logprobs  # a TokenLogprobs on the wire at the most (varints, floats, tags)
    if len(request.context.new_tokens) * per_token > max_bytes:
        raise invalid_argument(f"prompt_logprobs: the scores of {len(request.context.new_tokens)} tokens would not fit "
                               f"in one response ({max_bytes} bytes) at top_logprobs {request.top_logprobs}")


def feature_layers(request: target_pb2.VerifyRequest, engine: Engine, max_bytes: int) -> list[int]:
    """The decoder layers whose features the request asks for, or INVALID_ARGUMENT naming feature_layers: too many,
    an id past the model's depth, or more positions than one response (max_bytes of features) can carry."""
    layers = list(request.feature_layers)
    if len(layers) > MAX_FEATURE_LAYERS:
        raise invalid_argument(f"feature_layers: at most {MAX_FEATURE_LAYERS} layer ids, got {len(layers)}: {layers}")
    outside = [i for i in layers if not 0 <= i < engine.num_layers]
    if outside:
        raise invalid_argument(f"feature_layers: layer ids must be in [0, {engine.num_layers}) (the model's decoder "
                               f"layers), got {outside}")
    row_bytes = 2 * len(layers) * engine.hidden_size  # one position's features, 16-bit
    positions = len(request.context.new_tokens) + len(request.draft_tokens)  # the most rows the response carries
    if layers and positions * row_bytes > max_bytes:
        raise invalid_argument(f"feature_layers: the features of {positions} positions ({row_bytes} bytes each) would "
                               f"not fit in one response ({max_bytes} bytes): send the new tokens in parts "
                               f"(prefix_len > 0), at most {max(0, max_bytes // row_bytes)} positions a request")
    return layers


def build(config: TargetConfig, engine: Engine | None = None) -> TierServer:
    """The target service's server (not started); loads the model unless `engine` is given."""
    engine = engine or Engine.load(config.tier)
    service = Service(TargetServicer(engine, config.server.max_message_bytes),
                      target_pb2_grpc.add_TargetServiceServicer_to_server, SERVICE_NAME)
    return create_tier_server(engine, service, config.server, "target")
