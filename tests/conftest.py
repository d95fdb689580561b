import logging
import os
from pathlib import Path

# gRPC core's own log lines (a TLS handshake a test refuses, say) kept to errors in this process, before gRPC
# loads, as each service's entry point does (specdec/serving/logs.py); tests/test_logs.py sets its own.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc
import openai
import pytest
import torch

from specdec.models import default_draft, default_target, load_model
from specdec.proto import draft_pb2_grpc, generate_pb2_grpc, target_pb2_grpc
from specdec.serving.routing import RING_HASH_ENV
from specdec.models import make_tiny_model
from tests.helpers import TEST_COST_CURVE_S, Cluster, device_model

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# The service processes the tests start (LocalPipeline, specdec serve, fault tests) inherit this: many
# processes share 2 cores here, and OpenMP threads that sleep between parallel regions keep them from
# starving each other. (Set after torch is imported, so this process keeps OpenMP's default; the tests
# time nothing.)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# In-process coordinators route sessions with gRPC's ring hash on a header, as `python -m coordinator`
# does (it sets this too); subprocesses inherit it.
os.environ.setdefault(RING_HASH_ENV, "true")
# Tier processes the tests start measure their start-up cost curve's minimum points only, not for 3 s each
# (tests.helpers.TEST_COST_CURVE_S, which the in-process tiers use, says why).
os.environ.setdefault("SPECDEC_TARGET_COST_CURVE", str(TEST_COST_CURVE_S))
os.environ.setdefault("SPECDEC_DRAFT_COST_CURVE", str(TEST_COST_CURVE_S))


def pytest_collection_modifyitems(items) -> None:
    """A case run in the torch.compile step mode (tests/step_modes.py) is slow: it compiles for minutes
    on 2 cores (make test runs it, make test-fast does not)."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "compile" in params.values():
            item.add_marker(pytest.mark.slow)


try:  # `make test` runs the files on two workers (pytest-xdist, --dist loadfile): a file's tests stay together
    from xdist.scheduler import LoadFileScheduling

    class _FileScheduling(LoadFileScheduling):
        """loadfile, with the bad-input files as one unit: tests/test_bad_input_zz_healthy.py checks the servers
        after the others' bad input, so it runs last on the same worker (the same session-scoped cluster)."""

        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "tests/test_bad_input_*" if "/test_bad_input_" in scope else scope

    def pytest_xdist_make_scheduler(config, log):
        return _FileScheduling(config, log) if config.getoption("dist") == "loadfile" else None
except ImportError:  # no pytest-xdist: one process, files in name order
    pass


@pytest.fixture(autouse=True)
def _root_logger_restored():
    """A test that runs a service's entry point in this process (its flags configure logging) leaves the root
    logger writing to that test's captured stderr, which pytest then closes: later records from background
    tasks would fail to print ("--- Logging error ---"). Each test gets the root logger back as it was."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for h in root.handlers[:]:  # pytest's own capture handlers come and go with each phase: left to it
        if h not in handlers and type(h) is logging.StreamHandler:
            root.removeHandler(h)
    root.setLevel(level)


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
    return load_model(device_model(tiny_target))


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


@pytest.fixture(scope="session")
def renders() -> dict[str, list[dict]]:
    """deploy/ rendered once per run: overlay (+ components) name -> objects, for the deploy tests
    (tests/deploy_renders.py), which read and never change them."""
    from tests.deploy_renders import render_all  # kubernetes-validate and kubectl only where a test asks

    return render_all()


# Raw stubs on the random-draft cluster, for tests that send arbitrary (also invalid) messages.


@pytest.fixture(scope="module")
def cluster(random_draft_cluster):
    return random_draft_cluster


# The official openai client against a cluster's OpenAI-compatible API (the module's `cluster`), and the
# model name it serves.
@pytest.fixture(scope="module")
def oai(cluster):
    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def model(cluster):
    return cluster.coordinator.frontend.model_name


@pytest.fixture(scope="module")
def generation_stub(cluster):
    with grpc.insecure_channel(cluster.address) as ch:
        yield generate_pb2_grpc.GenerationStub(ch)


@pytest.fixture(scope="module")
def draft_stub(cluster):
    with grpc.insecure_channel(f"127.0.0.1:{cluster.draft_port}") as ch:
        yield draft_pb2_grpc.DraftServiceStub(ch)


@pytest.fixture(scope="module")
def target_stub(cluster):
    with grpc.insecure_channel(f"127.0.0.1:{cluster.target_port}") as ch:
        yield target_pb2_grpc.TargetServiceStub(ch)


@pytest.fixture(scope="session")
def tiny_head(tiny_dir, tiny_target_model) -> str:
    """An EAGLE-3 head for the tiny target in the published layout (specdec.engine.eagle3.echo_head: near the target's
    own prediction one position early), whose drafts the tiny model's loops accept often enough, and reject too."""
    from specdec.engine.eagle3 import echo_head, write_checkpoint

    path = tiny_dir / "head"
    write_checkpoint(echo_head(tiny_target_model), path)
    return str(path)
