import os
from pathlib import Path

import pytest
import torch

from specdec.models import ModelConfig, default_draft, default_target, load_model
from tests.helpers import Cluster, make_tiny_model

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_target(tiny_dir) -> str:
    return make_tiny_model(tiny_dir / "target", seed=0)


@pytest.fixture(scope="session")
def tiny_random_draft(tiny_dir) -> str:
    return make_tiny_model(tiny_dir / "draft", seed=1)


@pytest.fixture(scope="session")
def tiny_target_model(tiny_target):
    return load_model(ModelConfig(tiny_target))


@pytest.fixture(scope="session")
def self_draft_cluster(tiny_target):
    """The target is its own draft: every draft token is accepted."""
    cluster = Cluster(tiny_target, tiny_target)
    yield cluster
    cluster.close()


@pytest.fixture(scope="session")
def self_draft_overlap_cluster(tiny_target):
    """Target as its own draft, with overlapped drafting on."""
    cluster = Cluster(tiny_target, tiny_target, coordinator_overrides={"overlap": True})
    yield cluster
    cluster.close()


@pytest.fixture(scope="session")
def random_draft_cluster(tiny_target, tiny_random_draft):
    """An unrelated random draft: almost nothing is accepted."""
    cluster = Cluster(tiny_target, tiny_random_draft)
    yield cluster
    cluster.close()


@pytest.fixture(scope="session")
def real_pair() -> tuple[str, str]:
    target, draft = default_target(), default_draft()
    assert Path(target).exists() and Path(draft).exists(), f"real models missing under {Path(target).parent} (set SPECDEC_MODELS_DIR)"
    return target, draft
