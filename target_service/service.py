"""TargetService: Verify / VerifyStream / EndSession / GetModelInfo / GetStatus, over a batching engine."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdec.engine.engine import Engine
from specdec.engine.config import TierConfig
from specdec.engine.verify import SparseQ, VerifyWork
from specdec.proto import target_pb2, target_pb2_grpc
from specdec.core.errors import check_token_ids, invalid_argument
from specdec.serving.server import Service, ServerConfig, handle_errors
from specdec.serving.tier import TierRpcs, TierServer, create_tier_server, serve_session_stream
from specdec.serving.tier_checks import check_context, check_num_tokens, sampling_params

SERVICE_NAME = "specdec.v1.TargetService"
Q_SUM_TOLERANCE = 1e-3  # a q row must sum to 1 within this


@dataclass(frozen=True)
class TargetConfig:
    tier: TierConfig
    server: ServerConfig = ServerConfig()


class TargetServicer(TierRpcs, target_pb2_grpc.TargetServiceServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @handle_errors
    async def Verify(self, request, context):
        return await self._verify(request)

    async def VerifyStream(self, request_iterator, context):
        async for response in serve_session_stream(self, request_iterator, context, self._verify):
            yield response

    async def _verify(self, request: target_pb2.VerifyRequest) -> target_pb2.VerifyResponse:
        engine = self.engine
        k = len(request.draft_tokens)
        check_num_tokens(engine, k, "draft_tokens (count)", minimum=0)
        check_context(engine, request.context, extra_tokens=k)
        check_token_ids(request.draft_tokens, engine.vocab_size, "draft_tokens")
        ctx = request.context
        work = VerifyWork.create(ctx.session_id, ctx.prefix_len, ctx.prefix_hash, list(ctx.new_tokens),
                                 list(request.draft_tokens), self._sparse_q(request, k),
                                 sampling_params(request.sampling), request.seed)
        r = await engine.submit(work)
        return target_pb2.VerifyResponse(num_accepted=r.num_accepted, next_token=r.next_token, cached_len=r.cached_len,
                                         compute_ms=r.compute_ms, batch_sessions=r.batch_sessions,
                                         batch_tokens=r.batch_tokens, step_ms=r.step_ms, queue_ms=r.queue_ms)

    def _sparse_q(self, request: target_pb2.VerifyRequest, k: int) -> SparseQ | None:
        """q as flat sparse tensors, or None for one-hot q; INVALID_ARGUMENT on anything malformed."""
        if not request.q:
            return None
        if len(request.q) != k:
            raise invalid_argument(f"q has {len(request.q)} rows but draft_tokens has {k}; send one row per draft token or none")
        rows, ids, probs = [], [], []
        for i, row in enumerate(request.q):
            if not row.token_ids or len(row.token_ids) != len(row.probs):
                raise invalid_argument(f"q[{i}]: token_ids and probs must be non-empty and of equal length")
            check_token_ids(row.token_ids, self.engine.vocab_size, f"q[{i}].token_ids")
            if len(set(row.token_ids)) != len(row.token_ids):
                raise invalid_argument(f"q[{i}].token_ids has duplicate ids")
            total = 0.0
            for prob in row.probs:
                if not (math.isfinite(prob) and prob >= 0):
                    raise invalid_argument(f"q[{i}].probs must be finite and >= 0, got {prob}")
                total += prob
            if abs(total - 1.0) > Q_SUM_TOLERANCE:
                raise invalid_argument(f"q[{i}].probs sum to {total:.6f}, not 1")
            rows.extend([i] * len(row.token_ids))
            ids.extend(row.token_ids)
            probs.extend(row.probs)
        return SparseQ(torch.tensor(rows, dtype=torch.long), torch.tensor(ids, dtype=torch.long),
                       torch.tensor(probs, dtype=torch.float32))


def build(config: TargetConfig, engine: Engine | None = None) -> TierServer:
    """The target service's server (not started); loads the model unless `engine` is given."""
    engine = engine or Engine.load(config.tier)
    service = Service(TargetServicer(engine), target_pb2_grpc.add_TargetServiceServicer_to_server, SERVICE_NAME)
    return create_tier_server(engine, service, config.server, "target")
