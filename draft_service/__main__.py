"""python -m draft_service: serve a draft model."""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before gRPC loads (specdec/serving/logs.py says why)

from draft_service.service import SERVICE_NAME, DraftConfig, build
from specdec.serving.flags import EnvArgs, add_tier_args, check_server_tls, server_config, tier_config
from specdec.serving.tier import run_tier
from specdec.models import default_draft


def main(argv=None) -> None:
    a = EnvArgs("draft", "Serve a draft model: proposes K tokens per round with their probabilities q.")
    add_tier_args(a, default_model=default_draft(), default_port=50061)
    a.add("--draft-top-n", type=int, default=DraftConfig.draft_top_n, help="tokens kept in each q row on the wire")
    args = a.parse(argv)
    config = DraftConfig(tier=tier_config(args), server=server_config(args), draft_top_n=args.draft_top_n)
    check_server_tls(config.server)  # unusable TLS files: exit 2 now, before the model loads

    run_tier("draft", SERVICE_NAME, build, config, args.port_file, args.metrics_address)


if __name__ == "__main__":
    main()
