"""TargetService: Verify / EndSession / GetModelInfo / GetStatus."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from specdec.proto import common_pb2, target_pb2, target_pb2_grpc
from specdec.math.params import SamplingParams
from specdec.math.rejection import dense_q, rejection_sample, verify_greedy
from specdec.math.sampling import make_generator, process_logits
from specdec.wire.server import Service, ServerConfig, create_server, handle_errors, invalid_argument
from specdec.engine.tier import ModelTier, TierConfig, TierRpcs

SERVICE_NAME = "specdec.v1.TargetService"
Q_SUM_TOLERANCE = 1e-3  # a q row must sum to 1 within this


@dataclass(frozen=True)
class TargetConfig:
    tier: TierConfig
    server: ServerConfig = ServerConfig()


class TargetServicer(TierRpcs, target_pb2_grpc.TargetServiceServicer):
    def __init__(self, tier: ModelTier) -> None:
        self.tier = tier

    @handle_errors
    async def Verify(self, request, context):
        tier = self.tier
        k = len(request.draft_tokens)
        tier.check_num_tokens(k, "draft_tokens (count)", minimum=0)
        tier.check_context(request.context, extra_tokens=k)
        tier.check_token_ids(request.draft_tokens, "draft_tokens")
        params = tier.sampling_params(request.sampling)
        q_rows = self._check_q(request, k)
        return await tier.run(self._verify_job, request, params, q_rows)

    def _check_q(self, request: target_pb2.VerifyRequest, k: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Sparse q rows as tensors, or None for one-hot q; INVALID_ARGUMENT on anything malformed."""
        if not request.q:
            return None
        if len(request.q) != k:
            raise invalid_argument(f"q has {len(request.q)} rows but draft_tokens has {k}; send one row per draft token or none")
        rows = []
        for i, row in enumerate(request.q):
            if not row.token_ids or len(row.token_ids) != len(row.probs):
                raise invalid_argument(f"q[{i}]: token_ids and probs must be non-empty and of equal length")
            self.tier.check_token_ids(row.token_ids, f"q[{i}].token_ids")
            if len(set(row.token_ids)) != len(row.token_ids):
                raise invalid_argument(f"q[{i}].token_ids has duplicate ids")
            total = 0.0
            for prob in row.probs:
                if not (math.isfinite(prob) and prob >= 0):
                    raise invalid_argument(f"q[{i}].probs must be finite and >= 0, got {prob}")
                total += prob
            if abs(total - 1.0) > Q_SUM_TOLERANCE:
                raise invalid_argument(f"q[{i}].probs sum to {total:.6f}, not 1")
            rows.append((torch.tensor(row.token_ids, dtype=torch.long), torch.tensor(row.probs, dtype=torch.float32)))
        return rows

    @torch.inference_mode()
    def _verify_job(self, request: target_pb2.VerifyRequest, params: SamplingParams, q_rows) -> target_pb2.VerifyResponse:
        """ONE forward over [uncached committed tokens + d_1..d_K], rejection sampling, rollback."""
        t0 = time.perf_counter()
        tier = self.tier
        ctx = request.context
        session = tier.acquire(ctx)
        try:
            drafts = list(request.draft_tokens)
            k = len(drafts)
            logits = tier.forward(session, list(ctx.new_tokens) + drafts, logits_to_keep=k + 1)  # [K+1, V]
            d = torch.tensor(drafts, dtype=torch.long, device=tier.device)  # [K]
            if params.greedy and q_rows is None:
                n_accepted, next_token = verify_greedy(logits, d)
            else:
                p = process_logits(logits, params)  # [K+1, V]
                q = dense_q(q_rows, d, tier.vocab_size, tier.device)  # [K, V]
                generator = make_generator(request.seed, tier.device)
                n_accepted, next_token = rejection_sample(p, q, d, generator)
            # Keep the KV entries of the committed prefix plus the accepted drafts only.
            tier.store.crop(session, ctx.prefix_len + len(ctx.new_tokens) + n_accepted)
        except Exception:
            tier.store.remove(session.session_id)
            raise
        tier.store.release(session)
        return target_pb2.VerifyResponse(
            num_accepted=n_accepted, next_token=next_token, cached_len=len(session),
            compute_ms=(time.perf_counter() - t0) * 1e3,
        )


def build(config: TargetConfig, tier: ModelTier | None = None):
    """(server, port, health, tier) for a target service; loads the model unless `tier` is given."""
    tier = tier or ModelTier.load(config.tier)
    server, port, health = create_server(
        [Service(TargetServicer(tier), target_pb2_grpc.add_TargetServiceServicer_to_server, SERVICE_NAME)], config.server
    )
    return server, port, health, tier
