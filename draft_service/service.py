"""DraftService: Propose / ProposeStream / EndSession / GetModelInfo / GetStatus, over a batching engine.

The servicer is thin: to_work() holds every check of a ProposeRequest and its conversion to a ProposeWork,
to_response() the conversion back (q through specdec.serving.draft_probs, the wire codec)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from draft_service.direct import TargetLink, drive
from specdec.core.errors import TIER_STATUS_METADATA, RequestError, as_request_error, invalid_argument
from specdec.core.settings import setting
from specdec.engine.config import TierConfig
from specdec.engine.eagle3_features import from_bytes
from specdec.engine.engine import Engine
from specdec.engine.head_weights import is_head
from specdec.engine.propose import ProposeResult, ProposeWork
from specdec.engine.propose_tree import ProposeTreeWork, TreeProposeResult
from specdec.engine.pushed import PushedProposal
from specdec.proto import draft_pb2, draft_pb2_grpc
from specdec.serving import draft_probs, draft_tree, sampling_params
from specdec.serving.features import SessionFeatures
from specdec.serving.server import Service, ServerConfig, client_credentials, handle_errors
from specdec.serving.tier_trace import traced
from specdec.serving.tier import TierRpcs, TierServer, create_tier_server, model_info, serve_session_stream
from specdec.serving.tier_checks import check_context, check_num_tokens

if TYPE_CHECKING:
    from specdec.engine.head_engine import HeadEngine

SERVICE_NAME = "specdec.v1.DraftService"
DIRECT_TLS_SETTINGS = ("direct_target_ca", "direct_target_client_cert", "direct_target_client_key",
                       "direct_target_server_name")


@dataclass(frozen=True)
class DraftConfig:
    """The draft tier."""

    tier: TierConfig
    server: ServerConfig = ServerConfig()
    draft_top_n: int = 64  # tokens kept in each q row on the wire (DESIGN.md, q on the wire)
    # A feature draft (--model an EAGLE-3 head's directory): the target it drafts for (HF directory, .gguf or hub
    # id), whose config, tokenizer and input embedding the head reads; empty = the default target
    head_target: str = setting("", flag="head-target")
    # Direct rounds (DraftService.Drive): the target tier's gRPC address as this replica reaches it (the
    # coordinator's --target); empty = Drive refused and the coordinator runs every round itself
    direct_target: str = setting("", flag="direct-target")
    # TLS to that target (it serves TLS): the CA its certificate is checked against; empty = plaintext
    direct_target_ca: str = setting("", flag="direct-target-ca")
    # This replica's client certificate for that channel, where the target asks for one (mutual TLS)
    direct_target_client_cert: str = setting("", flag="direct-target-client-cert")
    # The key of --direct-target-client-cert
    direct_target_client_key: str = setting("", flag="direct-target-client-key")
    # The name the target's certificate carries, where it is not --direct-target's host
    direct_target_server_name: str = setting("", flag="direct-target-server-name")

    def __post_init__(self) -> None:
        tls = [n for n in DIRECT_TLS_SETTINGS if getattr(self, n)]
        if tls and not self.direct_target:
            raise ValueError(f"{' and '.join(tls)} {'needs' if len(tls) == 1 else 'need'} direct_target")


def target_link(config: DraftConfig) -> TargetLink | None:
    """The channel to the target for direct rounds (not yet opened), or None without --direct-target; raises on
    unusable TLS settings or files."""
    if not config.direct_target:
        return None
    credentials, options = client_credentials(config.direct_target_ca, config.direct_target_client_cert,
                                              config.direct_target_client_key, config.direct_target_server_name,
                                              DIRECT_TLS_SETTINGS)
    return TargetLink(config.direct_target, config.server.max_message_bytes, credentials=credentials, options=options)


def load_engine(config: DraftConfig) -> Engine | HeadEngine:
    """The tier's engine: a HeadEngine when --model is an EAGLE-3 head's checkpoint, else a draft model's Engine."""
    if is_head(config.tier.model.path):
        from specdec.engine.head_engine import HeadEngine  # imports transformers' Llama modules: for a head only
        from specdec.models import default_target

        return HeadEngine.load(config.tier, config.head_target or default_target())
    return Engine.load(config.tier)


