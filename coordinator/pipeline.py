"""The coordinator's connections to the tiers (one channel per tier, to all its replicas) and what it
learnt from them at start-up: their models, the tokenizer, the target's load."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable

import grpc

from coordinator.constraint import GrammarCompiler, NoConstraint
from coordinator.config import CoordinatorConfig
from coordinator.generation import Generation
from coordinator.min_tokens import MinTokens
from coordinator.output import Output
from coordinator.params import GenerationParams
from coordinator.proposers.coordinator_cost import CoordinatorCost
from coordinator.proposers.draft_model import DraftModelStrategy
from coordinator.proposers.draft_tree import DraftTreeConfig, DraftTrees
from coordinator.proposers.drafter import Drafter
from coordinator.proposers.estimates import SharedPriors
from coordinator.proposers.lookup import LookupStrategy
from specdec.core.proposer_names import DRAFT_MODEL, HYBRID, PROMPT_LOOKUP, SUFFIX
from coordinator.proposers.policy import Policy
from coordinator.proposers.suffix import SuffixCache, SuffixStrategy
from coordinator.proposers.tier_cost import TierCost
from coordinator.stats import RoundStats
from coordinator.trace import OtlpRounds, RoundTrace
from coordinator.tiers.client import TierClient
from coordinator.tiers.direct import DirectRounds
from coordinator.tiers.reachability import TierReachability
from coordinator.tiers.routing import probe_ring_hash
from coordinator.tiers.session import DRAFT_RETRY, TARGET_RETRY, TierSession, deadline_clock
from coordinator.tiers.target import FEATURE_PART_BYTES, TargetVerifier
from specdec.math.seeds import DRAFT_STREAM, derive_seed
from specdec.models import load_tokenizer, tokenizer_fingerprint
from specdec.proto import common_pb2, draft_pb2, target_pb2
from specdec.serving import sampling_params
from specdec.serving.features import SessionFeatures
from specdec.serving.server import client_credentials

log = logging.getLogger(__name__)

# The tiers' services, by full name: what the channels' health checks ask each replica about.
TARGET_SERVICE = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name
DRAFT_SERVICE = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name
TIER_TLS_SETTINGS = ("tier_ca", "tier_client_cert", "tier_client_key", "tier_server_name")


class PipelineMismatch(RuntimeError):
    """The draft and target (or the coordinator's tokenizer) do not belong together."""


class Pipeline:
    """Connections to the tiers (one channel per tier, to all its replicas: coordinator.tiers.routing) plus what
    was learnt from them at start-up."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        opts = [("grpc.max_receive_message_length", config.server.max_message_bytes),
                ("grpc.max_send_message_length", config.server.max_message_bytes)]
        credentials, tls_options = self.tier_credentials(config)  # raises on unusable settings, before any channel
        opts += tls_options

        def channel(address: str, service: str) -> grpc.aio.Channel:
            options = opts + config.routing.channel_options(health_service=service)
            if credentials is None:
                return grpc.aio.insecure_channel(address, options=options)
            return grpc.aio.secure_channel(address, credentials, options=options)

        self._channels = [channel(config.target_address, TARGET_SERVICE)]
        self.target = TierClient.target(self._channels[0], config.target_address, config.rpc_timeout_s, config.routing)
        self.draft = None
        if config.draft_address:
            self._channels.append(channel(config.draft_address, DRAFT_SERVICE))
            self.draft = TierClient.draft(self._channels[1], config.draft_address, config.rpc_timeout_s, config.routing)
        # Whether each tier has a replica that answers, probed in the background from connect() on; listeners
        # (the coordinator's health status) are called when a verdict flips.
        self.on_reachability: list[Callable[[], None]] = []
        self.target_reachability = TierReachability("target", self._channels[0], TARGET_SERVICE, config.reachability,
                                                    on_change=lambda reachable: self.announce_reachability())
        self.draft_reachability = None
        if self.draft is not None:
            self.draft_reachability = TierReachability("draft", self._channels[1], DRAFT_SERVICE, config.reachability,
                                                       on_change=lambda reachable: self.announce_reachability())
        self._cleanup: set[asyncio.Task] = set()  # in-flight session clean-ups
        # What each tier's steps cost at its load: the curve it measured at start (connect()), refined by the
        # steps its replies report (the target's Verify, the draft's Propose).
        self.target_load = TierCost()
        self.draft_load = TierCost(prior_intercept=config.draft_model.prior_step_ms, prior_slope=0.0)
        self.coordinator_cost = CoordinatorCost()  # this process's own CPU per tier call, sampled once connected
        self._sampler: asyncio.Task | None = None
        self.source_priors = SharedPriors()  # what ended sessions' strategies learnt, where new ones start
        self.suffix_cache = SuffixCache(config.suffix)  # recent outputs of all sessions, for suffix decoding
        # The round trace's OpenTelemetry export (coordinator.trace); None when no endpoint is set.
        self.round_spans = OtlpRounds(config.otlp_endpoint) if config.otlp_endpoint else None
        self.tokenizer = None
        self.grammar: GrammarCompiler | None = None  # structured output's compiler, once the tokenizer is known
        self.tokenizer_fingerprint = ""  # the coordinator's; every replica checks it on a session's first request
        self.target_info: common_pb2.ModelInfo | None = None
        self.draft_info: common_pb2.ModelInfo | None = None

    @staticmethod
    def tier_credentials(config: CoordinatorConfig) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, str]]]:
        """TLS (mutual TLS with a client cert) credentials for the tier channels and their options, or (None, [])."""
        return client_credentials(config.tier_ca, config.tier_client_cert, config.tier_client_key,
                                  config.tier_server_name, TIER_TLS_SETTINGS)

    async def connect(self) -> None:
        """Check that grpcio routes by session (RoutingUnsupported otherwise), wait for the tiers, load the
        tokenizer, and refuse mismatched models. Only one replica per tier answers here; each of the
        others checks the tokenizer when it first serves a session (SessionContext.tokenizer_fingerprint)."""
        await probe_ring_hash(self.config.routing)
        loop = asyncio.get_running_loop()
        tokenizer_task = loop.run_in_executor(None, load_tokenizer, self.config.tokenizer)
        self.target_info = await self._wait_info(self.target, "target")
        if self.draft is not None:
            self.draft_info = await self._wait_info(self.draft, "draft")
        for client, info, load in ((self.target, self.target_info, self.target_load),
                                   (self.draft, self.draft_info, self.draft_load)):
            if client is not None:
                load.seed(await client.status(), info.max_batch_sessions)
        self.tokenizer = await tokenizer_task
        fingerprint = await loop.run_in_executor(None, tokenizer_fingerprint, self.tokenizer)
        self.tokenizer_fingerprint = fingerprint
        if self.target_info.tokenizer_fingerprint != fingerprint:
            raise PipelineMismatch(f"the target's tokenizer ({self.target_info.model}) differs from the coordinator's ({self.config.tokenizer})")
        self.grammar = GrammarCompiler(self.tokenizer, self.target_info.vocab_size, list(self.target_info.eos_token_ids),
                                       self.config.grammar)
        if self.draft_info is not None and self.draft_info.tokenizer_fingerprint != self.target_info.tokenizer_fingerprint:
            raise PipelineMismatch(f"draft tokenizer ({self.draft_info.model}) differs from target tokenizer ({self.target_info.model}); refusing to start")
        log.info("pipeline: target %s at %s, draft %s", self.target_info.model, self.config.target_address,
                 f"{self.draft_info.model} at {self.config.draft_address}" + (
                     f" (an EAGLE-3 head reading the target's layers {list(self.draft_info.feature_layers)})"
                     if self.feature_draft else "") if self.draft_info else "none (target-only)")
        for probe in (self.target_reachability, self.draft_reachability):
            if probe is not None:
                probe.start()
        self._sampler = asyncio.ensure_future(self._sample_coordinator_cost())

    async def _sample_coordinator_cost(self, interval_s: float = 0.25) -> None:
        """The loop thread's CPU over the tier calls answered, a few times a second (CoordinatorCost); runs on
        the loop, so time.thread_time() is the loop thread's."""
        while True:
            self.coordinator_cost.sample(time.thread_time(), self.target_load.observations + self.draft_load.observations)
            await asyncio.sleep(interval_s)

    def announce_reachability(self) -> None:
        """Call the listeners (on a flip, and once more when the service starts serving)."""
        for listener in self.on_reachability:
            listener()

    async def _wait_info(self, client, name: str) -> common_pb2.ModelInfo:
        deadline = asyncio.get_running_loop().time() + self.config.connect_timeout_s
        while True:
            try:
                return await client.model_info()
            except grpc.aio.AioRpcError as e:
                if asyncio.get_running_loop().time() > deadline:
                    raise ConnectionError(f"{name} service at {client.address} did not answer: {e.details()}") from None
                await asyncio.sleep(0.5)

    @property
    def feature_draft(self) -> bool:
        """Whether the draft tier serves an EAGLE-3 head (it drafts from the target's features)."""
        return self.draft_info is not None and bool(self.draft_info.feature_layers)

    def max_k(self) -> int:
        """The largest K accepted: the server's cap and each tier's."""
        caps = [self.config.max_num_speculative_tokens]
        for info in (self.draft_info, self.target_info):
            if info is not None:
                caps.append(info.max_draft_tokens)
        return min(caps)

    def generation(self, params: GenerationParams, deadline: float | None = None) -> Generation:
        """A new session's round loop with its collaborators: the target and (for the draft_model and hybrid
        proposers) the draft tier, each through a TierSession; the proposers and policy; the output.
        deadline: time.monotonic() by which the client must have its answer (None: no deadline)."""
        c, fingerprint = self.config, self.tokenizer_fingerprint
        session_id = uuid.uuid4().hex
        key = c.routing.routing_key(session_id, params.prompt_ids, params.cache_key)  # the replicas holding its prefix
        stats = RoundStats(trace=RoundTrace(self.round_spans, session_id))
        time_left = deadline_clock(deadline)
        sampling = sampling_params.encode(params.sampling, len(params.prompt_ids))  # the same message to both tiers
        head = self.feature_draft and params.proposer in (DRAFT_MODEL, HYBRID)
        features = SessionFeatures(list(self.draft_info.feature_layers), self.draft_info.feature_width) if head else None
        target = TargetVerifier(
            TierSession(self.target.session(session_id, key), dataclasses.replace(TARGET_RETRY, retry_s=c.tier_retry_s), stats,
                        fingerprint, time_left, self.target_reachability),
            sampling, params.seed, stats, self.target_load, logprobs=params.logprobs, features=features,
            race_seed=params.race_seed)
        max_k, greedy = self.max_k(), params.sampling.temperature == 0
        tree_nodes = min(max_k, 0 if params.sampling.penalized  # chains only
                         else c.tree_nodes if params.tree_nodes is None else params.tree_nodes)
        lookup = LookupStrategy(c.lookup, params.prompt_ids, greedy=greedy, tree_nodes=tree_nodes,
                                priors=self.source_priors)
        strategies = []  # the session's: model-free ones first
        if params.proposer in (SUFFIX, HYBRID):
            strategies.append(SuffixStrategy(c.suffix, self.suffix_cache, params.prompt_ids, greedy=greedy,
                                             tree_nodes=tree_nodes, priors=self.source_priors))
        if params.proposer in (PROMPT_LOOKUP, HYBRID):
            strategies.append(lookup)
        draft, direct = None, None
        if self.draft is not None and params.proposer in (DRAFT_MODEL, HYBRID):
            draft = TierSession(self.draft.session(session_id, key), DRAFT_RETRY, stats, fingerprint, time_left,
                                self.draft_reachability)
            strategies.append(DraftModelStrategy(
                c.draft_model, draft, sampling, self._draft_seed(params), stats, cost=self.draft_load,
                max_context=self.draft_info.max_context, trees=self._draft_trees(params, speculate=not head),
                grammar=params.grammar.text if params.grammar is not None and not head else "", greedy=greedy,
                priors=self.source_priors, push=c.overlap and c.draft_push and not head, features=features))
        eos = set() if params.ignore_eos else set(self.target_info.eos_token_ids)
        ends = eos | params.stop_token_ids  # the tokens that end the output
        if draft is not None and self._direct(params, features):
            direct = DirectRounds(self.draft, (target.session, draft), key, min(params.num_speculative_tokens, max_k),
                                  sampling, params.seed, ends, params.logprobs, fingerprint, stats, time_left,
                                  speculate=c.overlap and not head,  # (a head has no speculation cache)
                                  draft_seed=self._draft_seed(params), race_seed=params.race_seed)
        policy = Policy(dataclasses.replace(c.adaptive, max_k=min(c.adaptive.max_k, max_k)))
        drafter = Drafter(params, policy, strategies, lookup, self.target_load, max_k=max_k,
                          suffix_cache=self.suffix_cache, cache_context=c.suffix.cache_context,
                          coordinator=self.coordinator_cost)
        output = Output(self.tokenizer, params.prompt_ids, params.max_new_tokens, eos, params.stop, params.stop_token_ids,
                        params.include_stop, params.min_tokens)
        constraint = (params.grammar.session(jump_forward=params.logprobs < 0) if params.grammar is not None
                      else MinTokens(params.min_tokens, ends, self.target_info.vocab_size)
                      if params.min_tokens else NoConstraint())
        return Generation(params, target=target, drafter=drafter, output=output, stats=stats,
                          max_context=self.target_info.max_context, session_id=session_id, constraint=constraint,
                          direct=direct)

    @staticmethod
    def _draft_seed(params: GenerationParams) -> int:
        """The draft's draws' key: a seeded request's race key (so that its drafts race the target's draws), else a
        stream of its own (independent of the target's, as rejection sampling needs)."""
        return params.race_seed or derive_seed(params.seed, 0, DRAFT_STREAM)

    def _direct(self, params: GenerationParams, features: SessionFeatures | None) -> bool:
        """Whether the draft tier runs the session's rounds (direct_rounds): the draft model (or an EAGLE-3 head, its
        rows going from the target to the draft replica) alone at the request's own K, proposing chains, with no
        grammar or min_tokens (masks); with a head, a prompt whose rows fit one request (a longer one goes in parts: the
        loop's own rounds)."""
        nodes = self.config.draft_tree_nodes if params.tree_nodes is None else params.tree_nodes
        fits = features is None or len(params.prompt_ids) * features.row_bytes <= FEATURE_PART_BYTES
        return (self.direct_rounds and params.proposer == DRAFT_MODEL and params.grammar is None and not params.min_tokens
                and bool(params.num_speculative_tokens) and not nodes and fits)

    @property
    def direct_rounds(self) -> bool:
        """Whether sessions may have the draft tier run their rounds: asked for (--direct-rounds), offered by the
        draft replica that answered at start (ModelInfo.direct_rounds), and, where this coordinator reaches the tiers
        over TLS, with the draft's own channel to the target on TLS too (ModelInfo.direct_tls)."""
        c, info = self.config, self.draft_info
        return c.direct_rounds and info is not None and info.direct_rounds and (not c.tier_ca or info.direct_tls)

    def _draft_trees(self, params: GenerationParams, speculate: bool = True) -> DraftTrees | None:
        """The draft model's trees and speculation cache for a session (None: chains only; penalised
        requests, whose counts would differ per branch; structured output, whose grammar the draft tier applies
        to chains only; a session with neither on). The request's node budget, where it set one, overrides
        the server's. speculate=False: no speculation cache (an EAGLE-3 head's tier has none)."""
        c = self.config
        speculate = c.speculate_outcomes if c.overlap and speculate else 0
        nodes = min(c.draft_tree_nodes if params.tree_nodes is None else params.tree_nodes, self.max_k())
        if params.sampling.penalized or params.response_format or not (nodes or speculate):
            return None
        config = DraftTreeConfig(nodes, max(1, min(c.draft_tree_branching, nodes)), c.draft_tree_scheme, speculate)
        return DraftTrees(config, c.draft_model.decay, greedy=params.sampling.temperature == 0,
                          priors=self.source_priors)

    def run_cleanup(self, coro) -> None:
        """Run a session clean-up in the background; close() waits for it."""
        task = asyncio.ensure_future(coro)
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

    async def settle(self, timeout_s: float = 5.0) -> None:
        """Wait for pending session clean-ups (their streams closed, outputs into the shared tree)."""
        if self._cleanup:
            await asyncio.wait(list(self._cleanup), timeout=timeout_s)

    async def close(self, cleanup_timeout_s: float = 5.0) -> None:
        """Stop the probes, finish pending session clean-ups, then close the channels."""
        if self._sampler is not None:
            self._sampler.cancel()
        for probe in (self.target_reachability, self.draft_reachability):
            if probe is not None:
                await probe.close()
        await self.settle(cleanup_timeout_s)
        if self.grammar is not None:
            self.grammar.close()
        for ch in self._channels:
            await ch.close()
        if self.round_spans is not None:
            self.round_spans.shutdown()  # flushes the spans not yet sent
