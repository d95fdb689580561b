"""The one code path of a generation, shared by the public APIs (the gRPC servicer and the OpenAI-compatible
HTTP routes): admit, validate (tokenise, compile the grammar: off the event loop), run the round loop,
observe metrics, log, and free the tiers' sessions.

Every failure comes out as a RequestError (a gRPC status and a message), which each API maps to its own
protocol: admission refusal (RESOURCE_EXHAUSTED) and bad input (INVALID_ARGUMENT) before the first event,
tier failures (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED) whenever they happen, anything else as
INTERNAL. The caller must run the stream to its end or aclose() it (a cancelled task does both): then the
sessions on both tiers are ended.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc
from prometheus_client import CollectorRegistry

from coordinator.api.admission import Admission
from coordinator.metrics import CoordinatorMetrics
from coordinator.pipeline import Pipeline
from coordinator.tiers.client import TierError
from coordinator.api.validation import RequestValidator
from specdec.proto import generate_pb2
from specdec.core.errors import RequestError, as_request_error

log = logging.getLogger(__name__)

# Tier failures the client sees with their own code; anything else is our bug -> INTERNAL. FAILED_PRECONDITION
# reaches the client only from a target replica that refuses a session it was sent whole (another tokenizer).
PASS_THROUGH = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.FAILED_PRECONDITION}


PREPARE_THREADS = 4  # requests tokenised / their grammars compiled at once (the rest wait their turn, admitted)


def finish_reason_name(value: int) -> str:
    return generate_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


class Frontend:
    def __init__(self, pipeline: Pipeline, registry: CollectorRegistry, model_name: str) -> None:
        """pipeline: a connected coordinator.pipeline.Pipeline. model_name: the served model's name (the
        OpenAI API's model id and the metrics' model_name label)."""
        self.pipeline = pipeline
        self.config = pipeline.config
        self.model_name = model_name
        self.admission = Admission(self.config.admission)
        self.validate = RequestValidator(pipeline)
        self._prepare = ThreadPoolExecutor(max_workers=PREPARE_THREADS, thread_name_prefix="prepare")
        self.metrics = CoordinatorMetrics(registry, model_name, self.validate.max_k(), self.admission,
                                          max_model_len=pipeline.target_info.max_context)
        for probe in (pipeline.target_reachability, pipeline.draft_reachability):
            if probe is not None:
                self.metrics.watch_reachability(probe.tier, lambda probe=probe: probe.reachable)
        self.accepting = True  # False once draining for shutdown (HTTP /health answers 503)

    @property
    def serving(self) -> bool:
        """Able to serve: not draining, and some target replica answers (a missing draft only degrades)."""
        return self.accepting and self.pipeline.target_reachability.reachable

    async def generate(self, request: generate_pb2.GenerateRequest, *, deadline: float | None = None,
                       api: str = "grpc", request_id: str = "") -> AsyncIterator[generate_pb2.GenerateResponse]:
        """One TokenChunk event per round, then the GenerationResult. deadline: time.monotonic() by which
        the client needs its answer (None: none). api and request_id only label the logs."""
        tracker = self.metrics.request()
        if not self.pipeline.target_reachability.reachable:  # fail fast: nothing can be generated without it
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"{self.pipeline.target_reachability.why()}; retry later")
        async with self.admission.admit():
            # Tokenising and compiling the grammar: after admission (what is refused costs nothing), on a
            # thread (the tokenizer and llguidance drop the GIL), so no stream on this loop waits for them.
            params = await asyncio.get_running_loop().run_in_executor(self._prepare, self.validate, request)
            tracker.admitted(len(params.prompt_ids), params.max_new_tokens)
            pl = self.pipeline
            generation = pl.generation(params, deadline)
            fields = {"session_id": generation.session_id, "request_id": request_id or uuid.uuid4().hex, "api": api}
            log.debug("generation started", extra={**fields, "prompt_tokens": len(params.prompt_ids),
                                                   "max_new_tokens": params.max_new_tokens, "proposer": params.proposer,
                                                   "k": -1 if params.num_speculative_tokens is None else params.num_speculative_tokens,
                                                   "temperature": params.sampling.temperature})
            finish, outcome = None, "cancelled"
            try:
                async for event in generation.run():
                    if event.HasField("chunk"):
                        tracker.on_chunk(len(event.chunk.token_ids), len(params.prompt_ids))
                        rounds = tracker.sync(generation.stats)
                        if log.isEnabledFor(logging.DEBUG):
                            for r in rounds:
                                log.debug("round", extra={**fields, "round": r.index, "proposer": r.proposer, "k": r.k,
                                                          "drafts": r.drafts, "accepted": r.accepted, "fallback": r.fallback})
                    elif event.HasField("result"):
                        finish = finish_reason_name(event.result.finish_reason)
                        outcome = "finished"
                        self._log_finished(fields, finish, event.result.stats)
                    yield event
            except TierError as e:
                outcome = "failed"
                err = RequestError(e.code if e.code in PASS_THROUGH else grpc.StatusCode.INTERNAL, str(e))
                log.warning("generation failed", extra={**fields, "code": err.code.name, "error": err.message})
                raise err from None
            except Exception as e:
                outcome = "failed"
                err = as_request_error(e)
                log.warning("generation failed", extra={**fields, "code": err.code.name, "error": err.message})
                raise err from None
            finally:
                tracker.sync(generation.stats)
                tracker.finish(finish)
                if outcome == "cancelled":
                    log.info("generation cancelled", extra={**fields, "rounds": generation.stats.rounds})
                # A separate task, so the caller's cancellation cannot interrupt it; Pipeline.close() waits for it.
                pl.run_cleanup(generation.close())

    @staticmethod
    def _log_finished(fields: dict, finish: str, s: generate_pb2.GenerationStats) -> None:
        log.info("generation finished", extra={
            **fields, "finish_reason": finish, "prompt_tokens": s.prompt_tokens, "generated_tokens": s.generated_tokens,
            "rounds": s.rounds, "proposer": s.proposer, "k": s.num_speculative_tokens,
            "mean_k": round(s.mean_num_speculative_tokens, 3), "acceptance_rate": round(s.acceptance_rate, 4),
            "elapsed_s": round(s.elapsed_s, 4), "tokens_per_s": round(s.tokens_per_s, 2)})

    def info(self) -> generate_pb2.GetInfoResponse:
        pl, c = self.pipeline, self.config

        def summary(info, address):
            if info is None:
                return None
            return generate_pb2.ModelSummary(model=info.model, address=address, device=info.device, dtype=info.dtype)

        return generate_pb2.GetInfoResponse(
            draft=summary(pl.draft_info, c.draft_address), target=summary(pl.target_info, c.target_address),
            default_max_new_tokens=c.default_max_new_tokens,
            default_num_speculative_tokens=-1 if c.default_num_speculative_tokens is None else c.default_num_speculative_tokens,
            max_new_tokens_cap=c.max_new_tokens_cap,
            max_prompt_tokens=min(c.max_prompt_tokens, pl.target_info.max_context - 1),  # what the validator accepts
            max_num_speculative_tokens=self.validate.max_k(), max_context=pl.target_info.max_context,
        )


def deadline_from(seconds_left: float | None) -> float | None:
    """A client's remaining time (None: no deadline) as a time.monotonic() deadline."""
    return None if seconds_left is None else time.monotonic() + seconds_left
