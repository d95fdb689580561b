"""deploy/'s replicas, checked offline on the renders of tests/deploy_renders.py: each tier spread over
nodes and zones, a PodDisruptionBudget, an autoscaler on the right signal and a NetworkPolicy per tier,
and where the overlays place the tiers (no GPU in the cpu overlay, two GPU kinds in gpu-hetero)."""

from __future__ import annotations

import pytest

from tests.deploy_renders import (ENV_PREFIX, EXTRA_PORTS, RENDERS, TIER_LOAD_METRIC, TIERS, container, deployments, env_value,
                                  of_kind, quantity, selects)


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
def test_pdb_hpa_and_network_policy_per_tier(renders, name):
    objs = renders[name]
    deps = deployments(objs)
    pdbs, hpas, policies = of_kind(objs, "PodDisruptionBudget"), of_kind(objs, "HorizontalPodAutoscaler"), of_kind(objs, "NetworkPolicy")
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
            # The coordinator's pods reach each tier; the draft's reach the target too (direct rounds); no one else.
            callers = ["coordinator"] + (["draft"] if comp == "target" else [])
            labels_of = {c: d["spec"]["template"]["metadata"]["labels"] for c, d in deps.items()}
            assert all(set(peer) == {"podSelector"} for peer in rule["from"])
            for c, l in labels_of.items():
                reached = any(selects(peer["podSelector"], l) for peer in rule["from"])
                assert reached == (c in callers), f"{c} pods {'reach' if reached else 'do not reach'} the {comp} tier"
            if comp == "target":  # the draft pods know where to reach it: the target Service, as the coordinator's
                draft = container(deps["draft"])
                assert env_value(draft, "SPECDEC_DRAFT_DIRECT_TARGET") == env_value(container(deps["coordinator"]),
                                                                                     "SPECDEC_COORDINATOR_TARGET")


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
