"""python -m draft_service: serve a draft model."""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before gRPC loads (specdec/serving/logs.py says why)

from draft_service.service import SERVICE_NAME, DraftConfig, build
from specdec.core.settings import Settings
from specdec.serving.flags import parse_service, ready_tier, tier_settings
from specdec.serving.tier import run_tier
from specdec.models import default_draft

DESCRIPTION = "Serve a draft model: proposes K tokens per round with their probabilities q."


def settings() -> Settings:
    """Every flag of the draft tier: the fields of DraftConfig and ProcessConfig (specdec.core.settings)."""
    return tier_settings("draft", DraftConfig, default_model=default_draft, default_port=50061)


def main(argv=None) -> None:
    s = settings()
    configs = parse_service(s, DESCRIPTION, argv)
    config, process = ready_tier(s, configs["config"]), configs["process"]
    run_tier("draft", SERVICE_NAME, build, config, process.port_file, process.metrics_address)


if __name__ == "__main__":
    main()
