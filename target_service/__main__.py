"""python -m target_service: serve a target model."""

from __future__ import annotations

import asyncio
import logging

from target_service.service import SERVICE_NAME, TargetConfig, build
from specdec.config import EnvArgs, add_tier_args, check_server_tls, server_config, tier_config, write_port_file
from specdec.models import default_target
from specdec.server import serve

log = logging.getLogger("target_service")


def main(argv=None) -> None:
    a = EnvArgs("target", "Serve a target model: verifies draft tokens with lossless rejection sampling.")
    add_tier_args(a, default_model=default_target(), default_port=50062)
    args = a.parse(argv)
    config = TargetConfig(tier=tier_config(args), server=server_config(args))
    check_server_tls(config.server)  # unusable TLS files: exit 2 now, before the model loads

    async def run() -> None:
        server, port, health, tier = build(config)
        log.info("target service for %s on port %d", config.tier.model.path, port)
        await serve(
            server, health, [SERVICE_NAME], config.server,
            on_started=lambda: write_port_file(args.port_file, port), on_stop=tier.close,
        )

    asyncio.run(run())


if __name__ == "__main__":
    main()
