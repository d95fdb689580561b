"""deploy/ checked offline: every overlay (and the optional components on top of them) is rendered
with `kubectl kustomize`, every rendered object is validated against the Kubernetes JSON schemas
(kubernetes-validate, strict: unknown fields fail), and the project's invariants are asserted:
probes on the serving ports, resources, peer addresses that resolve to Services that select the
right pods, PDB + HPA + NetworkPolicy per tier, env vars that are real flags, the GPU placement of
the gpu-hetero overlay, and a Dockerfile consistent with pyproject.toml. No cluster, no network."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from coordinator.tiers.routing import RING_HASH_ENV

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
        pytest.fail("kubectl not found on PATH: tests/test_deploy.py renders deploy/ with `kubectl kustomize`")
    return path


def kustomize(directory: Path) -> list[dict]:
    run = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, f"kubectl kustomize {directory} failed:\n{run.stderr}"
    return [doc for doc in yaml.safe_load_all(run.stdout) if doc]


@functools.cache
def render_all() -> dict[str, list[dict]]:
    """Every render of RENDERS (and deploy/models), once per test process (test_deploy_shipped.py uses them too)."""
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


@pytest.fixture(scope="module")
def renders() -> dict[str, list[dict]]:
    return render_all()


@pytest.fixture(scope="module")
def flag_envs() -> set[str]:
    """Every SPECDEC_<SERVICE>_<FLAG> the three entry points accept, read from their --help."""
    code = ("import contextlib, io\n"
            "for m in ('target_service', 'draft_service', 'coordinator'):\n"
            "    mod = __import__(m + '.__main__', fromlist=['main'])\n"
            "    buf = io.StringIO()\n"
            "    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):\n"
            "        mod.main(['--help'])\n"
            "    print(buf.getvalue())\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    names = set(re.findall(r"\[env\s+(SPECDEC_[A-Z_]+)", run.stdout))
    assert {"SPECDEC_TARGET_MODEL", "SPECDEC_COORDINATOR_DRAFT"} <= names
    return names


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


# ---- tests ----

@pytest.mark.parametrize("name", [*RENDERS, "models"])
def test_schema_valid(renders, name):
    objs = renders[name]
    assert objs
    for obj in objs:
        for version in SCHEMA_VERSIONS if obj["kind"] not in GATEWAY_KINDS else ():
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} invalid for Kubernetes {version}: {e}")
        assert obj["metadata"]["labels"]["app.kubernetes.io/name"] == "specdec"
        assert obj["metadata"]["labels"]["app.kubernetes.io/component"]


@pytest.mark.parametrize("name", RENDERS)
def test_probes_ports_and_services(renders, name):
    objs = renders[name]
    services = of_kind(objs, "Service")
    tls = "tls" in name
    for comp, dep in deployments(objs).items():
        module, port, grpc_service = TIERS[comp]
        c = container(dep)
        pod_labels = dep["spec"]["template"]["metadata"]["labels"]
        assert selects(dep["spec"]["selector"], pod_labels)
        assert c["args"] == [module]
        extra = EXTRA_PORTS[comp]
        assert [(p["name"], p["containerPort"]) for p in c["ports"]] == [("grpc", port)] + [(n, p) for n, p, _ in extra]
        assert env_value(c, ENV_PREFIX[comp] + "ADDRESS") == f"0.0.0.0:{port}"
        for _, extra_port, flag in extra:  # each extra port is served: its address flag is set to it
            assert env_value(c, ENV_PREFIX[comp] + flag) == f"0.0.0.0:{extra_port}"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            handler = c[probe]
            if tls and comp == "coordinator" and probe == "readinessProbe":  # follows the tiers: not a port
                assert handler["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}
            elif tls:  # kubelet's gRPC probes cannot speak TLS: components/tls switches to TCP
                assert "grpc" not in handler and handler["tcpSocket"]["port"] == port, (comp, probe)
            else:
                assert handler["grpc"]["port"] == port, (comp, probe)
        if not tls:  # startup and readiness ask for the service by name; liveness for the server ("")
            assert c["startupProbe"]["grpc"]["service"] == grpc_service
            assert c["readinessProbe"]["grpc"]["service"] == grpc_service
            assert c["livenessProbe"]["grpc"].get("service", "") == ""
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model load needs a generous startupProbe"
        # exactly one Service selects these pods, on the container's port
        mine = [s for s in services.values() if selects(s["spec"]["selector"], pod_labels)]
        assert len(mine) == 1, (comp, [s["metadata"]["name"] for s in mine])
        svc = mine[0]["spec"]
        assert [(p["port"], p["targetPort"]) for p in svc["ports"]] == [(port, "grpc")] + [(p, n) for n, p, _ in extra]
        if comp == "coordinator":
            assert svc.get("type", "ClusterIP") == "ClusterIP" and svc.get("clusterIP") != "None"
        else:
            assert svc["clusterIP"] == "None", "tier Services are headless (replica discovery by DNS)"


@pytest.mark.parametrize("name", RENDERS)
def test_peer_addresses_resolve(renders, name):
    """The coordinator reaches each tier by its headless Service's DNS name in its own namespace (every
    ready pod: all the replicas), through gRPC's dns resolver."""
    objs = renders[name]
    services = of_kind(objs, "Service")
    deps = deployments(objs)
    coord = container(deps["coordinator"])
    env = env_of(coord)
    names = list(env)
    for tier in ("target", "draft"):
        var = f"SPECDEC_COORDINATOR_{tier.upper()}"
        m = re.fullmatch(r"dns:///([a-z0-9-]+)\.\$\(([A-Z_]+)\)\.svc\.cluster\.local:(\d+)", env[var]["value"])
        assert m, f"{var} is not dns:///<service>.$(<namespace var>).svc.cluster.local:<port>: {env[var]['value']}"
        host, namespace_var, port = m.groups()
        assert host in services, f"{var} names no Service: {host}"
        # $(VAR) expands only from a variable defined earlier in the list: the pod's own namespace
        assert names.index(namespace_var) < names.index(var)
        assert env[namespace_var]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
        svc = services[host]
        assert svc["spec"]["clusterIP"] == "None", "a headless Service: DNS answers every ready pod"
        assert int(port) in [p["port"] for p in svc["spec"]["ports"]]
        assert selects(svc["spec"]["selector"], deps[tier]["spec"]["template"]["metadata"]["labels"])
        assert int(port) == TIERS[tier][1]
    # the coordinator's tokenizer: its own copy of the tokenizer's files (checked against the tiers' at start)
    assert env_value(coord, "SPECDEC_COORDINATOR_TOKENIZER") in ("/models/tokenizer", "/models/model")


