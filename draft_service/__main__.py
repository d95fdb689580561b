"""python -m draft_service: serve a draft model."""

from __future__ import annotations

import asyncio
import logging

from draft_service.service import SERVICE_NAME, DraftConfig, build
from specdec.config import EnvArgs, add_tier_args, check_server_tls, server_config, tier_config, write_port_file
from specdec.models import default_draft
from specdec.server import serve

log = logging.getLogger("draft_service")


def main(argv=None) -> None:
    a = EnvArgs("draft", "Serve a draft model: proposes K tokens per round with their probabilities q.")
    add_tier_args(a, default_model=default_draft(), default_port=50061)
    a.add("--draft-top-n", type=int, default=DraftConfig.draft_top_n, help="tokens kept in each q row on the wire")
    args = a.parse(argv)
    config = DraftConfig(tier=tier_config(args), server=server_config(args), draft_top_n=args.draft_top_n)
    check_server_tls(config.server)  # unusable TLS files: exit 2 now, before the model loads

    async def run() -> None:
        server, port, health, tier = build(config)
        log.info("draft service for %s on port %d", config.tier.model.path, port)
        await serve(
            server, health, [SERVICE_NAME], config.server,
            on_started=lambda: write_port_file(args.port_file, port), on_stop=tier.close,
        )

    asyncio.run(run())


if __name__ == "__main__":
    main()
