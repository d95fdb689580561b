"""deploy/'s images, checked offline: the Dockerfiles consistent with pyproject.toml and the Makefile
(pins, ports, a non-root user, the ring hash variable), the models image, and image names and tags given
in one place (each overlay's `images:`), which an operator's own `images:` overrides everywhere."""

from __future__ import annotations

import os
import re

import yaml

from specdec.serving.routing import RING_HASH_ENV
from tests.deploy_renders import (DEPLOY, EXTRA_PORTS, RENDERS, ROOT, TIERS, deployments, kustomize, of_kind, overlay_images,
                                  pod_containers)


def test_image_sets_the_ring_hash_variable():
    text = (DEPLOY / "Dockerfile").read_text()
    final_stage = text[text.rindex("\nFROM "):]
    assert re.search(rf"^\s*{RING_HASH_ENV}=true\s*$", final_stage, re.M), "the runtime image must set it"
    # and the coordinator's entry point sets it too, before any channel exists
    main = (ROOT / "coordinator" / "__main__.py").read_text()
    assert "os.environ.setdefault(RING_HASH_ENV, \"true\")" in main


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
