"""The services' command lines, declared once (specdec.core.settings): every field of a service's config
dataclasses is a flag --some-flag and an environment variable SPECDEC_<SERVICE>_SOME_FLAG (e.g.
SPECDEC_DRAFT_MODEL, SPECDEC_TARGET_ADDRESS); a flag on the command line wins. docs/settings.md lists
them all (generated: python -m tests.settings_doc).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from specdec.core.settings import Settings, fail, setting
from specdec.serving.logs import FORMATS as LOG_FORMATS
from specdec.serving.logs import configure_logging
from specdec.serving.server import ServerConfig, server_credentials

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ProcessConfig:
    """The process: its port file, logs and metrics endpoint."""

    port_file: str | None = None  # write the bound port to this file once serving (for port 0)
    log_level: str = setting("info", choices=LOG_LEVELS)  # the least severe log records written
    log_format: str = setting("text", choices=LOG_FORMATS)  # text, or json: one JSON object per line with session id, round, proposer, K and status fields
    metrics_address: str = ""  # host:port of this service's Prometheus /metrics endpoint ('' = none; port 0 = any free port)


# Tiers age their connections so the coordinators re-resolve the tier's name and find new replicas.
TIER_MAX_CONNECTION_AGE_S = 30.0


def service_parser(settings: Settings, description: str) -> argparse.ArgumentParser:
    module = "coordinator" if settings.service == "coordinator" else f"{settings.service}_service"
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    settings.add_to(parser)
    return parser


def parse_service(settings: Settings, description: str, argv=None, environ: Mapping[str, str] | None = None) -> dict:
    """The service's root configs from argv and the environment (exit 2 on a bad value); logging configured."""
    configs = settings.parse(service_parser(settings, description), argv, environ)
    process = configs["process"]
    configure_logging(settings.service, process.log_level, process.log_format)
    return configs


def config_error(message: str, fields: tuple[str, ...] = ()) -> None:
    """Exit 2 with a one-line error, like argparse does for a bad flag; config field names in `fields`
    are shown as their flags (tls_cert -> --tls-cert)."""
    for name in sorted(fields, key=len, reverse=True):
        message = message.replace(name, "--" + name.replace("_", "-"))
    fail(message)


def tier_settings(service: str, root: type, default_model, default_port: int, **defaults) -> Settings:
    """A tier's settings: its config (TierConfig under `tier`, ServerConfig under `server`) and the process;
    `defaults` (flag name with _ for -) where the tier's differ from the fields'."""
    return Settings(service, {"config": root, "process": ProcessConfig},
                    defaults={"model": default_model, "address": f"127.0.0.1:{default_port}",
                              "max-connection-age": TIER_MAX_CONNECTION_AGE_S,
                              **{k.replace("_", "-"): v for k, v in defaults.items()}})


def ready_tier(settings: Settings, config):
    """A tier's parsed config, checked: batching limits, and CUDA graphs captured up to a full batch."""
    tier = config.tier
    try:
        tier.batch.validate()
    except ValueError as e:
        fail(settings.flags_in(str(e)))
    for name in ("capture_sessions", "capture_tokens"):
        sizes = getattr(tier.step, name)
        if not sizes or min(sizes) < 1:
            fail(f"--{name.replace('_', '-')} takes positive integers separated by commas, got {sizes!r}")
    step = replace(tier.step, max_capture_tokens=tier.batch.max_batch_tokens)
    config = replace(config, tier=replace(tier, step=step))
    check_server_tls(config.server)  # unusable TLS files: exit 2 now, before the model loads
    return config


def write_port_file(path: str | None, port: int) -> None:
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, path)


def check_server_tls(config: ServerConfig) -> None:
    """Read the TLS files now (before a model loads for seconds), exiting 2 with a clear error if unusable."""
    try:
        server_credentials(config)
    except (OSError, ValueError) as e:
        config_error(str(e))
