"""deploy/'s pods, checked offline on the renders of tests/deploy_renders.py: hardened containers,
volumes for every path they write or read, requests and limits (node disk included), the models each pod
copies into its own volume (or a component's shared one), and the TLS component's secrets."""

from __future__ import annotations

import re

import pytest

from tests.deploy_renders import ENV_PREFIX, RENDERS, container, deployments, env_of, env_value, of_kind, quantity


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


def test_tls_component_sets_every_tls_flag(renders):
    deps = deployments(renders["cpu+tls+hostpath"])
    expected = {
        "target": {"TLS_CERT", "TLS_KEY", "TLS_CLIENT_CA"},
        "draft": {"TLS_CERT", "TLS_KEY", "TLS_CLIENT_CA", "DIRECT_TARGET_CA", "DIRECT_TARGET_CLIENT_CERT",
                  "DIRECT_TARGET_CLIENT_KEY"},
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
