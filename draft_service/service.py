"""DraftService: Propose / ProposeStream / EndSession / GetModelInfo / GetStatus."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch

from specdec.proto import common_pb2, draft_pb2, draft_pb2_grpc
from specdec.math.params import SamplingParams
from specdec.math.sampling import make_generator, process_logits, sample, truncate_top_n
from specdec.math.seeds import DRAFT_STREAM, derive_seed
from specdec.wire.server import Service, ServerConfig, as_request_error, create_server, handle_errors
from specdec.engine.tier import ModelTier, TierConfig, TierRpcs

SERVICE_NAME = "specdec.v1.DraftService"


@dataclass(frozen=True)
class DraftConfig:
    tier: TierConfig
    server: ServerConfig = ServerConfig()
    draft_top_n: int = 64  # q is truncated to this many tokens per position (DESIGN.md, q on the wire)


class DraftServicer(TierRpcs, draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, tier: ModelTier, draft_top_n: int) -> None:
        if draft_top_n < 1:
            raise ValueError(f"draft_top_n must be >= 1, got {draft_top_n}")
        self.tier = tier
        self.draft_top_n = draft_top_n

    # --- rpcs ---------------------------------------------------------------------------------------

    @handle_errors
    async def Propose(self, request, context):
        return await self._propose(request)

    async def ProposeStream(self, request_iterator, context):
        sessions: set[str] = set()
        try:
            async for request in request_iterator:
                sessions.add(request.context.session_id)
                try:
                    response = await self._propose(request)
                except Exception as e:
                    err = as_request_error(e)
                    await context.abort(err.code, err.message)
                yield response
        finally:
            # The stream pins its sessions: when it ends (done, cancelled, coordinator gone) they go.
            if sessions:
                asyncio.ensure_future(self.tier.run(self._drop, sessions))

    # --- implementation -----------------------------------------------------------------------------

    async def _propose(self, request: draft_pb2.ProposeRequest) -> draft_pb2.ProposeResponse:
        tier = self.tier
        tier.check_num_tokens(request.num_tokens, "num_tokens", minimum=1)
        tier.check_context(request.context, extra_tokens=request.num_tokens - 1)
        params = tier.sampling_params(request.sampling)
        return await tier.run(self._propose_job, request, params)

    def _drop(self, session_ids: set[str]) -> None:
        for sid in session_ids:
            self.tier.store.remove(sid)

    @torch.inference_mode()
    def _propose_job(self, request: draft_pb2.ProposeRequest, params: SamplingParams) -> draft_pb2.ProposeResponse:
        """Feed the new committed tokens, then sample d_1..d_K from q autoregressively."""
        t0 = time.perf_counter()
        tier = self.tier
        session = tier.acquire(request.context)
        try:
            logits = tier.forward(session, list(request.context.new_tokens), logits_to_keep=1)  # [1, V]
            tokens: list[int] = []
            q_rows: list[common_pb2.DraftDistribution] = []
            k = request.num_tokens
            for i in range(k):
                if params.greedy:
                    d = int(logits[-1].argmax())
                else:
                    probs = process_logits(logits[-1:], params)[0]  # [V]
                    ids, q = truncate_top_n(probs, self.draft_top_n)  # the q we sample from and send
                    # Draws keyed by absolute position: independent of how requests split the work.
                    generator = make_generator(derive_seed(request.seed, len(session), DRAFT_STREAM), tier.device)
                    d = int(ids[sample(q, generator)])
                    q_rows.append(common_pb2.DraftDistribution(token_ids=ids.tolist(), probs=q.tolist()))
                tokens.append(d)
                if i + 1 < k:
                    logits = tier.forward(session, [d], logits_to_keep=1)
        except Exception:
            tier.store.remove(session.session_id)  # a half-fed cache is useless; the coordinator resends
            raise
        tier.store.release(session)
        return draft_pb2.ProposeResponse(
            tokens=tokens, q=q_rows, cached_len=len(session), compute_ms=(time.perf_counter() - t0) * 1e3
        )


def build(config: DraftConfig, tier: ModelTier | None = None):
    """(server, port, health, tier) for a draft service; loads the model unless `tier` is given."""
    tier = tier or ModelTier.load(config.tier)
    servicer = DraftServicer(tier, config.draft_top_n)
    server, port, health = create_server(
        [Service(servicer, draft_pb2_grpc.add_DraftServiceServicer_to_server, SERVICE_NAME)], config.server
    )
    return server, port, health, tier
