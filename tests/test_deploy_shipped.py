"""deploy/ as shipped, checked offline on the renders of tests/deploy_renders.py: what a GPU cluster needs for
every tier to start and keep its sessions. No `replicas` under an HPA (an apply would scale a tier back);
Triton's cache on a writable volume under a read-only root filesystem and a non-root user; a compiler in
the CUDA image only; a maximum connection age on the coordinators; GPU volumes that hold an 8B target in
bfloat16; each tier's own model from the hub (the coordinator: the tokenizer only); Gateway API routes to
the coordinator's ports."""

from __future__ import annotations

import re

import pytest

from tests.deploy_renders import (DEPLOY, ENV_PREFIX, RENDERS, TIERS, container, deployments, env_of, env_value, of_kind,
                                  quantity)


@pytest.mark.parametrize("name", RENDERS)
def test_no_replicas_under_an_hpa(renders, name):
    """An HPA owns its Deployment's count: a `replicas` in the manifest would scale the tier back on every
    apply and drop the sessions of the replicas it removes."""
    deps = of_kind(renders[name], "Deployment")
    hpas = of_kind(renders[name], "HorizontalPodAutoscaler")
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas.values()} == set(deps)
    for dep_name, dep in deps.items():
        assert "replicas" not in dep["spec"], f"{name}: {dep_name} sets replicas under its HPA"


@pytest.mark.parametrize("name", RENDERS)
def test_triton_cache_on_a_writable_volume(renders, name):
    """The tiers compile Triton's kernels at start under a read-only root filesystem, as a non-root user:
    TRITON_CACHE_DIR must lie on a writable emptyDir mount (and the image sets the same path)."""
    image_env = re.search(r"TRITON_CACHE_DIR=(\S+)", (DEPLOY / "Dockerfile").read_text()).group(1)
    for comp, dep in deployments(renders[name]).items():
        if comp == "coordinator":
            continue
        spec, c = dep["spec"]["template"]["spec"], container(dep)
        assert c["securityContext"]["readOnlyRootFilesystem"] is True and spec["securityContext"]["runAsNonRoot"] is True
        path = env_value(c, "TRITON_CACHE_DIR")
        assert path == image_env
        volumes = {v["name"]: v for v in spec["volumes"]}
        (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        assert not mount.get("readOnly") and "emptyDir" in volumes[mount["name"]], (name, comp, mount)


def test_cuda_image_has_a_compiler_and_the_cpu_image_none():
    text = (DEPLOY / "Dockerfile").read_text()
    runtime = text.split("\nFROM ${PYTHON_IMAGE}\n")[-1]  # the runtime stage
    assert re.search(r'^ARG RUNTIME_PACKAGES=""$', runtime, re.M), "the CPU image stays without a compiler"
    assert "apt-get install -y --no-install-recommends ${RUNTIME_PACKAGES}" in runtime
    overlay = (DEPLOY / "overlays/gpu-hetero/kustomization.yaml").read_text()
    assert '--build-arg RUNTIME_PACKAGES="gcc libc6-dev"' in overlay and '--build-arg RUNTIME_PACKAGES="gcc libc6-dev"' in text
    assert re.search(r"^    TRITON_CACHE_DIR=/var/cache/specdec/", runtime, re.M)  # under the cache volume's mount


@pytest.mark.parametrize("name", RENDERS)
def test_coordinator_sets_a_maximum_connection_age(renders, name):
    c = container(deployments(renders[name])["coordinator"])
    assert 0 < float(env_value(c, "SPECDEC_COORDINATOR_MAX_CONNECTION_AGE")) <= 3600


def test_gpu_volumes_fit_an_8b_target_in_bfloat16(renders):
    """An 8B target in bfloat16 is 16 GB of weights: its pod's models volume and disk must hold it."""
    for name in ("gpu-hetero", "gpu-hetero+hub+gateway"):
        dep = deployments(renders[name])["target"]
        volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
        models = quantity(volumes["models"]["emptyDir"]["sizeLimit"])
        assert models >= 1.2 * 8e9 * 2, f"{name}: models volume {models / 2**30:.1f} GiB"
        total = sum(quantity(v["emptyDir"]["sizeLimit"]) for v in volumes.values() if "emptyDir" in v)
        assert quantity(container(dep)["resources"]["limits"]["ephemeral-storage"]) >= total


def test_each_tier_fetches_its_own_model_from_the_hub(renders):
    """components/models-hub: one init container per pod downloads that tier's model (the coordinator: the
    tokenizer's files only), with an optional token from a Secret; the service serves what it fetched."""
    for comp, dep in deployments(renders["gpu-hetero+hub+gateway"]).items():
        spec = dep["spec"]["template"]["spec"]
        (init,) = spec["initContainers"]
        env = env_of(init)
        assert init["image"].split(":")[0].endswith("specdec") and "snapshot_download" in init["command"][-1]
        assert "/" in env["MODEL_ID"]["value"]
        token = env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert token["name"] == "specdec-hub-token" and token["optional"] is True
        files = env["MODEL_FILES"]["value"].split()
        if comp == "coordinator":
            assert "tokenizer.json" in files and not any(f.endswith((".safetensors", ".gguf", ".bin")) for f in files)
        else:
            assert files == []  # the whole repository
        model_var = "SPECDEC_COORDINATOR_TOKENIZER" if comp == "coordinator" else ENV_PREFIX[comp] + "MODEL"
        assert env_value(container(dep), model_var) == "/models/model"
        assert init["securityContext"]["readOnlyRootFilesystem"] is True and env["HF_HOME"]["value"].startswith("/mnt/models/")
    deps = deployments(renders["gpu-hetero+hub+gateway"])
    ids = {comp: env_of(d["spec"]["template"]["spec"]["initContainers"][0])["MODEL_ID"]["value"] for comp, d in deps.items()}
    assert ids["coordinator"] == ids["target"] != ids["draft"]


def test_routes_reach_the_coordinator(renders):
    objs = renders["gpu-hetero+hub+gateway"]
    service = of_kind(objs, "Service")["specdec-coordinator"]
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    (http,) = of_kind(objs, "HTTPRoute").values()
    (grpc_route,) = of_kind(objs, "GRPCRoute").values()
    for route in (http, grpc_route):
        assert route["apiVersion"] == "gateway.networking.k8s.io/v1" and route["spec"]["parentRefs"]
    (rule,) = http["spec"]["rules"]
    assert rule["matches"][0]["path"]["value"] == "/v1"
    assert rule["backendRefs"] == [{"name": "specdec-coordinator", "port": ports["http"]}]
    (rule,) = grpc_route["spec"]["rules"]
    assert rule["matches"][0]["method"]["service"] == TIERS["coordinator"][2]
    assert rule["backendRefs"] == [{"name": "specdec-coordinator", "port": ports["grpc"]}]
