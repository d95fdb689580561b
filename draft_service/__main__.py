"""python -m draft_service: serve a draft model, or an EAGLE-3 head (a feature draft)."""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # before gRPC loads (specdec/serving/logs.py says why)
# Direct rounds reach the target's replicas by the session's routing key, as the coordinator does (gRFC A76's
# requestHashHeader, which grpc-core honours only with this set; the environment's value wins)
os.environ.setdefault("GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY", "true")

from specdec.engine.threads import spin_briefly  # torch-free

spin_briefly()  # before torch loads libgomp (specdec/engine/threads.py says why)

from draft_service.service import DIRECT_TLS_SETTINGS, SERVICE_NAME, DraftConfig, build, target_link
from specdec.core.settings import Settings, fail
from specdec.engine.draft_vocab_head import DraftVocabError
from specdec.engine.eagle3_checks import CheckpointError
from specdec.serving.flags import config_error, parse_service, ready_tier, tier_settings
from specdec.serving.tier import run_tier
from specdec.models import default_draft

DESCRIPTION = ("Serve a draft model, or an EAGLE-3 head (--model its checkpoint directory, --head-target its target): "
               "proposes K tokens per round with their probabilities q.")


def settings() -> Settings:
    """Every flag of the draft tier: the fields of DraftConfig and ProcessConfig (specdec.core.settings)."""
    # a draft's weights may be quantised freely and its head may score part of the vocabulary (its q is reported as
    # drawn): Q8_0 where the block kernel runs it, the lowest third of a large vocabulary
    return tier_settings("draft", DraftConfig, default_model=default_draft, default_port=50061, quantize="auto",
                         draft_vocab="auto")


def main(argv=None) -> None:
    s = settings()
    configs = parse_service(s, DESCRIPTION, argv)
    config, process = ready_tier(s, configs["config"]), configs["process"]
    try:
        target_link(config)  # unusable TLS settings / files for direct rounds: exit 2 now, not at the first Drive
    except (OSError, ValueError) as e:
        config_error(str(e), DIRECT_TLS_SETTINGS)
    try:
        run_tier("draft", SERVICE_NAME, build, config, process.port_file, process.metrics_address)
    except CheckpointError as e:  # an EAGLE-3 head that does not fit its target: say which field, exit 2
        fail(f"{e} (--model {config.tier.model.path}, --head-target {config.head_target or 'the default target'})")
    except DraftVocabError as e:  # a --draft-vocab that names no usable vocabulary: exit 2 saying why
        fail(str(e))


if __name__ == "__main__":
    main()