@pytest.mark.parametrize("name", RENDERS)
def test_coordinator_routes_by_session_with_ring_hash(renders, name):
    """Where the coordinator runs, grpc-core is told to honour the ring hash's request header; the tiers
    age their connections so that coordinators find new replicas."""
    deps = deployments(renders[name])
    coord = container(deps["coordinator"])
    assert env_value(coord, RING_HASH_ENV) == "true"
    for tier in ("target", "draft"):
        age = float(env_value(container(deps[tier]), ENV_PREFIX[tier] + "MAX_CONNECTION_AGE"))
        assert 0 < age <= 300
        assert float(env_value(coord, "SPECDEC_COORDINATOR_MIN_RESOLUTION_INTERVAL")) < age


def test_image_sets_the_ring_hash_variable():
    text = (DEPLOY / "Dockerfile").read_text()
    final_stage = text[text.rindex("\nFROM "):]
    assert re.search(rf"^\s*{RING_HASH_ENV}=true\s*$", final_stage, re.M), "the runtime image must set it"
    # and the coordinator's entry point sets it too, before any channel exists
    main = (ROOT / "coordinator" / "__main__.py").read_text()
    assert "os.environ.setdefault(RING_HASH_ENV, \"true\")" in main


@pytest.mark.parametrize("name", RENDERS)
def test_env_vars_are_real_flags(renders, name, flag_envs):
    for comp, dep in deployments(renders[name]).items():
        for var in env_of(container(dep)):
            if var.startswith("SPECDEC_") and var != "SPECDEC_CACHE_DIR":
                assert var.startswith(ENV_PREFIX[comp]), (comp, var)
                assert var in flag_envs, f"{comp}: {var} is not a flag of python -m {TIERS[comp][0]}"


