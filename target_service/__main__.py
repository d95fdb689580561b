"""python -m target_service: serve a target model."""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before gRPC loads (specdec/serving/logs.py says why)

from target_service.service import SERVICE_NAME, TargetConfig, build
from specdec.serving.flags import EnvArgs, add_tier_args, check_server_tls, server_config, tier_config
from specdec.serving.tier import run_tier
from specdec.models import default_target


def main(argv=None) -> None:
    a = EnvArgs("target", "Serve a target model: verifies draft tokens with lossless rejection sampling.")
    add_tier_args(a, default_model=default_target(), default_port=50062)
    args = a.parse(argv)
    config = TargetConfig(tier=tier_config(args), server=server_config(args))
    check_server_tls(config.server)  # unusable TLS files: exit 2 now, before the model loads

    run_tier("target", SERVICE_NAME, build, config, args.port_file, args.metrics_address)


if __name__ == "__main__":
    main()
