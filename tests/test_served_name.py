"""The served model name: derived from the model (no path), the one id of the OpenAI API (/v1/models, the
responses' `model`, the only name a request may ask for) and every metric's model_name label, on the
coordinator and on the tiers. The --served-model-name override is checked through `specdec serve`
(tests/test_serve.py)."""

from __future__ import annotations

import httpx
import openai
import pytest

from specdec.models import served_model_name
from specdec.serving.metrics import serve_metrics
from tests.test_metrics import scrape

pytestmark = pytest.mark.real_pair


@pytest.mark.parametrize("path, name", [
    ("../shared/models/smollm2-135m-instruct", "smollm2-135m-instruct"),  # the default target: a directory with a GGUF
    ("/models/smollm2-135m-instruct/", "smollm2-135m-instruct"),
    ("/models/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1"),
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1"),
    ("./models/draft", "draft"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),  # a hub id, as vLLM names it
    ("gpt2", "gpt2"),
])
def test_served_model_name_from_the_model(path, name):
    assert served_model_name(path) == name


@pytest.fixture(scope="module")
def cluster(self_draft_cluster):
    return self_draft_cluster


def test_api_serves_the_derived_name(cluster, tiny_target):
    name = served_model_name(tiny_target)
    assert name == "target" and cluster.coordinator.frontend.model_name == name
    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as oai:
        assert [m.id for m in oai.models.list().data] == [name]
        r = oai.completions.create(model=name, prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True})
        assert r.model == name and r.usage.completion_tokens == 3
        with pytest.raises(openai.NotFoundError) as e:
            oai.chat.completions.create(model=tiny_target, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    err = e.value.body
    assert e.value.status_code == 404 and err["code"] == "model_not_found" and err["param"] == "model"
    assert err["type"] == "not_found_error" and f"`{name}`" in err["message"]
    # the raw body is OpenAI's error envelope
    raw = httpx.post(cluster.http_url + "/v1/completions", json={"model": "smollm2", "prompt": "Hi"}, timeout=30)
    assert raw.status_code == 404 and set(raw.json()) == {"error"}
    assert set(raw.json()["error"]) == {"message", "type", "param", "code"}


def test_metrics_label_the_served_name(cluster, tiny_target):
    name = served_model_name(tiny_target)
    samples = scrape(cluster.metrics_url)
    for tier in ("target", "draft"):
        server = serve_metrics(cluster.tier_registries[f"{tier.capitalize()}Config"], "127.0.0.1:0")
        try:
            samples += scrape(server.url)
        finally:
            server.close()
    labelled = {l["model_name"] for _, l, _ in samples if "model_name" in l}
    assert labelled == {name}, labelled  # draft = target here: one name, never a path
    tiers = {l.get("tier") for _, l, _ in samples if "model_name" in l}
    assert {"target", "draft"} <= tiers