@pytest.mark.parametrize("name", RENDERS)
def test_pod_hardening_volumes_and_resources(renders, name):
    for comp, dep in deployments(renders[name]).items():
        spec = dep["spec"]["template"]["spec"]
        c = container(dep)
        env = env_of(c)
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
        assert spec["automountServiceAccountToken"] is False
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        for v in volumes.values():  # exactly one source per volume (patches that swap sources)
            assert len(set(v) - {"name"}) == 1, v
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert set(mounts) >= {"/models", "/tmp", "/var/cache/specdec"}
        assert mounts["/models"]["readOnly"] is True
        assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
        assert "emptyDir" in volumes[mounts["/var/cache/specdec"]["name"]]
        assert env["SPECDEC_CACHE_DIR"]["value"] == "/var/cache/specdec"
        assert env["HF_HOME"]["value"].startswith("/var/cache/specdec/")
        model_var = "SPECDEC_COORDINATOR_TOKENIZER" if comp == "coordinator" else ENV_PREFIX[comp] + "MODEL"
        assert env[model_var]["value"].startswith("/models/")
        models = volumes[mounts["/models"]["name"]]
        if "hostpath" in name:
            assert models["hostPath"]["path"] == "/models"
        elif "pvc" in name:
            claim = models["persistentVolumeClaim"]
            assert claim["claimName"] in of_kind(renders["models"], "PersistentVolumeClaim") and claim["readOnly"] is True
        else:
            assert set(models) == {"name", "emptyDir"}, "the default convention: each pod's own copy (or download)"
        for init in spec.get("initContainers", []):  # hardened like the service's container
            assert init["securityContext"]["readOnlyRootFilesystem"] is True
            assert init["securityContext"]["allowPrivilegeEscalation"] is False
            assert init["securityContext"]["capabilities"]["drop"] == ["ALL"]
            for r in ("cpu", "memory"):
                assert quantity(init["resources"]["requests"][r]) <= quantity(init["resources"]["limits"][r]), (comp, r)
        # every file path in env lies on a mounted volume
        for var, e in env.items():
            path = e.get("value", "")
            if var.startswith("SPECDEC_") and path.startswith("/etc/"):
                assert any(path.startswith(m + "/") for m in mounts), (comp, var, path)
        # SIGTERM: preStop sleep, then the drain; the kubelet must wait for both
        grace = float(env[ENV_PREFIX[comp] + "GRACE"]["value"])
        pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert spec["terminationGracePeriodSeconds"] > grace + pre_stop
        # resources: requests and limits for CPU and memory, requests <= limits
        res = c["resources"]
        for r in ("cpu", "memory"):
            assert quantity(res["requests"][r]) <= quantity(res["limits"][r]), (comp, r)
        if comp != "coordinator":  # torch threads follow the CPU limit
            ref = env[ENV_PREFIX[comp] + "THREADS"]["valueFrom"]["resourceFieldRef"]
            assert ref["resource"] == "limits.cpu" and ref["containerName"] == c["name"]


