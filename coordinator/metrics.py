"""The coordinator's Prometheus metrics: vLLM's request and speculative-decoding metrics (same names,
meanings and buckets as vllm/v1/metrics/loggers.py and vllm/v1/spec_decode/metrics.py) plus specdec's
round breakdown. See docs/metrics.md. Labels: model_name (and tier, part, proposer, code where they
apply); never a session.

vLLM's meanings, kept here:
- vllm:spec_decode_num_drafts counts rounds that verified at least one draft token (a round whose
  proposer offered nothing is not a draft); mean acceptance length = 1 + accepted / drafts, the bonus
  (or correction) token included.
- vllm:spec_decode_num_accepted_tokens_per_pos{position="i"} counts drafts whose token at 0-based
  position i was accepted; accepted tokens are always a prefix of the drafts.
- vllm:inter_token_latency_seconds has one observation per streamed output after the first, i.e. per
  round: with speculation one output carries several tokens, as in vLLM.
- A request's phases, as vLLM's (one observation per request that started, aborted ones included):
  queue = arrival -> admitted (the admission queue: --max-rps / --max-concurrency), prefill = admitted ->
  first output, decode = first output -> end, inference = admitted -> end (prefill + decode).
  vllm:request_prompt_tokens / _generation_tokens / _params_max_tokens are per-request histograms on
  vLLM's 1-2-5 buckets up to the target's context.
"""

from __future__ import annotations

import time
from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from coordinator.api.admission import Admission
from coordinator.stats import RoundRecord, RoundStats
from specdec.core.proposer_names import DRAFT_MODEL, PROMPT_LOOKUP, SUFFIX
from specdec.serving.metrics import MODEL_LABEL, RpcMetrics

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
REQUEST_LATENCY_BUCKETS = E2E_BUCKETS  # vLLM's request_latency_buckets: queue, prefill, decode, inference time


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


# specdec's.
ROUND_PART_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
K_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)
ROUND_PARTS = ("draft", "verify", "tier", "network", "coordinator")
# Our finish reasons -> vLLM's finished_reason label values (vllm.v1.engine.FinishReason).
VLLM_FINISHED_REASON = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


class CoordinatorMetrics:
    """All the coordinator's series, in `registry`. request() gives the tracker of one generation."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_k: int, admission: Admission,
                 max_model_len: int) -> None:
        """max_model_len: the target's context, the top of the token-count histograms' buckets."""
        self.registry = registry
        ProcessCollector(registry=registry)  # process_resident_memory_bytes, process_cpu_seconds_total, ...
        m = [MODEL_LABEL]
        v = [model_name]
        self.rpc = RpcMetrics(registry, {MODEL_LABEL: model_name})

        def gauge(name, doc, fn):
            g = Gauge(name, doc, m, registry=registry)
            g.labels(*v).set_function(fn)

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.", lambda: admission.running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lambda: admission.waiting)

        def counter(name, doc, extra=()):
            c = Counter(name, doc, [*m, *extra], registry=registry)
            return c if extra else c.labels(*v)

        def histogram(name, doc, buckets, extra=()):
            h = Histogram(name, doc, [*m, *extra], registry=registry, buckets=buckets)
            return h if extra else h.labels(*v)

        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.", ("position",))
        self.accepted_per_pos = [per_pos.labels(*v, str(i)) for i in range(max(max_k, 1))]  # as vLLM: 0..K-1, zeros shown
        self._per_pos = per_pos
        self._labels = v
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter("vllm:request_success", "Count of successfully processed requests.", ("finished_reason",))
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", E2E_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                                    REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                                     REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                                   token_buckets)
        self.request_max_tokens = histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                            token_buckets)

        parts = histogram("specdec_round_seconds", "Time of one round by part: draft compute, target (verify) compute, "
                          "tier (the tiers' time outside their forwards: waiting for a step, verification and sampling "
                          "math), network (rpc round trips minus the tiers' time) and coordinator (the rest of the round).",
                          ROUND_PART_BUCKETS, ("part",))
        self.round_parts = {p: parts.labels(*v, p) for p in ROUND_PARTS}
        self._by_proposer: dict[str, tuple] = {}  # proposer -> (rounds, k, drafts, accepted) children, looked up once
        self.rounds = counter("specdec_rounds", "Rounds (one target verify each; a target-only round that runs on spans a forward per token), by the proposer of their drafts.", ("proposer",))
        self.k = histogram("specdec_num_speculative_tokens", "K asked of the proposer per round (after clamping to the "
                           "token budget; 0 = target-only round).", K_BUCKETS, ("proposer",))
        self.proposer_drafts = counter("specdec_proposer_draft_tokens", "Draft tokens the target verified, by the "
                                       "proposer that drafted them.", ("proposer",))
        self.proposer_accepted = counter("specdec_proposer_accepted_tokens", "Draft tokens the target accepted, by the "
                                         "proposer that drafted them (over specdec_proposer_draft_tokens: its "
                                         "acceptance rate).", ("proposer",))
        for name in (DRAFT_MODEL, PROMPT_LOOKUP, SUFFIX):  # exported from 0, so a rate sees their first drafts
            self._proposer(name)
        self.reprefills = counter("specdec_reprefills", "Committed sequences resent in full because a tier had lost the "
                                  "session (evicted, restarted).", ("tier",))
        self.fallbacks = counter("specdec_lookup_fallbacks", "Rounds proposed by prompt lookup because the draft model "
                                 "was unreachable.")
        self.overlapped = counter("specdec_overlapped_rounds", "Rounds whose drafts the draft tier's speculation cache had "
                                  "ready: pre-drafted during the previous round's verification (--overlap).")
        self._reachable = Gauge("specdec_tier_reachable", "1 while some replica of the tier answers the coordinator's "
                                "health probe, else 0 (no target: the coordinator is NOT_SERVING; no draft: prompt "
                                "lookup drafts).", [*m, "tier"], registry=registry)
        self.tier_errors = counter("specdec_tier_errors", "Failed internal rpcs to the tiers, by tier, rpc and status "
                                   "(the generation may have recovered).", ("tier", "rpc", "code"))

    def _proposer(self, name: str) -> tuple:
        """The proposer's (rounds, k, drafts, accepted) children, made at the first look."""
        found = self._by_proposer.get(name)
        if found is None:
            found = self._by_proposer[name] = tuple(m.labels(*self._labels, name) for m in (
                self.rounds, self.k, self.proposer_drafts, self.proposer_accepted))
        return found

    def watch_reachability(self, tier: str, reachable) -> None:
        """specdec_tier_reachable{tier} reads reachable() (a bool) at every scrape."""
        self._reachable.labels(*self._labels, tier).set_function(lambda: float(reachable()))

    def request(self) -> "RequestMetrics":
        return RequestMetrics(self)

    def observe_round(self, r: RoundRecord) -> None:
        v = self._labels
        if r.drafts > 0:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(r.drafts)
            self.num_accepted_tokens.inc(r.accepted)
            for i in range(r.accepted):
                child = self.accepted_per_pos[i] if i < len(self.accepted_per_pos) else self._per_pos.labels(*v, str(i))
                child.inc()
        for part, ms in zip(ROUND_PARTS, (r.draft_ms, r.verify_ms, r.tier_ms, r.network_ms, r.coordinator_ms)):
            self.round_parts[part].observe(ms / 1e3)
        rounds, k, drafts, accepted = self._proposer(r.proposer)
        rounds.inc()
        k.observe(r.k)
        if r.drafts > 0:
            drafts.inc(r.drafts)
            accepted.inc(r.accepted)
        if r.fallback:
            self.fallbacks.inc()
        if r.overlapped:
            self.overlapped.inc()


