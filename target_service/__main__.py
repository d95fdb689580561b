"""python -m target_service: serve a target model."""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before gRPC loads (specdec/serving/logs.py says why)

from specdec.engine.threads import spin_briefly  # torch-free

spin_briefly()  # before torch loads libgomp (specdec/engine/threads.py says why)

from target_service.service import SERVICE_NAME, TargetConfig, build
from specdec.core.settings import Settings
from specdec.serving.flags import parse_service, ready_tier, tier_settings
from specdec.serving.tier import run_tier
from specdec.models import default_target

DESCRIPTION = "Serve a target model: verifies draft tokens with lossless rejection sampling."


def settings() -> Settings:
    """Every flag of the target tier: the fields of TargetConfig and ProcessConfig (specdec.core.settings)."""
    return tier_settings("target", TargetConfig, default_model=default_target, default_port=50062)


def main(argv=None) -> None:
    s = settings()
    configs = parse_service(s, DESCRIPTION, argv)
    config, process = ready_tier(s, configs["config"]), configs["process"]
    run_tier("target", SERVICE_NAME, build, config, process.port_file, process.metrics_address)


if __name__ == "__main__":
    main()