def pod_containers(dep: dict) -> list[dict]:
    spec = dep["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def overlay_images(overlay: str) -> dict[str, str]:
    """image name -> the reference the overlay's `images:` makes of it"""
    entries = yaml.safe_load((DEPLOY / overlay / "kustomization.yaml").read_text())["images"]
    return {e["name"]: f"{e.get('newName', e['name'])}:{e['newTag']}" for e in entries}


@pytest.mark.parametrize("name", [n for n in RENDERS if "hostpath" not in n and "pvc" not in n and "hub" not in n])
def test_models_are_copied_into_each_pod(renders, name):
    """The models convention: an init container copies the pod's model from the models image into the pod's
    own emptyDir, which the service mounts read-only at /models; no pod mounts a shared claim, so every
    replica of every tier can run on any node."""
    for comp, dep in deployments(renders[name]).items():
        spec = dep["spec"]["template"]["spec"]
        assert not any("persistentVolumeClaim" in v for v in spec["volumes"]), comp
        (init,) = spec["initContainers"]
        assert init["name"] == "models" and init["image"].split(":")[0].endswith("specdec-models")
        volumes = {v["name"]: v for v in spec["volumes"]}
        (mount,) = init["volumeMounts"]
        assert "emptyDir" in volumes[mount["name"]] and not mount.get("readOnly")
        if comp == "coordinator":  # the tokenizer's files only, never the target's weights
            shell, flag, script = init["command"]
            assert (shell, flag) == ("sh", "-c") and "tokenizer.json" in script and "config.json" in script
            assert f"{mount['mountPath']}/tokenizer/" in script and "cp -R" not in script
            assert not re.search(r"\.(safetensors|gguf|bin)\b", script)
            source = "/models/tokenizer"
        else:
            cp, flag, source, dest = init["command"]
            assert (cp, flag, dest) == ("cp", "-R", mount["mountPath"] + "/") and source.startswith("/models/")
        c = container(dep)
        served = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert served[mount["name"]] == "/models"
        model_var = "SPECDEC_COORDINATOR_TOKENIZER" if comp == "coordinator" else ENV_PREFIX[comp] + "MODEL"
        assert env_value(c, model_var) == source, f"{comp} copies {source} but serves {env_value(c, model_var)}"


@pytest.mark.parametrize("name", ["cpu+tls+hostpath", "cpu+pvc"])
def test_model_components_replace_the_copy(renders, name):
    for comp, dep in deployments(renders[name]).items():
        assert "initContainers" not in dep["spec"]["template"]["spec"], (name, comp)


def test_images_are_named_in_one_place(renders, tmp_path):
    """The base names bare images; each overlay's `images:` is the one place that gives them a registry and a
    tag, and an operator's own `images:` on top reaches every container and init container."""
    base = kustomize(DEPLOY / "base")
    for dep in of_kind(base, "Deployment").values():
        for c in pod_containers(dep):
            assert ":" not in c["image"] and "/" not in c["image"], f"a tag or registry in the base: {c['image']}"
    for name, (overlay, _) in RENDERS.items():
        images = overlay_images(overlay)
        for dep in deployments(renders[name]).values():
            for c in pod_containers(dep):
                assert c["image"] in images.values(), (name, c["name"], c["image"])
    mine = {"specdec": ("registry.example.com/team/specdec", "v9"), "specdec-models": ("registry.example.com/team/models", "m1")}
    for overlay in ("overlays/cpu", "overlays/gpu-hetero"):
        scratch = tmp_path / overlay.replace("/", "-")
        scratch.mkdir()
        (scratch / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [os.path.relpath(DEPLOY / overlay, scratch)],
            "images": [{"name": n, "newName": new, "newTag": tag} for n, (new, tag) in mine.items()]}))
        for dep in deployments(kustomize(scratch)).values():
            spec = dep["spec"]["template"]["spec"]
            assert [c["image"] for c in spec["containers"]] == ["registry.example.com/team/specdec:v9"]
            assert [c["image"] for c in spec["initContainers"]] == ["registry.example.com/team/models:m1"]