class DraftServicer(TierRpcs, draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, engine: Engine, draft_top_n: int, target: TargetLink | None = None) -> None:
        """target: the target tier, for direct rounds (None: Drive refused)."""
        if draft_top_n < 1:
            raise ValueError(f"draft_top_n must be >= 1, got {draft_top_n}")
        self.engine = engine
        self.draft_top_n = draft_top_n
        self.target = target

    @handle_errors
    async def GetModelInfo(self, request, context):
        info = model_info(self.engine)
        info.direct_rounds = self.target is not None
        info.direct_tls = info.direct_rounds and self.target.tls
        return info

    @handle_errors
    async def Propose(self, request, context):
        return await self._propose(request)

    async def ProposeStream(self, request_iterator, context):
        """Replies in request order, and between them the pushed proposals (ProposeRequest.push) as they come."""
        writing = asyncio.Lock()  # one write at a time: the replies' and the pushes'

        async def write(message: draft_pb2.ProposeResponse) -> None:
            async with writing:
                await context.write(message)

        pushes: set[asyncio.Task] = set()

        def push(results: list[PushedProposal]) -> None:
            for p in results:
                task = asyncio.ensure_future(write(self.pushed_response(p)))
                pushes.add(task)
                task.add_done_callback(_written)

        def _written(task: asyncio.Task) -> None:
            pushes.discard(task)
            if not task.cancelled():
                task.exception()  # a push after the stream ended is lost with it; the caller drafts as usual

        try:
            async for response in serve_session_stream(self, request_iterator, context,
                                                       lambda request: self._propose(request, push)):
                await write(response)
        finally:
            for task in list(pushes):
                task.cancel()

    async def Drive(self, request, context):
        """A session's rounds from this replica (draft_service.direct); the session is dropped when they end."""
        try:
            if self.target is None:
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, "direct rounds: this replica has no "
                                   "--direct-target (the target tier's address)")
            if request.context.prefix_len != 0:
                raise invalid_argument("context.prefix_len: a Drive sends the whole committed sequence (prefix_len 0)")
            if request.max_new_tokens < 1:
                raise invalid_argument(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
            check_num_tokens(self.engine, request.num_tokens, "num_tokens", minimum=1)
            check_context(self.engine, request.context, extra_tokens=0)
            sampling_params.decode(request.sampling, self.engine.vocab_size, len(request.context.new_tokens))
            engine = self.engine
            features = SessionFeatures(list(engine.feature_layers), engine.feature_width) if engine.feature_draft else None
            async for event in drive(request, self._propose, self.target, engine.max_context,
                                     draining=lambda: self.draining, features=features):
                await context.write(event)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            err = as_request_error(e)
            await context.abort(err.code, err.message, TIER_STATUS_METADATA)
        finally:
            if request.context.session_id:
                self.engine.end_session(request.context.session_id)

    async def _propose(self, request: draft_pb2.ProposeRequest, push=None, inline: bool = True) -> draft_pb2.ProposeResponse:
        def to_work(r: draft_pb2.ProposeRequest):
            work = self.to_work(r)
            work.on_push, work.inline = push if r.push else None, inline
            return work

        return await traced(request, to_work, self.engine.submit, self.to_response)

    @classmethod
    def pushed_response(cls, p: PushedProposal) -> draft_pb2.ProposeResponse:
        response = cls.to_response(p.result)
        response.pushed, response.pushed_prefix_len, response.pushed_prefix_hash = True, p.prefix_len, p.prefix_hash
        return response

    def to_work(self, request: draft_pb2.ProposeRequest) -> ProposeWork | ProposeTreeWork:
        """The request as the engine's work, or RequestError(INVALID_ARGUMENT) naming the field."""
        engine = self.engine
        head = engine.feature_draft
        if head and request.tree_nodes and (request.speculate or request.push):
            raise invalid_argument("speculate: this replica serves an EAGLE-3 head, which has no speculation cache")
        if request.tree_nodes:
            work = self._tree_work(request)
            if head:
                work.features, work.features_start = self._features(request, engine)
            return work
        check_num_tokens(engine, request.num_tokens, "num_tokens", minimum=1)
        check_context(engine, request.context, extra_tokens=request.num_tokens - 1)
        ctx = request.context
        params, prompt_len = sampling_params.decode(request.sampling, engine.vocab_size,
                                                     ctx.prefix_len + len(ctx.new_tokens))
        draft_tree.shape_of(request, params, engine.config.max_draft_tokens)  # a chain: no tree fields
        if request.push:
            raise invalid_argument("push: only for token-tree requests with speculate > 0 (a chain is tree_branching 1)")
        if request.grammar and head:
            raise invalid_argument("grammar: this replica serves an EAGLE-3 head, which proposes unconstrained (the "
                                   "coordinator checks its drafts against the grammar)")
        if request.grammar and (error := engine.grammars.check(request.grammar)):
            raise invalid_argument(f"grammar: {error}")
        work = ProposeWork.create(ctx.session_id, ctx.prefix_len, ctx.prefix_hash, list(ctx.new_tokens),
                                  request.num_tokens, params, request.seed, self.draft_top_n, prompt_len=prompt_len,
                                  grammar=request.grammar)
        if head:
            work.features, work.features_start = self._features(request, engine)
        return work

    @staticmethod
    def _features(request: draft_pb2.ProposeRequest, engine: HeadEngine):
        """The request's feature rows (bfloat16 [n, W]) and the position of the first, checked."""
        width, data = engine.feature_width, request.features
        if request.features_start < 0:
            raise invalid_argument(f"features_start: {request.features_start} is negative")
        if request.context.prefix_len == 0 and data and request.features_start:
            raise invalid_argument(f"features_start: a full send (context.prefix_len 0) starts the rows again at 0, "
                                   f"not {request.features_start}")
        if len(data) % (2 * width):
            raise invalid_argument(f"features: {len(data)} bytes are not whole rows of {width} bfloat16 numbers "
                                   f"(the target's layers {engine.feature_layers})")
        end = request.features_start + len(data) // (2 * width)
        committed = request.context.prefix_len + len(request.context.new_tokens)
        if end > committed:
            raise invalid_argument(f"features: rows up to position {end - 1}, past the committed sequence's "
                                   f"{committed} tokens")
        return (from_bytes(data, width) if data else None), request.features_start

    def _tree_work(self, request: draft_pb2.ProposeRequest) -> ProposeTreeWork:
        engine, ctx = self.engine, request.context
        params, _ = sampling_params.decode(request.sampling, engine.vocab_size, ctx.prefix_len + len(ctx.new_tokens))
        shape = draft_tree.shape_of(request, params, engine.config.max_draft_tokens)
        check_context(engine, ctx, extra_tokens=shape.nodes)
        if request.push and not request.speculate:
            raise invalid_argument("push: pushed proposals come from the speculation cache; set speculate > 0")
        return ProposeTreeWork.create(ctx.session_id, ctx.prefix_len, ctx.prefix_hash, list(ctx.new_tokens), shape,
                                      params, request.seed, self.draft_top_n, request.speculate, push=request.push)

    @staticmethod
    def to_response(r: ProposeResult) -> draft_pb2.ProposeResponse:
        response = draft_pb2.ProposeResponse(
            tokens=r.tokens, q=draft_probs.encode(r.q), cached_len=r.cached_len, compute_ms=r.compute_ms,
            batch_sessions=r.batch_sessions, step_ms=r.step_ms, queue_ms=r.queue_ms, prefix_reused=r.reused,
            step_id=r.step_id)
        return draft_tree.encode(r, response) if isinstance(r, TreeProposeResult) else response


def build(config: DraftConfig, engine: Engine | None = None) -> TierServer:
    """The draft service's server (not started); loads the model unless `engine` is given."""
    engine = engine or load_engine(config)
    service = Service(DraftServicer(engine, config.draft_top_n, target_link(config)), draft_pb2_grpc.add_DraftServiceServicer_to_server,
                      SERVICE_NAME)
    return create_tier_server(engine, service, config.server, "draft")
