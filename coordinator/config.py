"""The coordinator's configuration (its flags: coordinator/__main__.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.api.admission import AdmissionConfig
from coordinator.proposers.adaptive import AdaptiveConfig
from coordinator.proposers.lookup import LookupConfig
from specdec.core.proposer_names import HYBRID, Proposer
from coordinator.proposers.suffix import SuffixConfig
from coordinator.tiers.reachability import ReachabilityConfig
from coordinator.tiers.routing import RoutingConfig
from specdec.serving.server import ServerConfig


@dataclass(frozen=True)
class CoordinatorConfig:
    # The tiers, as gRPC targets: host:port, or a name with many replicas behind it, e.g.
    # dns:///specdec-target.ns.svc.cluster.local:50062 (a headless Service; coordinator.tiers.routing).
    target_address: str  # the target tier
    draft_address: str | None  # the draft tier; None = target-only decoding
    tokenizer: str  # model path / hub id whose tokenizer the coordinator uses (same as the tiers')
    server: ServerConfig = ServerConfig()
    default_max_new_tokens: int = 128  # when a request leaves max_new_tokens unset
    max_new_tokens_cap: int = 4096  # larger requests are rejected
    max_prompt_tokens: int = 8192  # longer prompts are rejected
    default_num_speculative_tokens: int | None = None  # K when a request leaves it unset; None = adaptive
    max_num_speculative_tokens: int = 16  # larger K is rejected
    default_proposer: Proposer = HYBRID  # when a request leaves it unset
    adaptive: AdaptiveConfig = AdaptiveConfig()  # adaptive-K controller settings
    lookup: LookupConfig = LookupConfig()  # prompt-lookup n-gram sizes
    suffix: SuffixConfig = SuffixConfig()  # suffix decoding: tree depth, proposal length, shared-tree bounds
    overlap: bool = False  # the draft tier pre-drafts round r+1 while the target verifies round r (its speculation cache)
    speculate_outcomes: int = 4  # with overlap: outcomes of a round the draft pre-drafts the next round for
    tree_nodes: int = 0  # > 0: prompt lookup and suffix decoding propose token trees of this many nodes (0 = chains)
    draft_tree_nodes: int = 0  # > 0: the draft model may propose token trees of up to this many nodes (0 = chains)
    draft_tree_branching: int = 4  # children per expanded node of the draft's trees, and nodes expanded per level
    draft_tree_scheme: str = "without_replacement"  # sampled draft trees' siblings: without_replacement | iid | candidates
    tier_retry_s: float = 30.0  # retry an unreachable target this long when the client set no deadline
    admission: AdmissionConfig = AdmissionConfig()  # concurrency and request-rate limits
    rpc_timeout_s: float = 60.0  # deadline of each internal rpc
    connect_timeout_s: float = 300.0  # how long to wait at start-up for the tiers to answer
    # --- security (docs/security.md) ---
    tier_ca: str | None = None  # PEM CA that signed the tiers' certs; set = TLS to the tiers (else plaintext)
    tier_client_cert: str | None = None  # PEM client cert chain presented to the tiers (mutual TLS); needs tier_ca
    tier_client_key: str | None = None  # PEM private key of tier_client_cert
    tier_server_name: str | None = None  # name to verify in the tiers' certs instead of the address's host
    auth_token: str | None = field(default=None, repr=False)  # set = public API needs 'authorization: Bearer <it>'
    served_model_name: str | None = None  # OpenAI model id and metrics label; None = specdec.models.served_model_name(target's model)
    reachability: ReachabilityConfig = ReachabilityConfig()  # how often and how patiently each tier is probed
    routing: RoutingConfig = RoutingConfig()  # how sessions reach the replicas of each tier (coordinator.tiers.routing)