@pytest.mark.parametrize("name", RENDERS)
def test_ephemeral_storage(renders, name):
    """Node disk is requested for what the pod writes (the model copy, the GGUF conversion), and the limit
    covers every emptyDir's sizeLimit."""
    for comp, dep in deployments(renders[name]).items():
        res = container(dep)["resources"]
        request, limit = quantity(res["requests"]["ephemeral-storage"]), quantity(res["limits"]["ephemeral-storage"])
        assert 0 < request <= limit, comp
        empty_dirs = [v["emptyDir"] for v in dep["spec"]["template"]["spec"]["volumes"] if "emptyDir" in v]
        assert all("sizeLimit" in e for e in empty_dirs), comp
        assert limit >= sum(quantity(e["sizeLimit"]) for e in empty_dirs), comp
        if comp == "target":  # the default target is a GGUF: its float32 conversion writes up to ~2 GiB
            assert request >= 2 * 2**30


@pytest.mark.parametrize("name", RENDERS)
def test_replicas_spread_over_nodes(renders, name):
    deps = deployments(renders[name])
    for comp, dep in deps.items():
        spread = dep["spec"]["template"]["spec"]["topologySpreadConstraints"]
        keys = {s["topologyKey"]: s for s in spread}
        assert set(keys) == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}, comp
        for s in spread:
            assert s["maxSkew"] == 1 and s["matchLabelKeys"] == ["pod-template-hash"]
            assert selects(s["labelSelector"], dep["spec"]["template"]["metadata"]["labels"]), comp
            others = [d["spec"]["template"]["metadata"]["labels"] for c, d in deps.items() if c != comp]
            assert not any(selects(s["labelSelector"], labels) for labels in others), f"{comp} spreads with other tiers"


@pytest.mark.parametrize("name", RENDERS)
def test_coordinator_readiness_follows_the_tiers(renders, name):
    """Readiness asks for the coordinator's serving status (NOT_SERVING / 503 while no target replica is
    reachable), never just an open port, and notices within seconds; liveness never depends on the tiers."""
    c = container(deployments(renders[name])["coordinator"])
    ready, live = c["readinessProbe"], c["livenessProbe"]
    if "tls" in name:
        assert ready["httpGet"]["path"] == "/health" and ready["httpGet"]["port"] in ("http", 8000)
        assert "grpc" not in live and "httpGet" not in live
    else:
        assert ready["grpc"]["service"] == "specdec.v1.Generation"
        assert live["grpc"].get("service", "") == ""
    assert "tcpSocket" not in ready
    assert ready["periodSeconds"] * ready["failureThreshold"] <= 15


@pytest.mark.parametrize("name", RENDERS)
def test_pdb_hpa_and_network_policy_per_tier(renders, name):
    objs = renders[name]
    deps = deployments(objs)
    pdbs, hpas, policies = of_kind(objs, "PodDisruptionBudget"), of_kind(objs, "HorizontalPodAutoscaler"), of_kind(objs, "NetworkPolicy")
    coord_labels = deps["coordinator"]["spec"]["template"]["metadata"]["labels"]
    for comp, dep in deps.items():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert len([p for p in pdbs.values() if selects(p["spec"]["selector"], labels)]) == 1, comp
        mine = [h for h in hpas.values() if h["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1", "kind": "Deployment", "name": dep["metadata"]["name"]}]
        assert len(mine) == 1, comp
        hpa = mine[0]["spec"]
        assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"] and hpa["metrics"]
        assert "replicas" not in dep["spec"], f"the HPA owns the {comp}'s replica count"
        if comp == "coordinator":
            (metric,) = hpa["metrics"]
            assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
        else:
            # Many replicas per tier (sessions routed by the ring hash), autoscaled on the tier's own load.
            assert hpa["minReplicas"] >= 2 and hpa["minReplicas"] < hpa["maxReplicas"], comp
            (metric,) = hpa["metrics"]
            assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == TIER_LOAD_METRIC, comp
            assert metric["pods"]["target"]["type"] == "AverageValue" and quantity(metric["pods"]["target"]["averageValue"]) > 0
            assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 60, "scale-in moves sessions"
            # one replica at a time through drains and rollouts
            pdb = next(p for p in pdbs.values() if selects(p["spec"]["selector"], labels))
            assert pdb["spec"]["maxUnavailable"] == 1
            rolling = dep["spec"]["strategy"]
            assert rolling["type"] == "RollingUpdate" and rolling["rollingUpdate"]["maxUnavailable"] <= 1, comp
        port = TIERS[comp][1]
        netpols = [n for n in policies.values() if selects(n["spec"]["podSelector"], labels)]
        assert len(netpols) == 1, comp
        rules = netpols[0]["spec"]["ingress"]
        opened = [p["port"] for r in rules for p in r["ports"]]
        assert sorted(opened) == sorted([port] + [p for _, p, _ in EXTRA_PORTS[comp]])
        if comp == "coordinator":
            (rule,) = rules
            assert "from" not in rule, "the public port is open to all"
        else:
            (rule,) = [r for r in rules if port in [p["port"] for p in r["ports"]]]
            assert [p["port"] for p in rule["ports"]] == [port], "the tier's gRPC port has a rule of its own"
            (metrics_rule,) = [r for r in rules if r is not rule]
            assert [p["port"] for p in metrics_rule["ports"]] == [9400] and "from" not in metrics_rule
            (peer,) = rule["from"]
            assert set(peer) == {"podSelector"} and selects(peer["podSelector"], coord_labels), \
                f"only coordinator pods may reach the {comp} tier"
            others = [l for c, d in deps.items() if c != "coordinator"
                      for l in [d["spec"]["template"]["metadata"]["labels"]]]
            assert not any(selects(peer["podSelector"], l) for l in others)


