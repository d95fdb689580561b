"""python -m coordinator: serve the public Generation API over a draft and a target service."""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before gRPC loads (specdec/serving/logs.py says why)

import logging
import sys
from dataclasses import replace

from coordinator.tiers.routing import RoutingUnsupported
from specdec.serving.routing import RING_HASH_ENV
from coordinator.api.grpc_api import SERVICE_NAME
from coordinator.config import CoordinatorConfig
from coordinator.pipeline import TIER_TLS_SETTINGS, Pipeline, PipelineMismatch
from coordinator.service import build
from specdec.core.settings import Settings
from specdec.serving.flags import ProcessConfig, check_server_tls, config_error, parse_service, write_port_file
from specdec.models import default_target
from specdec.serving.auth import check_token
from specdec.serving.server import run_event_loop, serve

log = logging.getLogger("coordinator")
DESCRIPTION = "Serve the public Generation API; drives the draft and target services."


def settings() -> Settings:
    """Every flag of the coordinator: the fields of CoordinatorConfig and ProcessConfig (specdec.core.settings)."""
    return Settings("coordinator", {"config": CoordinatorConfig, "process": ProcessConfig},
                    defaults={"address": "127.0.0.1:50051", "target": "127.0.0.1:50062", "draft": "127.0.0.1:50061",
                              "tokenizer": default_target})


def main(argv=None) -> None:
    # Session-affine routing (coordinator.tiers.routing) needs grpc-core's ring hash on a request header, which
    # it reads behind this variable; set before any channel parses its service config. An explicit value
    # from the environment wins (and the start-up probe refuses to start if routing does not work).
    os.environ.setdefault(RING_HASH_ENV, "true")
    configs = parse_service(settings(), DESCRIPTION, argv)
    config, process = configs["config"], configs["process"]
    if config.adaptive.min_gain < 1.0:
        config_error("--adaptive-min-gain must be >= 1 (1 = draft wherever the prediction favours it)")
    if config.draft_model.max_sessions < 0:
        config_error("--draft-max-sessions must be >= 0 (0 = any number)")
    config = replace(config, auth_token=auth_token_from(config.auth_token, config.auth_token_file), auth_token_file=None)
    check_server_tls(config.server)
    try:
        Pipeline.tier_credentials(config)  # unusable TLS settings / files: fail now, not after connect_timeout
    except (OSError, ValueError) as e:
        config_error(str(e), TIER_TLS_SETTINGS)
    if config.auth_token and not config.server.tls_cert:
        log.warning("--auth-token without --tls-cert: the token crosses the network in plaintext unless a proxy terminates TLS")

    async def run() -> None:
        try:
            c = await build(config)
        except (PipelineMismatch, ConnectionError, RoutingUnsupported) as e:
            log.error("refusing to start: %s", e)
            sys.exit(2)
        try:
            metrics = c.serve_metrics(process.metrics_address)
            http = await c.start_http(config.http_address) if config.http_address else None
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
            write_port_file(process.port_file, c.port)

        async def stop() -> None:
            await c.pipeline.close()
            if metrics is not None:
                metrics.close()

        await serve(c.server, c.health, [SERVICE_NAME], config.server,
                    on_started=started, on_stop=stop, on_draining=drain_http)

    run_event_loop(run(), config.server.event_loop)


def auth_token_from(token: str | None, token_file: str | None) -> str | None:
    """--auth-token or the first line of --auth-token-file (not both); None = no token check."""
    if token and token_file:
        config_error("give --auth-token or --auth-token-file, not both")
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            config_error(f"cannot read --auth-token-file {token_file!r}: {e}")
        if not token:
            config_error(f"--auth-token-file {token_file!r} is empty")
    if not token:
        return None
    try:
        return check_token(token)
    except ValueError as e:
        config_error(str(e))


if __name__ == "__main__":
    main()
