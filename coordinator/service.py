"""Generation service: validates requests, builds prompts, runs Generations, reports info."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field

import grpc

from coordinator.adaptive import AdaptiveConfig
from coordinator.admission import Admission, AdmissionConfig
from coordinator.generation import Generation, GenerationParams, Limits
from coordinator.lookup import LookupConfig
from coordinator.proposers import DRAFT_MODEL, HYBRID, PROMPT_LOOKUP
from coordinator.suffix import SuffixCache, SuffixConfig
from coordinator.tiers import DraftClient, TargetClient, TierError
from specdec.models import load_tokenizer, tokenizer_fingerprint
from specdec.proto import common_pb2, generate_pb2, generate_pb2_grpc
from specdec.math.params import SamplingParams
from specdec.wire.server import (BearerTokenInterceptor, RequestError, Service, ServerConfig, as_request_error, create_server,
                            check_token_ids, handle_errors, invalid_argument, read_pem)

log = logging.getLogger(__name__)

SERVICE_NAME = "specdec.v1.Generation"
CHAT_ROLES = {"system", "user", "assistant"}
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
# The request's proposer enum -> the coordinator's names. SUFFIX has no enum value yet: it is reached
# through --default-proposer suffix until generate.proto gets PROPOSER_SUFFIX (then one line here:
# generate_pb2.PROPOSER_SUFFIX: SUFFIX).
PROPOSER_NAMES = {
    generate_pb2.PROPOSER_DRAFT_MODEL: DRAFT_MODEL,
    generate_pb2.PROPOSER_PROMPT_LOOKUP: PROMPT_LOOKUP,
    generate_pb2.PROPOSER_HYBRID: HYBRID,
}
# Tier failures the client sees with their own code; anything else is our bug -> INTERNAL.
_PASS_THROUGH = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}


@dataclass(frozen=True)
class CoordinatorConfig:
    target_address: str  # host:port of the target service
    draft_address: str | None  # host:port of the draft service; None = target-only decoding
    tokenizer: str  # model path / hub id whose tokenizer the coordinator uses (same as the tiers')
    server: ServerConfig = ServerConfig()
    default_max_new_tokens: int = 128  # when a request leaves max_new_tokens unset
    max_new_tokens_cap: int = 4096  # larger requests are rejected
    max_prompt_tokens: int = 8192  # longer prompts are rejected
    default_num_speculative_tokens: int | None = None  # K when a request leaves it unset; None = adaptive
    max_num_speculative_tokens: int = 16  # larger K is rejected
    default_proposer: str = HYBRID  # draft_model | prompt_lookup | suffix | hybrid, when a request leaves it unset
    adaptive: AdaptiveConfig = AdaptiveConfig()  # adaptive-K controller settings
    lookup: LookupConfig = LookupConfig()  # prompt-lookup n-gram sizes
    suffix: SuffixConfig = SuffixConfig()  # suffix decoding: tree depth, proposal length, shared-tree bounds
    overlap: bool = False  # pre-draft round r+1 while the target verifies round r
    tier_retry_s: float = 30.0  # retry an unreachable target this long when the client set no deadline
    admission: AdmissionConfig = AdmissionConfig()  # concurrency and request-rate limits
    rpc_timeout_s: float = 60.0  # deadline of each internal rpc
    connect_timeout_s: float = 300.0  # how long to wait at start-up for the tiers to answer
    # --- security (README, Security) ---
    tier_ca: str | None = None  # PEM CA that signed the tiers' certs; set = TLS to the tiers (else plaintext)
    tier_client_cert: str | None = None  # PEM client cert chain presented to the tiers (mutual TLS); needs tier_ca
    tier_client_key: str | None = None  # PEM private key of tier_client_cert
    tier_server_name: str | None = None  # name to verify in the tiers' certs instead of the address's host
    auth_token: str | None = field(default=None, repr=False)  # set = public API needs 'authorization: Bearer <it>'


class PipelineMismatch(RuntimeError):
    """The draft and target (or the coordinator's tokenizer) do not belong together."""


class Pipeline:
    """Connections to the tiers plus what was learnt from them at start-up."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        opts = [# Reconnect quickly to a tier that restarts (gRPC's default back-off grows to 120 s).
                ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 2000),
                ("grpc.max_receive_message_length", config.server.max_message_bytes),
                ("grpc.max_send_message_length", config.server.max_message_bytes)]
        credentials = self._tier_credentials(config)  # raises on unusable settings, before any channel exists
        if credentials is not None and config.tier_server_name:
            opts.append(("grpc.ssl_target_name_override", config.tier_server_name))

        def channel(address: str) -> grpc.aio.Channel:
            if credentials is None:
                return grpc.aio.insecure_channel(address, options=opts)
            return grpc.aio.secure_channel(address, credentials, options=opts)

        self._channels = [channel(config.target_address)]
        self.target = TargetClient(self._channels[0], config.target_address, config.rpc_timeout_s)
        self.draft = None
        if config.draft_address:
            self._channels.append(channel(config.draft_address))
            self.draft = DraftClient(self._channels[1], config.draft_address, config.rpc_timeout_s)
        self._cleanup: set[asyncio.Task] = set()  # in-flight session clean-ups
        self.suffix_cache = SuffixCache(config.suffix)  # recent outputs of all sessions, for suffix decoding
        self.tokenizer = None
        self.target_info: common_pb2.ModelInfo | None = None
        self.draft_info: common_pb2.ModelInfo | None = None

    @staticmethod
    def _tier_credentials(config: CoordinatorConfig) -> grpc.ChannelCredentials | None:
        """TLS (mutual TLS with a client cert) credentials for the tier channels, or None for plaintext."""
        if not config.tier_ca:
            extra = [n for n in ("tier_client_cert", "tier_client_key", "tier_server_name") if getattr(config, n)]
            if extra:
                raise ValueError(f"{' and '.join(extra)} {'needs' if len(extra) == 1 else 'need'} tier_ca (TLS to the tiers)")
            return None
        if bool(config.tier_client_cert) != bool(config.tier_client_key):
            raise ValueError("tier_client_cert and tier_client_key must be given together")
        ca = read_pem(config.tier_ca, "tier CA")
        cert = read_pem(config.tier_client_cert, "tier client certificate") if config.tier_client_cert else None
        key = read_pem(config.tier_client_key, "tier client key") if config.tier_client_key else None
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    async def connect(self) -> None:
        """Wait for the tiers, load the tokenizer, and refuse mismatched models."""
        loop = asyncio.get_running_loop()
        tokenizer_task = loop.run_in_executor(None, load_tokenizer, self.config.tokenizer)
        self.target_info = await self._wait_info(self.target, "target")
        if self.draft is not None:
            self.draft_info = await self._wait_info(self.draft, "draft")
        self.tokenizer = await tokenizer_task
        fingerprint = await loop.run_in_executor(None, tokenizer_fingerprint, self.tokenizer)
        if self.target_info.tokenizer_fingerprint != fingerprint:
            raise PipelineMismatch(f"the target's tokenizer ({self.target_info.model}) differs from the coordinator's ({self.config.tokenizer})")
        if self.draft_info is not None and self.draft_info.tokenizer_fingerprint != self.target_info.tokenizer_fingerprint:
            raise PipelineMismatch(f"draft tokenizer ({self.draft_info.model}) differs from target tokenizer ({self.target_info.model}); refusing to start")
        log.info("pipeline: target %s at %s, draft %s", self.target_info.model, self.config.target_address,
                 f"{self.draft_info.model} at {self.config.draft_address}" if self.draft_info else "none (target-only)")

    async def _wait_info(self, client, name: str) -> common_pb2.ModelInfo:
        deadline = asyncio.get_running_loop().time() + self.config.connect_timeout_s
        while True:
            try:
                return await client.model_info()
            except grpc.aio.AioRpcError as e:
                if asyncio.get_running_loop().time() > deadline:
                    raise ConnectionError(f"{name} service at {client.address} did not answer: {e.details()}") from None
                await asyncio.sleep(0.5)

    def run_cleanup(self, coro) -> None:
        """Run a session clean-up in the background; close() waits for it."""
        task = asyncio.ensure_future(coro)
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

    async def settle(self, timeout_s: float = 5.0) -> None:
        """Wait for pending session clean-ups (EndSession on the tiers, outputs into the shared tree)."""
        if self._cleanup:
            await asyncio.wait(list(self._cleanup), timeout=timeout_s)

    async def close(self, cleanup_timeout_s: float = 5.0) -> None:
        """Finish pending session clean-ups, then close the channels."""
        await self.settle(cleanup_timeout_s)
        for ch in self._channels:
            await ch.close()


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.config = pipeline.config
        self.admission = Admission(pipeline.config.admission)

    async def Generate(self, request, context):
        try:
            params = self._validate(request)
            async with self.admission.admit():
                async for event in self._generate(params, context):
                    yield event
        except RequestError as e:
            await context.abort(e.code, e.message)

    async def _generate(self, params: GenerationParams, context):
        pl = self.pipeline
        limits = Limits(max_context=pl.target_info.max_context,
                        draft_max_context=pl.draft_info.max_context if pl.draft_info else 0,
                        max_k=self._max_k(), overlap=self.config.overlap, adaptive=self.config.adaptive,
                        lookup=self.config.lookup, suffix=self.config.suffix, tier_retry_s=self.config.tier_retry_s)
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        generation = Generation(params, pl.draft, pl.target, pl.tokenizer, set(pl.target_info.eos_token_ids), limits, deadline,
                                suffix_cache=pl.suffix_cache)
        try:
            async for event in generation.run():
                yield event
        except TierError as e:
            code = e.code if e.code in _PASS_THROUGH else grpc.StatusCode.INTERNAL
            await context.abort(code, str(e))
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            err = as_request_error(e)
            await context.abort(err.code, err.message)
        finally:
            # Runs on completion, error and client cancellation alike; a separate task, so the
            # handler's cancellation cannot interrupt it.
            pl.run_cleanup(generation.close())

    @handle_errors
    async def GetInfo(self, request, context):
        pl, c = self.pipeline, self.config

        def summary(info, address):
            if info is None:
                return None
            return generate_pb2.ModelSummary(model=info.model, address=address, device=info.device, dtype=info.dtype)

        return generate_pb2.GetInfoResponse(
            draft=summary(pl.draft_info, c.draft_address), target=summary(pl.target_info, c.target_address),
            default_max_new_tokens=c.default_max_new_tokens,
            default_num_speculative_tokens=-1 if c.default_num_speculative_tokens is None else c.default_num_speculative_tokens,
            max_new_tokens_cap=c.max_new_tokens_cap, max_prompt_tokens=c.max_prompt_tokens,
            max_num_speculative_tokens=self._max_k(),
        )

    def _max_k(self) -> int:
        caps = [self.config.max_num_speculative_tokens]
        for info in (self.pipeline.draft_info, self.pipeline.target_info):
            if info is not None:
                caps.append(info.max_draft_tokens)
        return min(caps)

    # --- validation ---------------------------------------------------------------------------------

    def _validate(self, r: generate_pb2.GenerateRequest) -> GenerationParams:
        c = self.config
        prompt_ids = self._prompt_ids(r)
        context = self.pipeline.target_info.max_context
        if len(prompt_ids) > c.max_prompt_tokens:
            raise invalid_argument(f"prompt has {len(prompt_ids)} tokens, more than max_prompt_tokens={c.max_prompt_tokens}")
        if len(prompt_ids) >= context:
            raise invalid_argument(f"prompt has {len(prompt_ids)} tokens; the target's context is {context}, leaving no room to generate")
        max_new = r.max_new_tokens if r.HasField("max_new_tokens") else c.default_max_new_tokens
        if not 1 <= max_new <= c.max_new_tokens_cap:
            raise invalid_argument(f"max_new_tokens must be in [1, {c.max_new_tokens_cap}], got {max_new}")
        sampling = SamplingParams(
            temperature=r.temperature if r.HasField("temperature") else 0.0,
            top_k=r.top_k if r.HasField("top_k") else 0,
            top_p=r.top_p if r.HasField("top_p") else 1.0,
        )
        try:
            sampling.validate()
        except ValueError as e:
            raise invalid_argument(str(e)) from None
        if r.HasField("num_speculative_tokens"):
            k = r.num_speculative_tokens
            if not 0 <= k <= self._max_k():
                raise invalid_argument(f"num_speculative_tokens must be in [0, {self._max_k()}], got {k}")
        else:
            k = c.default_num_speculative_tokens
            k = None if k is None else min(k, self._max_k())
        if r.proposer == generate_pb2.PROPOSER_UNSPECIFIED:
            proposer = c.default_proposer
        elif r.proposer in PROPOSER_NAMES:
            proposer = PROPOSER_NAMES[r.proposer]
        else:
            raise invalid_argument(f"proposer: unknown value {r.proposer}")
        if len(r.stop) > MAX_STOP_STRINGS:
            raise invalid_argument(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(r.stop)}")
        for s in r.stop:
            if not s or len(s) > MAX_STOP_LEN:
                raise invalid_argument(f"stop: each string must have 1..{MAX_STOP_LEN} characters")
        seed = r.seed if r.HasField("seed") else secrets.randbits(63)
        return GenerationParams(prompt_ids=prompt_ids, max_new_tokens=max_new, sampling=sampling, seed=seed,
                                num_speculative_tokens=k, proposer=proposer, stop=tuple(r.stop), ignore_eos=r.ignore_eos)

    def _prompt_ids(self, r: generate_pb2.GenerateRequest) -> list[int]:
        tok = self.pipeline.tokenizer
        which = r.WhichOneof("prompt")
        if which is None:
            raise invalid_argument("prompt is required: set text, chat or token_ids")
        if which == "text":
            if not r.text:
                raise invalid_argument("prompt text is empty")
            ids = tok(r.text)["input_ids"]
        elif which == "chat":
            if not r.chat.messages:
                raise invalid_argument("prompt chat.messages is empty")
            for i, m in enumerate(r.chat.messages):
                if m.role not in CHAT_ROLES:
                    raise invalid_argument(f"chat.messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {m.role!r}")
            if not tok.chat_template:
                raise invalid_argument("the model's tokenizer has no chat template; send text or token_ids")
            messages = [{"role": m.role, "content": m.content} for m in r.chat.messages]
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if not isinstance(ids, list):  # BatchEncoding in newer transformers
                ids = ids["input_ids"]
        else:
            ids = list(r.token_ids.ids)
            if not ids:
                raise invalid_argument("prompt token_ids is empty")
            check_token_ids(ids, self.pipeline.target_info.vocab_size, "prompt token_ids")
        if not ids:
            raise invalid_argument("prompt tokenizes to no tokens")
        return list(ids)


async def build(config: CoordinatorConfig):
    """(server, port, health, pipeline): connects to the tiers first (raises PipelineMismatch; ConnectionError
    when a tier does not answer, TLS handshake failures included; ValueError / OSError for unusable TLS files)."""
    interceptors = [BearerTokenInterceptor(config.auth_token)] if config.auth_token else []
    pipeline = Pipeline(config)
    try:
        await pipeline.connect()
        server, port, health = create_server(
            [Service(GenerationServicer(pipeline), generate_pb2_grpc.add_GenerationServicer_to_server, SERVICE_NAME)],
            config.server, interceptors=interceptors,
        )
    except BaseException:
        await pipeline.close()
        raise
    return server, port, health, pipeline
