"""deploy/ rendered offline for the deploy tests (tests/test_deploy*.py): the renders of every overlay
and the optional components on top of them (`kubectl kustomize`, once per test process), the project's
constants for the tiers (modules, ports, env prefixes), and small helpers over rendered objects."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"

# Oldest Kubernetes the manifests claim (gRPC probes GA in 1.27), and the newest schemas installed.
SCHEMA_VERSIONS = ["1.27", kubernetes_validate.latest_version()]

TIERS = {  # component -> (service module, port, full gRPC service name)
    "target": ("target_service", 50062, "specdec.v1.TargetService"),
    "draft": ("draft_service", 50061, "specdec.v1.DraftService"),
    "coordinator": ("coordinator", 50051, "specdec.v1.Generation"),
}
ENV_PREFIX = {c: f"SPECDEC_{c.upper()}_" for c in TIERS}
# Ports besides gRPC, (name, port, address flag). The tiers get a `metrics` port once they serve
# --metrics-address (TierMetrics wired into the tier engine): add it here and in deploy/base then.
EXTRA_PORTS = {
    "coordinator": [("http", 8000, "HTTP_ADDRESS"), ("metrics", 9400, "METRICS_ADDRESS")],
    "target": [("metrics", 9400, "METRICS_ADDRESS")],
    "draft": [("metrics", 9400, "METRICS_ADDRESS")],
}
OBSERVABILITY = DEPLOY / "observability"
# The tiers' autoscaling signal: a custom metric that prometheus-adapter serves from the tiers' series.
TIER_LOAD_METRIC = "specdec_tier_load"
ADAPTER_VALUES = OBSERVABILITY / "prometheus-adapter-values.yaml"

# name -> (overlay, components layered on top in a scratch kustomization)
RENDERS = {
    "cpu": ("overlays/cpu", []),
    "gpu-hetero": ("overlays/gpu-hetero", []),
    "cpu+tls+hostpath": ("overlays/cpu", ["components/tls", "components/models-hostpath"]),
    "cpu+pvc": ("overlays/cpu", ["components/models-pvc"]),
    "gpu-hetero+tls": ("overlays/gpu-hetero", ["components/tls"]),
    "gpu-hetero+hub+gateway": ("overlays/gpu-hetero", ["components/models-hub", "components/gateway"]),
}
GATEWAY_KINDS = {"HTTPRoute", "GRPCRoute"}  # Gateway API CRDs: checked by test_routes_reach_the_coordinator


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail("kubectl not found on PATH: tests/deploy_renders.py renders deploy/ with `kubectl kustomize`")
    return path


def kustomize(directory: Path) -> list[dict]:
    run = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, f"kubectl kustomize {directory} failed:\n{run.stderr}"
    return [doc for doc in yaml.safe_load_all(run.stdout) if doc]


@functools.cache
def render_all() -> dict[str, list[dict]]:
    """Every render of RENDERS (and deploy/models), once per test process (every deploy test file uses them)."""
    out = {}
    root = Path(tempfile.mkdtemp(prefix="specdec-deploy-"))
    for name, (overlay, components) in RENDERS.items():
        if not components:
            out[name] = kustomize(DEPLOY / overlay)
            continue
        scratch = root / name.replace("+", "-")
        scratch.mkdir()
        rel = lambda p: os.path.relpath(DEPLOY / p, scratch)  # kustomize refuses absolute paths
        kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                         "resources": [rel(overlay)], "components": [rel(c) for c in components]}
        if "components/models-hub" in components:  # its init containers run the specdec image: listed in an
            # overlay, the overlay's `images:` names it; here, on top of one, the same entries do
            kustomization["images"] = yaml.safe_load((DEPLOY / overlay / "kustomization.yaml").read_text())["images"]
        (scratch / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        out[name] = kustomize(scratch)
    shutil.rmtree(root)
    out["models"] = kustomize(DEPLOY / "models")
    return out


# ---- helpers over rendered objects ----

def of_kind(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def component(obj: dict) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def selects(selector: dict, labels: dict) -> bool:
    assert not selector.get("matchExpressions"), "only matchLabels selectors are expected here"
    match = selector.get("matchLabels", selector)
    return bool(match) and all(labels.get(k) == v for k, v in match.items())


def deployments(objs: list[dict]) -> dict[str, dict]:
    """component -> Deployment"""
    deps = {component(d): d for d in of_kind(objs, "Deployment").values()}
    assert set(deps) == set(TIERS), f"one Deployment per service, got {sorted(deps)}"
    return deps


def container(dep: dict) -> dict:
    containers = dep["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def env_value(c: dict, name: str) -> str:
    return env_of(c)[name]["value"]


def quantity(q) -> float:
    """Kubernetes quantity -> float (cores or bytes)."""
    m = re.fullmatch(r"([0-9.]+)(m|k|Ki|M|Mi|G|Gi|T|Ti)?", str(q))
    assert m, f"unparsed quantity {q!r}"
    scale = {None: 1, "m": 1e-3, "k": 1e3, "Ki": 2**10, "M": 1e6, "Mi": 2**20, "G": 1e9, "Gi": 2**30,
             "T": 1e12, "Ti": 2**40}[m.group(2)]
    return float(m.group(1)) * scale


def pod_containers(dep: dict) -> list[dict]:
    spec = dep["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def overlay_images(overlay: str) -> dict[str, str]:
    """image name -> the reference the overlay's `images:` makes of it"""
    entries = yaml.safe_load((DEPLOY / overlay / "kustomization.yaml").read_text())["images"]
    return {e["name"]: f"{e.get('newName', e['name'])}:{e['newTag']}" for e in entries}
