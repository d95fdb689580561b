"""The coordinator's configuration: each field is a flag of python -m coordinator too (specdec.core.settings)."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.api.admission import AdmissionConfig
from coordinator.constraint import GrammarLimits
from coordinator.proposers.draft_model import DraftModelConfig
from coordinator.proposers.lookup import LookupConfig
from coordinator.proposers.policy import PolicyConfig
from coordinator.proposers.suffix import SuffixConfig
from coordinator.tiers.reachability import ReachabilityConfig
from specdec.serving.routing import RoutingConfig
from specdec.core.proposer_names import HYBRID, NAMES, Proposer
from specdec.core.settings import setting
from specdec.serving.server import ServerConfig


def _k(text: str) -> int | None:
    """--default-k: a number, or auto (None: adaptive K)."""
    return None if text == "auto" else int(text)


@dataclass(frozen=True)
class CoordinatorConfig:
    """The coordinator."""

    #: The coordinator: its tiers
    # The target tier as a gRPC target: host:port, or a name resolving to every replica, e.g.
    # dns:///specdec-target.<ns>.svc.cluster.local:50062 (a headless Service; coordinator.tiers.routing)
    target_address: str = setting(flag="target")
    draft_address: str | None = setting(flag="draft")  # the draft tier, like --target ('' = target-only decoding)
    tokenizer: str = setting()  # model path or hub id whose tokenizer to use (the target's)
    server: ServerConfig = ServerConfig()

    #: The API: requests' defaults and limits
    default_max_new_tokens: int = 128  # max_new_tokens when a request leaves it unset
    max_new_tokens_cap: int = 4096  # largest max_new_tokens accepted
    max_prompt_tokens: int = 8192  # longest prompt accepted (tokens)
    # K when a request leaves it unset: a number, or auto for adaptive K
    default_num_speculative_tokens: int | None = setting(None, flag="default-k", parse=_k,
                                                         show=lambda k: "auto" if k is None else str(k))
    max_num_speculative_tokens: int = setting(16, flag="max-k")  # largest K accepted
    default_proposer: Proposer = setting(HYBRID, choices=NAMES)  # proposer when a request leaves it unset (a name or alias)
    adaptive: PolicyConfig = setting(PolicyConfig(), prefix="adaptive-")
    draft_model: DraftModelConfig = setting(DraftModelConfig(), prefix="draft-model-")
    lookup: LookupConfig = setting(LookupConfig(), prefix="lookup-")
    suffix: SuffixConfig = setting(SuffixConfig(), prefix="suffix-")

    #: Proposals: overlap and token trees
    overlap: bool = False  # the draft tier pre-drafts the next round while the target verifies (its speculation cache)
    speculate_outcomes: int = 4  # with --overlap: the likeliest outcomes of a round the draft pre-drafts the next round for
    # With --overlap: the draft tier pushes each pre-drafted next round unasked as soon as it is ready, and a
    # round whose outcome it pushed starts with no Propose round trip (DESIGN.md, The split's cost)
    draft_push: bool = False
    # A request with a fixed K for the draft model or head (chains, no grammar) has its rounds run by the draft tier
    # itself, which sends each proposal to the target and takes the verdict with no hop through the
    # coordinator (DESIGN.md, Direct rounds), where the draft replicas offer it (their --direct-target) and,
    # with --tier-ca, reach the target over TLS themselves (their --direct-target-ca)
    direct_rounds: bool = True
    tree_nodes: int = 0  # > 0: prompt lookup and suffix decoding propose token trees of this many nodes, K their depth (0 = chains)
    draft_tree_nodes: int = 0  # > 0: the draft model may propose token trees of up to this many nodes, shaped per round (0 = chains)
    draft_tree_branching: int = 4  # children per expanded node of the draft model's trees, and nodes expanded per level
    # How a sampled draft tree's siblings are drawn (the target's verifier follows)
    draft_tree_scheme: str = setting("without_replacement", choices=("without_replacement", "iid", "candidates"))

    #: The coordinator: its tiers
    tier_retry_s: float = setting(30.0, flag="tier-retry-timeout")  # seconds to keep retrying an unreachable target when the client set no deadline
    admission: AdmissionConfig = AdmissionConfig()
    grammar: GrammarLimits = setting(GrammarLimits(), cli=False)  # what compiling and following a response_format may cost
    rpc_timeout_s: float = 60.0  # deadline of each internal rpc, seconds
    connect_timeout_s: float = 300.0  # seconds to wait for the tiers at start-up

    #: The coordinator: its tiers' TLS (docs/security.md)
    tier_ca: str | None = None  # PEM CA that signed the tiers' certificates: connect to the tiers over TLS
    tier_client_cert: str | None = None  # PEM client certificate presented to the tiers (mutual TLS); needs --tier-ca
    tier_client_key: str | None = None  # PEM private key of --tier-client-cert
    tier_server_name: str | None = None  # name to verify in the tiers' certificates (default: the address's host)

    #: The API: its token, HTTP address and model name
    # Require 'authorization: Bearer <token>' on the public API (health and reflection stay open)
    auth_token: str | None = setting(None, secret=True, repr=False)
    auth_token_file: str | None = None  # read the bearer token from this file's first line (instead of --auth-token)
    # host:port of the OpenAI-compatible HTTP API ('' = none; port 0 = any free port); the same token as gRPC
    http_address: str = ""
    # Model id of the OpenAI API and the metrics' model_name label (default: the target model's directory or
    # .gguf name, or its hub id: specdec.models.served_model_name)
    served_model_name: str | None = None
    # With a token set, serve /metrics (the metrics port's and the HTTP API's) without it: for a Prometheus
    # that cannot send a token; what the metrics tell is in docs/security.md
    metrics_public: bool = False
    max_body_bytes: int = 4 * 2**20  # HTTP API: a larger request body gets 413, by its Content-Length before it is read
    reachability: ReachabilityConfig = setting(ReachabilityConfig(), prefix="reachability-")
    routing: RoutingConfig = setting(RoutingConfig(), prefix="routing-")
    # OTLP/gRPC collector (host:port or http(s)://host:port) the round trace goes to as OpenTelemetry spans
    # (coordinator.trace); '' = not exported (the trace's totals still reach GenerationStats)
    otlp_endpoint: str | None = None
