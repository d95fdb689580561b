"""What the draft and target tiers share: a model, its session KV store and one worker thread.

Every request's model work (crop the session to the committed prefix, feed tokens, sample) runs as
one job on the tier's single worker thread, so the event loop stays free for health checks and
cancellations, and jobs on the same session can never interleave.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from specdec.models import ModelConfig, eos_token_ids, load_model, load_tokenizer, max_context, tokenizer_fingerprint
from specdec.proto import common_pb2
from specdec.math.params import SamplingParams
from specdec.wire.server import RequestError, check_token_ids, handle_errors, invalid_argument
from specdec.engine.sessions import PrefixMismatch, Session, SessionStore, SessionStoreConfig

log = logging.getLogger(__name__)

MAX_SESSION_ID_LEN = 128


@dataclass(frozen=True)
class TierConfig:
    model: ModelConfig
    sessions: SessionStoreConfig = field(default_factory=SessionStoreConfig)
    max_draft_tokens: int = 16  # cap on K per request
    torch_threads: int = 0  # intra-op threads for this process; 0 leaves torch's default


def crop_cache(cache, length: int) -> None:
    """Crop a transformers cache to its first `length` positions (rollback of speculative entries)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


class FewRowsLmHead(torch.nn.Module):
    """The LM head for verify-sized inputs on CPU. With a large vocabulary, x @ W.T for 2..16 rows
    costs about twice one row (the BLAS packs all of W for a small-M GEMM: 24 ms for 2 rows of
    SmolLM2's 49152 x 576 head on one core), while W @ x.T costs 6 ms. Same product, same weights
    (tied embeddings stay tied); single-row decoding keeps the standard path."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    @property
    def weight(self) -> torch.nn.Parameter:
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, M, H] -> [B, M, V]
        if x.shape[0] == 1 and 1 < x.shape[1] <= 16 and self.linear.bias is None:
            return (self.linear.weight @ x[0].T).T.unsqueeze(0)
        return self.linear(x)


class ModelTier:
    """A loaded model served by one worker thread, with a session-keyed KV store."""

    def __init__(self, config: TierConfig, model, tokenizer) -> None:
        from transformers import DynamicCache

        self.config = config
        self.model = model
        self.device = next(model.parameters()).device
        head = getattr(model, "lm_head", None)
        if self.device.type == "cpu" and isinstance(head, torch.nn.Linear):
            model.lm_head = FewRowsLmHead(head)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_context = max_context(model)
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.tokenizer_fingerprint = tokenizer_fingerprint(tokenizer)
        self.new_cache = lambda: DynamicCache(config=model.config)
        self.store = SessionStore(config.sessions, new_cache=self.new_cache, crop_cache=crop_cache)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    @classmethod
    def load(cls, config: TierConfig) -> "ModelTier":
        if config.torch_threads > 0:
            torch.set_num_threads(config.torch_threads)
        t0 = time.perf_counter()
        model = load_model(config.model)
        tokenizer = load_tokenizer(config.model.path)
        tier = cls(config, model, tokenizer)
        tier.warm_up()
        log.info("loaded %s in %.1fs on %s/%s", config.model.path, time.perf_counter() - t0, config.model.device, config.model.dtype)
        return tier

    @torch.inference_mode()
    def warm_up(self) -> None:
        """One prefill and a few decode-sized forwards, so the first request does not pay for lazy
        initialisation (kernels, allocator, thread pools)."""
        cache = self.new_cache()
        ids = torch.zeros(1, 16, dtype=torch.long, device=self.device)
        self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        for n in (1, 5):
            self.model(input_ids=ids[:, :n], past_key_values=cache, use_cache=True, logits_to_keep=n)

    async def run(self, fn, *args) -> Any:
        """Run a blocking model job on the worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --- request checks (event loop) ---------------------------------------------------------------

    def check_context(self, ctx: common_pb2.SessionContext, extra_tokens: int) -> None:
        """Validate a SessionContext; extra_tokens = tokens the request adds beyond new_tokens."""
        if not ctx.session_id:
            raise invalid_argument("context.session_id is required")
        if len(ctx.session_id) > MAX_SESSION_ID_LEN:
            raise invalid_argument(f"context.session_id is longer than {MAX_SESSION_ID_LEN} characters")
        if ctx.prefix_len < 0:
            raise invalid_argument(f"context.prefix_len must be >= 0, got {ctx.prefix_len}")
        if not ctx.new_tokens:
            raise invalid_argument("context.new_tokens must hold at least one token")
        self.check_token_ids(ctx.new_tokens, "context.new_tokens")
        total = ctx.prefix_len + len(ctx.new_tokens) + extra_tokens
        if total > self.max_context:
            raise invalid_argument(f"context: {total} tokens exceed the model's context of {self.max_context}")

    def check_token_ids(self, ids, field_name: str) -> None:
        check_token_ids(ids, self.vocab_size, field_name)

    def check_num_tokens(self, k: int, field_name: str, minimum: int) -> None:
        if not minimum <= k <= self.config.max_draft_tokens:
            raise invalid_argument(f"{field_name} must be in [{minimum}, {self.config.max_draft_tokens}], got {k}")

    @staticmethod
    def sampling_params(msg: common_pb2.SamplingParams) -> SamplingParams:
        params = SamplingParams(
            temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p if msg.top_p != 0 else 1.0
        )
        try:
            params.validate()
        except ValueError as e:
            raise invalid_argument(f"sampling.{e}") from None
        return params

    # --- model work (worker thread) ----------------------------------------------------------------

    def acquire(self, ctx: common_pb2.SessionContext) -> Session:
        try:
            return self.store.acquire(ctx.session_id, ctx.prefix_len, ctx.prefix_hash)
        except PrefixMismatch as e:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None

    def forward(self, session: Session, tokens: list[int], logits_to_keep: int) -> torch.Tensor:
        """Feed tokens after the session's cached ones; returns logits [logits_to_keep, V] float32."""
        input_ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        out = self.model(input_ids=input_ids, past_key_values=session.cache, use_cache=True, logits_to_keep=logits_to_keep)
        session.append(tokens)
        logits = out.logits[0].float()
        if not torch.isfinite(logits).all():
            self.store.remove(session.session_id)
            raise RequestError(grpc.StatusCode.INTERNAL, "model produced non-finite logits; session dropped")
        return logits

    # --- shared rpcs ------------------------------------------------------------------------------

    async def end_session(self, request: common_pb2.EndSessionRequest) -> common_pb2.EndSessionResponse:
        existed = await self.run(self.store.remove, request.session_id)
        return common_pb2.EndSessionResponse(existed=existed)

    def model_info(self) -> common_pb2.ModelInfo:
        return common_pb2.ModelInfo(
            model=self.config.model.path,
            vocab_size=self.vocab_size,
            tokenizer_fingerprint=self.tokenizer_fingerprint,
            eos_token_ids=self.eos_token_ids,
            max_context=self.max_context,
            device=str(self.device),
            dtype=self.config.model.dtype,
            max_draft_tokens=self.config.max_draft_tokens,
        )

    async def status(self) -> common_pb2.StatusResponse:
        def snapshot():
            self.store.evict_idle()
            return common_pb2.StatusResponse(
                num_sessions=len(self.store), cached_tokens=self.store.cached_tokens, evictions=self.store.evictions
            )

        return await self.run(snapshot)


class TierRpcs:
    """The rpcs every tier serves the same way; servicers mix this in and set self.tier."""

    tier: ModelTier

    @handle_errors
    async def EndSession(self, request, context):
        return await self.tier.end_session(request)

    @handle_errors
    async def GetModelInfo(self, request, context):
        return self.tier.model_info()

    @handle_errors
    async def GetStatus(self, request, context):
        return await self.tier.status()