def test_cpu_overlay_uses_no_gpu(renders):
    for comp, dep in deployments(renders["cpu"]).items():
        c = container(dep)
        assert c["image"] == "specdec:cpu"
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
        if comp != "coordinator":
            assert env_value(c, ENV_PREFIX[comp] + "DEVICE") == "cpu"


@pytest.mark.parametrize("name", ["gpu-hetero", "gpu-hetero+tls"])
def test_gpu_hetero_places_tiers_on_different_gpu_kinds(renders, name):
    deps = deployments(renders[name])
    products = {}
    for comp in ("draft", "target"):
        spec = deps[comp]["spec"]["template"]["spec"]
        c = container(deps[comp])
        products[comp] = spec["nodeSelector"]["nvidia.com/gpu.product"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert env_value(c, ENV_PREFIX[comp] + "DEVICE") == "cuda"
        assert any(t["key"] == "nvidia.com/gpu" and t["effect"] == "NoSchedule" for t in spec["tolerations"])
        # no spare GPU to surge into: one replica at a time, never the whole tier
        assert deps[comp]["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
        assert c["image"].endswith(":cuda")
    assert products["draft"] != products["target"]
    assert env_value(container(deps["target"]), "SPECDEC_TARGET_DTYPE") == "bfloat16"
    coord = container(deps["coordinator"])
    assert "nvidia.com/gpu" not in coord["resources"]["limits"]
    assert "nodeSelector" not in deps["coordinator"]["spec"]["template"]["spec"]


def test_tls_component_sets_every_tls_flag(renders):
    deps = deployments(renders["cpu+tls+hostpath"])
    expected = {
        "target": {"TLS_CERT", "TLS_KEY", "TLS_CLIENT_CA"},
        "draft": {"TLS_CERT", "TLS_KEY", "TLS_CLIENT_CA"},
        "coordinator": {"TLS_CERT", "TLS_KEY", "TIER_CA", "TIER_CLIENT_CERT", "TIER_CLIENT_KEY", "AUTH_TOKEN_FILE"},
    }
    for comp, flags in expected.items():
        c = container(deps[comp])
        volumes = {v["name"]: v for v in deps[comp]["spec"]["template"]["spec"]["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        for flag in flags:
            path = env_value(c, ENV_PREFIX[comp] + flag)
            mount = next(m for m in mounts if path.startswith(m + "/"))
            assert "secret" in volumes[mounts[mount]], (comp, flag)


def test_models_dockerfile():
    """The models image the init containers run: the model directories under /models, a `cp`, a non-root user."""
    text = (DEPLOY / "Dockerfile.models").read_text()
    assert re.search(r"^FROM busybox:\S+$", text, re.M)
    assert re.search(r"^COPY \. /models/$", text, re.M)
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root")


def test_dockerfile_matches_the_project():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim|^ARG PYTHON_IMAGE=python:3\.11-slim", text, re.M)
    torch_spec = re.search(r'^ARG TORCH_SPEC="(.+)"$', text, re.M).group(1)
    assert "download.pytorch.org/whl/cpu" in torch_spec
    makefile_pin = re.search(r"^TORCH_PIN \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert torch_spec.endswith(makefile_pin), "the image's torch should be the Makefile's pin"
    dev = re.search(r"^dev = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    tools_pin = re.search(r'"(grpcio-tools[^"]*)"', dev).group(1)
    assert f'ARG GRPC_TOOLS_SPEC="{tools_pin}"' in text, "grpcio-tools in the image != the dev extra's pin"
    assert "python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/specdec/proto/*.proto" in text
    assert "pip install ." in text
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert re.search(r'^ENTRYPOINT \["python", "-m"\]$', text, re.M)
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", text, re.M).group(1).split()}
    assert exposed == {port for _, port, _ in TIERS.values()} | {p for ports in EXTRA_PORTS.values() for _, p, _ in ports}
    for src in re.findall(r"^COPY (?!--from)(\S+)", text, re.M):
        assert (ROOT / src).exists(), f"Dockerfile copies {src}, which does not exist"


# ---- observability: the dashboard, the ServiceMonitor and the scrape config ----

def exported_series() -> set[str]:
    """Every series name the services export (coordinator and tier), from the metric classes themselves."""
    from prometheus_client import CollectorRegistry

    from coordinator.api.admission import Admission, AdmissionConfig
    from coordinator.metrics import CoordinatorMetrics
    from specdec.serving.metrics import LoadSnapshot, TierMetrics

    registries = [CollectorRegistry(), CollectorRegistry()]
    CoordinatorMetrics(registries[0], "m", 4, Admission(AdmissionConfig()), max_model_len=2048)
    TierMetrics(registries[1], "target", "m", load=LoadSnapshot)
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    return {family.name + suffix for r in registries for family in r.collect() for suffix in suffixes[family.type]}


def test_dashboard_queries_only_exported_metrics():
    dashboard = json.loads((OBSERVABILITY / "grafana-dashboard.json").read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "model_name"}
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    exported = exported_series()
    queried = set()
    exprs = [t["expr"] for p in panels if p["type"] != "row" for t in p["targets"]]
    exprs.append(next(v for v in dashboard["templating"]["list"] if v["name"] == "model_name")["definition"])
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
    for expr in exprs:
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
        for name in re.findall(r"\b(vllm:[a-zA-Z0-9_:]+|specdec_[a-zA-Z0-9_]+)", expr):
            assert name in exported, f"the dashboard queries {name}, which no service exports"
            queried.add(name)
    # the metrics are all on the dashboard
    for must in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:spec_decode_num_drafts_total",
                 "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_per_pos_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:kv_cache_usage_perc",
                 "specdec_round_seconds_sum", "specdec_tier_sessions", "specdec_tier_batch_size_bucket",
                 "specdec_tier_queue_depth", "specdec_reprefills_total", "specdec_lookup_fallbacks_total",
                 "specdec_rpc_errors_total"):
        assert must in queried, must


def test_observability_kustomization_renders(renders):
    objs = kustomize(OBSERVABILITY)
    kinds = {o["kind"]: o for o in objs}
    assert set(kinds) == {"ConfigMap", "ServiceMonitor", "PrometheusRule"}
    rules = kinds["PrometheusRule"]
    assert rules["apiVersion"] == "monitoring.coreos.com/v1" and rules["metadata"]["labels"]["release"]
    exported = exported_series()
    for group in rules["spec"]["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in ("critical", "warning") and rule["annotations"]["summary"], rule["alert"]
            for name in re.findall(r"\b(vllm:[a-zA-Z0-9_:]+|specdec_[a-zA-Z0-9_]+)", rule["expr"]):
                assert name in exported, f"{rule['alert']} queries {name}, which no service exports"
    cm = kinds["ConfigMap"]
    for version in SCHEMA_VERSIONS:
        kubernetes_validate.validate(cm, version, strict=True)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["grafana-dashboard.json"]) == json.loads((OBSERVABILITY / "grafana-dashboard.json").read_text())

    sm = kinds["ServiceMonitor"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    for name, objs in renders.items():  # in every overlay, it selects exactly the Services with a metrics port
        if name == "models":
            continue
        services = of_kind(objs, "Service")
        selected = {n for n, svc in services.items() if selects(sm["spec"]["selector"], svc["metadata"]["labels"])}
        with_metrics = {n for n, svc in services.items() if "metrics" in [p["name"] for p in svc["spec"]["ports"]]}
        assert with_metrics and with_metrics <= selected, name
        serving = {c for c, ports in EXTRA_PORTS.items() if "metrics" in [p[0] for p in ports]}
        assert with_metrics == {n for n, svc in services.items() if component(svc) in serving}, name


def test_prometheus_scrape_config():
    config = yaml.safe_load((OBSERVABILITY / "prometheus-scrape.yaml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["kubernetes_sd_configs"] == [{"role": "endpoints"}]
    keeps = {tuple(r["source_labels"]): r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
    assert keeps == {("__meta_kubernetes_service_label_app_kubernetes_io_name",): "specdec",
                     ("__meta_kubernetes_endpoint_port_name",): "metrics"}


def test_prometheus_adapter_serves_the_tier_load_metric():
    """The adapter rule behind the tier autoscalers: it names the metric the HPAs ask for, maps series to
    pods by the labels the scrape configs set, and queries only series the tiers export (with their
    `tier` label, which the coordinators' same-named series lack)."""
    values = yaml.safe_load(ADAPTER_VALUES.read_text())
    assert values["rules"]["default"] is False
    (rule,) = values["rules"]["custom"]
    assert rule["name"]["as"] == TIER_LOAD_METRIC
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    exported = exported_series()
    queried = re.findall(r"\b(vllm:[a-zA-Z0-9_:]+|specdec_[a-zA-Z0-9_]+)", rule["seriesQuery"] + " " + rule["metricsQuery"])
    assert set(queried) == {"vllm:num_requests_running", "vllm:num_requests_waiting"}
    assert set(queried) <= exported
    assert re.match(rule["name"]["matches"], "vllm:num_requests_running")
    assert 'tier!=""' in rule["seriesQuery"] and rule["metricsQuery"].count('tier!=""') == 2
    for placeholder in ("<<.GroupBy>>", "<<.LabelMatchers>>"):
        assert placeholder in rule["metricsQuery"]
    query = rule["metricsQuery"]
    assert query.count("(") == query.count(")") and query.count("{") == query.count("}")
    # the tier series carry `tier` (TierMetrics) and the scrape configs add `pod` and `namespace`
    from prometheus_client import CollectorRegistry

    from specdec.serving.metrics import LoadSnapshot, TierMetrics

    registry = CollectorRegistry()
    TierMetrics(registry, "target", "m", load=LoadSnapshot)
    labels = {s.name: s.labels for family in registry.collect() for s in family.samples}
    assert labels["vllm:num_requests_running"]["tier"] == "target" == labels["vllm:num_requests_waiting"]["tier"]
    scrape = yaml.safe_load((OBSERVABILITY / "prometheus-scrape.yaml").read_text())
    targets = {r.get("target_label") for r in scrape["scrape_configs"][0]["relabel_configs"]}
    assert {"pod", "namespace"} <= targets