class RequestMetrics:
    """One generation's share of the metrics, observed as it streams (so counters move during long
    generations, as vLLM's do per step). Arrival is when the request reached the coordinator."""

    def __init__(self, metrics: CoordinatorMetrics) -> None:
        self.m = metrics
        self.arrival = time.perf_counter()
        self._admitted: float | None = None  # when it left the admission queue and started running
        self._first_output: float | None = None
        self._last_output: float | None = None
        self._prompt_tokens = 0
        self._generated_tokens = 0
        self._rounds_seen = 0
        self._reprefills: Tally = Tally()
        self._tier_errors: Tally = Tally()

    def on_chunk(self, num_tokens: int, prompt_tokens: int) -> None:
        """A streamed chunk with num_tokens new token ids (text-only chunks carry none and count nothing)."""
        if num_tokens <= 0:
            return
        now = time.perf_counter()
        if self._last_output is None:
            self.m.ttft.observe(now - self.arrival)
            self.m.prompt_tokens.inc(prompt_tokens)  # the prefill is done once the first round is
            self._first_output = now
        else:
            self.m.itl.observe(now - self._last_output)
        self._last_output = now
        self._generated_tokens += num_tokens
        self.m.generation_tokens.inc(num_tokens)

    def admitted(self, prompt_tokens: int, max_tokens: int) -> None:
        """The request passed validation and admission and starts running; max_tokens: its token budget."""
        self._admitted = time.perf_counter()
        self._prompt_tokens = prompt_tokens
        self.m.queue_time.observe(self._admitted - self.arrival)
        self.m.request_max_tokens.observe(max_tokens)

    def sync(self, stats: RoundStats) -> list[RoundRecord]:
        """Observe what the generation recorded since the last call; returns its new rounds."""
        new = stats.records[self._rounds_seen:]
        self._rounds_seen = len(stats.records)
        for r in new:
            self.m.observe_round(r)
        v = self.m._labels
        if stats.reprefills != self._reprefills:  # rare: compare before building differences every round
            for tier, n in (stats.reprefills - self._reprefills).items():
                self.m.reprefills.labels(*v, tier).inc(n)
            self._reprefills = Tally(stats.reprefills)
        if stats.tier_errors != self._tier_errors:
            for (tier, rpc, code), n in (stats.tier_errors - self._tier_errors).items():
                self.m.tier_errors.labels(*v, tier, rpc, code).inc(n)
            self._tier_errors = Tally(stats.tier_errors)
        return new

    def finish(self, finish_reason: str | None) -> None:
        """finish_reason: ours ("eos", "stop", "length", "context"), or None for a failed or cancelled
        generation (vLLM's "abort")."""
        end = time.perf_counter()
        self.m.e2e.observe(end - self.arrival)
        self.m.request_success.labels(*self.m._labels, VLLM_FINISHED_REASON.get(finish_reason, "abort")).inc()
        if self._admitted is None:  # refused before it ran (bad input, admission): no phases to tell
            return
        first = self._first_output if self._first_output is not None else end
        self.m.prefill_time.observe(first - self._admitted)
        self.m.decode_time.observe(end - first)
        self.m.inference_time.observe(end - self._admitted)
        self.m.request_prompt_tokens.observe(self._prompt_tokens)
        self.m.request_generation_tokens.observe(self._generated_tokens)
