"""deploy/ checked offline on the renders of tests/deploy_renders.py (`kubectl kustomize` of every overlay
and the optional components on top of them): every rendered object is valid against the Kubernetes JSON
schemas (kubernetes-validate, strict: unknown fields fail), probes on the serving ports, Services that
select the right pods, peer addresses that resolve to them, routing by session, and env vars that are
real flags. No cluster, no network. The pods, the replicas, the images and the observability
manifests have files of their own (tests/test_deploy_*.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import kubernetes_validate
import pytest

from specdec.serving.routing import RING_HASH_ENV
from tests.deploy_renders import (ENV_PREFIX, EXTRA_PORTS, GATEWAY_KINDS, RENDERS, ROOT, SCHEMA_VERSIONS, TIERS, container,
                                  deployments, env_of, env_value, of_kind, selects)


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


@pytest.mark.parametrize("name", RENDERS)
def test_env_vars_are_real_flags(renders, name, flag_envs):
    for comp, dep in deployments(renders[name]).items():
        for var in env_of(container(dep)):
            if var.startswith("SPECDEC_") and var != "SPECDEC_CACHE_DIR":
                assert var.startswith(ENV_PREFIX[comp]), (comp, var)
                assert var in flag_envs, f"{comp}: {var} is not a flag of python -m {TIERS[comp][0]}"
