"""python -m coordinator: serve the public Generation API over a draft and a target service."""

from __future__ import annotations

import asyncio
import logging
import sys

from coordinator.adaptive import AdaptiveConfig
from coordinator.lookup import LookupConfig
from coordinator.proposers import DRAFT_MODEL, HYBRID, PROMPT_LOOKUP
from coordinator.service import SERVICE_NAME, CoordinatorConfig, PipelineMismatch, build
from specdec.config import EnvArgs, add_server_args, server_config, write_port_file
from specdec.models import default_target
from specdec.server import serve

log = logging.getLogger("coordinator")
D = CoordinatorConfig


def main(argv=None) -> None:
    a = EnvArgs("coordinator", "Serve the public Generation API; drives the draft and target services.")
    add_server_args(a, default_port=50051)
    a.add("--target", default="127.0.0.1:50062", help="target service address host:port")
    a.add("--draft", default="127.0.0.1:50061", help="draft service address host:port ('' = target-only decoding)")
    a.add("--tokenizer", default=default_target(), help="model path or hub id whose tokenizer to use (the target's)")
    a.add("--default-max-new-tokens", type=int, default=D.default_max_new_tokens, help="max_new_tokens when unset")
    a.add("--max-new-tokens-cap", type=int, default=D.max_new_tokens_cap, help="largest max_new_tokens accepted")
    a.add("--max-prompt-tokens", type=int, default=D.max_prompt_tokens, help="longest prompt accepted")
    a.add("--default-k", default="auto", help="K when a request leaves it unset: a number, or 'auto' for adaptive K")
    a.add("--max-k", type=int, default=D.max_num_speculative_tokens, help="largest K accepted")
    a.add("--adaptive-max-k", type=int, default=AdaptiveConfig.max_k, help="largest K adaptive K tries")
    a.add("--default-proposer", default=D.default_proposer, choices=[DRAFT_MODEL, PROMPT_LOOKUP, HYBRID],
          help="proposer when a request leaves it unset")
    a.add("--lookup-min-ngram", type=int, default=LookupConfig.min_ngram, help="prompt lookup: shortest suffix matched")
    a.add("--lookup-max-ngram", type=int, default=LookupConfig.max_ngram, help="prompt lookup: longest suffix matched")
    a.add("--rpc-timeout", type=float, default=D.rpc_timeout_s, help="deadline of each internal rpc, seconds")
    a.add("--connect-timeout", type=float, default=D.connect_timeout_s, help="seconds to wait for the tiers at start-up")
    a.add("--overlap", type=bool, default=D.overlap, help="pre-draft the next round while the target verifies")
    args = a.parse(argv)
    config = CoordinatorConfig(
        target_address=args.target, draft_address=args.draft or None, tokenizer=args.tokenizer,
        server=server_config(args), default_max_new_tokens=args.default_max_new_tokens,
        max_new_tokens_cap=args.max_new_tokens_cap, max_prompt_tokens=args.max_prompt_tokens,
        default_num_speculative_tokens=None if args.default_k == "auto" else int(args.default_k),
        max_num_speculative_tokens=args.max_k, default_proposer=args.default_proposer,
        adaptive=AdaptiveConfig(max_k=args.adaptive_max_k),
        lookup=LookupConfig(min_ngram=args.lookup_min_ngram, max_ngram=args.lookup_max_ngram), overlap=args.overlap,
        rpc_timeout_s=args.rpc_timeout, connect_timeout_s=args.connect_timeout,
    )

    async def run() -> None:
        try:
            server, port, health, pipeline = await build(config)
        except (PipelineMismatch, ConnectionError) as e:
            log.error("refusing to start: %s", e)
            sys.exit(2)
        log.info("coordinator on port %d", port)
        await serve(server, health, [SERVICE_NAME], config.server,
                    on_started=lambda: write_port_file(args.port_file, port), on_stop=pipeline.close)

    asyncio.run(run())


if __name__ == "__main__":
    main()
