"""python -m coordinator: serve the public Generation API over a draft and a target service."""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before gRPC loads (specdec/serving/logs.py says why)

import asyncio
import logging
import sys

from coordinator.proposers.adaptive import AdaptiveConfig
from coordinator.api.admission import AdmissionConfig
from coordinator.proposers.lookup import LookupConfig
from specdec.core.proposer_names import NAMES, Proposer
from coordinator.tiers.routing import RING_HASH_ENV, RoutingConfig, RoutingUnsupported
from coordinator.api.grpc_api import SERVICE_NAME
from coordinator.config import CoordinatorConfig
from coordinator.pipeline import Pipeline, PipelineMismatch
from coordinator.service import build
from coordinator.proposers.suffix import SuffixConfig
from specdec.serving.flags import (EnvArgs, add_server_args, check_server_tls, config_error, server_config, write_port_file)
from specdec.models import default_target
from specdec.serving.metrics import serve_metrics
from specdec.serving.auth import check_token
from specdec.serving.server import serve

log = logging.getLogger("coordinator")
D = CoordinatorConfig


def main(argv=None) -> None:
    # Session-affine routing (coordinator.tiers.routing) needs grpc-core's ring hash on a request header, which
    # it reads behind this variable; set before any channel parses its service config. An explicit value
    # from the environment wins (and the start-up probe refuses to start if routing does not work).
    os.environ.setdefault(RING_HASH_ENV, "true")
    a = EnvArgs("coordinator", "Serve the public Generation API; drives the draft and target services.")
    add_server_args(a, default_port=50051)
    a.add("--target", default="127.0.0.1:50062",
          help="target tier: host:port, or a name resolving to every replica, e.g. dns:///specdec-target.<ns>.svc.cluster.local:50062")
    a.add("--draft", default="127.0.0.1:50061",
          help="draft tier, like --target ('' = target-only decoding)")
    a.add("--min-resolution-interval", type=float, default=RoutingConfig.min_resolution_interval_s,
          help="re-resolve a tier's name (to find replicas that joined or left) at most this often, seconds")
    a.add("--prefix-route-tokens", type=int, default=RoutingConfig.prefix_tokens,
          help="a prompt longer than this (and without a prompt_cache_key) reaches the replicas by the fingerprint of "
               "its first this-many tokens, where their prefix caches hold it; 0 = route every session by its own id")
    a.add("--tokenizer", default=default_target(), help="model path or hub id whose tokenizer to use (the target's)")
    a.add("--default-max-new-tokens", type=int, default=D.default_max_new_tokens, help="max_new_tokens when unset")
    a.add("--max-new-tokens-cap", type=int, default=D.max_new_tokens_cap, help="largest max_new_tokens accepted")
    a.add("--max-prompt-tokens", type=int, default=D.max_prompt_tokens, help="longest prompt accepted")
    a.add("--default-k", default="auto", help="K when a request leaves it unset: a number, or 'auto' for adaptive K")
    a.add("--max-k", type=int, default=D.max_num_speculative_tokens, help="largest K accepted")
    a.add("--adaptive-max-k", type=int, default=AdaptiveConfig.max_k, help="largest K adaptive K tries")
    a.add("--adaptive-min-gain", type=float, default=AdaptiveConfig.min_gain,
          help="adaptive K drafts only where its predicted tokens per unit of time beat K = 0's by this factor (>= 1)")
    a.add("--draft-max-sessions", type=int, default=AdaptiveConfig.draft_max_sessions,
          help="adaptive K asks the draft model only while at most this many generations run (0 = any): for tiers "
               "sharing one machine's cores, where a draft beside a busy target slows both (specdec serve / run-local set 1)")
    a.add("--default-proposer", default=D.default_proposer, choices=list(NAMES),
          help="proposer when a request leaves it unset (a name or alias of specdec.core.proposer_names)")
    a.add("--lookup-min-ngram", type=int, default=LookupConfig.min_ngram, help="prompt lookup: shortest suffix matched")
    a.add("--lookup-max-ngram", type=int, default=LookupConfig.max_ngram, help="prompt lookup: longest suffix matched")
    S = SuffixConfig
    a.add("--suffix-max-depth", type=int, default=S.max_depth, help="suffix decoding: longest indexed substring (match + proposal)")
    a.add("--suffix-max-spec-factor", type=float, default=S.max_spec_factor,
          help="suffix decoding: a match of m tokens proposes at most m * factor + offset tokens")
    a.add("--suffix-max-spec-offset", type=float, default=S.max_spec_offset, help="suffix decoding: see --suffix-max-spec-factor")
    a.add("--suffix-min-token-prob", type=float, default=S.min_token_prob,
          help="suffix decoding: stop a proposal when its estimated probability falls below this")
    a.add("--suffix-cache-entries", type=int, default=S.cache_entries,
          help="suffix decoding: finished outputs kept in the tree shared by all sessions (0 = none)")
    a.add("--suffix-cache-mb", type=float, default=S.cache_bytes / 2**20,
          help="suffix decoding: estimated memory bound of the shared tree, MiB (the oldest outputs are evicted)")
    a.add("--rpc-timeout", type=float, default=D.rpc_timeout_s, help="deadline of each internal rpc, seconds")
    a.add("--connect-timeout", type=float, default=D.connect_timeout_s, help="seconds to wait for the tiers at start-up")
    a.add("--max-concurrency", type=int, default=AdmissionConfig.max_concurrency,
          help="generations in flight before RESOURCE_EXHAUSTED (0 = unlimited)")
    a.add("--max-rps", type=float, default=AdmissionConfig.max_requests_per_s,
          help="new generations per second before RESOURCE_EXHAUSTED (0 = unlimited)")
    a.add("--admission-wait", type=float, default=AdmissionConfig.max_queue_wait_s,
          help="longest wait for a rate slot, seconds")
    a.add("--tier-retry-timeout", type=float, default=D.tier_retry_s,
          help="seconds to keep retrying an unreachable target when the client set no deadline")
    a.add("--overlap", type=bool, default=D.overlap,
          help="the draft tier pre-drafts the next round while the target verifies (its speculation cache)")
    a.add("--speculate-outcomes", type=int, default=D.speculate_outcomes,
          help="with --overlap: the likeliest outcomes of a round the draft pre-drafts the next round for")
    a.add("--draft-tree-nodes", type=int, default=D.draft_tree_nodes,
          help="> 0: the draft model may propose token trees of up to this many nodes, shaped per round (0 = chains)")
    a.add("--draft-tree-branching", type=int, default=D.draft_tree_branching,
          help="children per expanded node of the draft model's trees")
    a.add("--draft-tree-scheme", default=D.draft_tree_scheme, choices=["without_replacement", "iid", "candidates"],
          help="how a sampled draft tree's siblings are drawn (the target's verifier follows)")
    a.add("--tree-nodes", type=int, default=D.tree_nodes,
          help="> 0: prompt lookup and suffix decoding propose token trees of this many nodes, K their depth (0 = chains)")
    a.add("--tier-ca", default=None, help="PEM CA that signed the tiers' certificates: connect to the tiers over TLS")
    a.add("--tier-client-cert", default=None, help="PEM client certificate presented to the tiers (mutual TLS)")
    a.add("--tier-client-key", default=None, help="PEM private key of --tier-client-cert")
    a.add("--tier-server-name", default=None, help="name to verify in the tiers' certificates (default: the address's host)")
    a.add("--auth-token", default=None, secret=True,
          help="require 'authorization: Bearer <token>' on the public API (health and reflection stay open)")
    a.add("--auth-token-file", default=None, help="read the bearer token from this file (alternative to --auth-token)")
    a.add("--http-address", default="",
          help="host:port of the OpenAI-compatible HTTP API ('' = none; port 0 = any free port); same token as gRPC")
    a.add("--served-model-name", default=None,
          help="model id of the OpenAI API and the metrics' model_name label (default: the target model's directory or .gguf name, or its hub id)")
    args = a.parse(argv)
    if args.adaptive_min_gain < 1.0:
        config_error("--adaptive-min-gain must be >= 1 (1 = draft wherever the prediction favours it)")
    if args.draft_max_sessions < 0:
        config_error("--draft-max-sessions must be >= 0 (0 = any number)")
    auth_token = auth_token_from(args)
    try:
        suffix = SuffixConfig(max_depth=args.suffix_max_depth, max_spec_factor=args.suffix_max_spec_factor,
                              max_spec_offset=args.suffix_max_spec_offset, min_token_prob=args.suffix_min_token_prob,
                              cache_entries=args.suffix_cache_entries, cache_bytes=int(args.suffix_cache_mb * 2**20))
    except ValueError as e:
        config_error(str(e))
    config = CoordinatorConfig(
        target_address=args.target, draft_address=args.draft or None, tokenizer=args.tokenizer,
        server=server_config(args), default_max_new_tokens=args.default_max_new_tokens,
        max_new_tokens_cap=args.max_new_tokens_cap, max_prompt_tokens=args.max_prompt_tokens,
        default_num_speculative_tokens=None if args.default_k == "auto" else int(args.default_k),
        max_num_speculative_tokens=args.max_k, default_proposer=Proposer.parse(args.default_proposer),
        adaptive=AdaptiveConfig(max_k=args.adaptive_max_k, draft_max_sessions=args.draft_max_sessions,
                                min_gain=args.adaptive_min_gain),
        lookup=LookupConfig(min_ngram=args.lookup_min_ngram, max_ngram=args.lookup_max_ngram), overlap=args.overlap,
        tree_nodes=args.tree_nodes, speculate_outcomes=args.speculate_outcomes, draft_tree_nodes=args.draft_tree_nodes,
        draft_tree_branching=args.draft_tree_branching, draft_tree_scheme=args.draft_tree_scheme,
        suffix=suffix,
        rpc_timeout_s=args.rpc_timeout, connect_timeout_s=args.connect_timeout, tier_retry_s=args.tier_retry_timeout,
        admission=AdmissionConfig(max_concurrency=args.max_concurrency, max_requests_per_s=args.max_rps,
                                  max_queue_wait_s=args.admission_wait),
        tier_ca=args.tier_ca or None, tier_client_cert=args.tier_client_cert or None,
        tier_client_key=args.tier_client_key or None, tier_server_name=args.tier_server_name or None,
        auth_token=auth_token, served_model_name=args.served_model_name or None,
        routing=RoutingConfig(min_resolution_interval_s=args.min_resolution_interval, prefix_tokens=args.prefix_route_tokens),
    )
    check_server_tls(config.server)
    try:
        Pipeline._tier_credentials(config)  # unusable TLS settings / files: fail now, not after connect_timeout
    except (OSError, ValueError) as e:
        config_error(str(e), ("tier_ca", "tier_client_cert", "tier_client_key", "tier_server_name"))
    if auth_token and not config.server.tls_cert:
        log.warning("--auth-token without --tls-cert: the token crosses the network in plaintext unless a proxy terminates TLS")

    async def run() -> None:
        try:
            c = await build(config)
        except (PipelineMismatch, ConnectionError, RoutingUnsupported) as e:
            log.error("refusing to start: %s", e)
            sys.exit(2)
        try:
            metrics = serve_metrics(c.registry, args.metrics_address)
            http = await c.start_http(args.http_address) if args.http_address else None
        except (OSError, ValueError) as e:
            log.error("refusing to start: %s", e)
            sys.exit(2)
        log.info("coordinator on port %d%s", c.port, f", OpenAI API on {http.url}" if http else "")

        async def drain_http() -> None:
            c.frontend.accepting = False
            if http is not None:
                await http.stop()

        def started() -> None:
            c.pipeline.announce_reachability()  # serve() said SERVING: correct it if the target is gone already
            write_port_file(args.port_file, c.port)

        async def stop() -> None:
            await c.pipeline.close()
            if metrics is not None:
                metrics.close()

        await serve(c.server, c.health, [SERVICE_NAME], config.server,
                    on_started=started, on_stop=stop, on_draining=drain_http)

    asyncio.run(run())


def auth_token_from(args) -> str | None:
    """--auth-token or the first line of --auth-token-file (not both); None = no token check."""
    if args.auth_token and args.auth_token_file:
        config_error("give --auth-token or --auth-token-file, not both")
    token = args.auth_token
    if args.auth_token_file:
        try:
            with open(args.auth_token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            config_error(f"cannot read --auth-token-file {args.auth_token_file!r}: {e}")
        if not token:
            config_error(f"--auth-token-file {args.auth_token_file!r} is empty")
    if not token:
        return None
    try:
        return check_token(token)
    except ValueError as e:
        config_error(str(e))


if __name__ == "__main__":
    main()
