"""The vLLM series a dashboard expects beyond the speculative-decoding ones, scraped over HTTP after known
generations: each request's phases (queue, prefill, decode, inference) and token counts on vLLM's names
and buckets (vllm/v1/metrics/loggers.py), the tiers' per-step token histogram and cache info, process
metrics on every service, and /metrics on the OpenAI API's own port."""

from __future__ import annotations

import httpx
import openai
import pytest

from specdec.serving.metrics import serve_metrics
from tests.test_metrics import scrape, value

pytestmark = pytest.mark.servers  # the services in this process on real ports (make test-fast leaves them out)

# vLLM's request_latency_buckets and build_1_2_5_buckets(1024) (the tiny models' context), copied from
# vllm/v1/metrics/loggers.py: ours must be the same.
VLLM_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                        480.0, 960.0, 1920.0, 7680.0]
VLLM_TOKEN_BUCKETS_1024 = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
VLLM_ITERATION_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


@pytest.fixture(scope="module")
def cluster(self_draft_cluster):
    return self_draft_cluster


def les(samples, name: str) -> list[float]:
    return sorted({float(l["le"]) for n, l, _ in samples if n == name and l["le"] != "+Inf"})


def tier_scrape(cluster, tier: str) -> list:
    server = serve_metrics(cluster.tier_registries[f"{tier.capitalize()}Config"], "127.0.0.1:0")
    try:
        return scrape(server.url)
    finally:
        server.close()


def test_request_phase_and_token_histograms(cluster):
    model = cluster.coordinator.frontend.model_name
    before = scrape(cluster.http_url + "/metrics")
    tiers_before = {t: cluster.status(t) for t in ("target", "draft")}
    usages = []
    # the draft model asked for K = 2, so both tiers step whatever the policy would pick (K = 0 on a fast step)
    extra = {"ignore_eos": True, "proposer": "draft", "num_speculative_tokens": 2}
    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as oai:
        for max_tokens, stream in ((7, False), (12, True)):
            if stream:
                chunks = list(oai.completions.create(model=model, prompt="Once upon a time", max_tokens=max_tokens,
                                                     stream=True, stream_options={"include_usage": True},
                                                     extra_body=extra))
                usages.append(chunks[-1].usage)
            else:
                usages.append(oai.completions.create(model=model, prompt="Hello there", max_tokens=max_tokens,
                                                     extra_body=extra).usage)
    after = scrape(cluster.http_url + "/metrics")

    def delta(name, **labels):
        return value(after, name, model_name=model, **labels) - value(before, name, model_name=model, **labels)

    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"vllm:request_{phase}_time_seconds_count") == 2, phase
        assert les(after, f"vllm:request_{phase}_time_seconds_bucket") == VLLM_LATENCY_BUCKETS
    inference = delta("vllm:request_inference_time_seconds_sum")
    assert inference > 0
    assert inference == pytest.approx(delta("vllm:request_prefill_time_seconds_sum") + delta("vllm:request_decode_time_seconds_sum"))
    assert delta("vllm:request_queue_time_seconds_sum") < inference  # no admission limits here: little queueing
    assert delta("vllm:request_prompt_tokens_sum") == sum(u.prompt_tokens for u in usages)
    assert delta("vllm:request_generation_tokens_sum") == sum(u.completion_tokens for u in usages) == 19
    assert delta("vllm:request_params_max_tokens_sum") == 19 and delta("vllm:request_params_max_tokens_count") == 2
    for name in ("vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_params_max_tokens"):
        assert les(after, name + "_bucket") == VLLM_TOKEN_BUCKETS_1024, name

    # the tiers: one observation per engine step, its tokens; equal to what the engines count
    for tier, status_before in tiers_before.items():
        samples, status = tier_scrape(cluster, tier), cluster.status(tier)
        labels = {"model_name": model, "tier": tier}
        assert value(samples, "vllm:iteration_tokens_total_count", **labels) == status.steps
        assert value(samples, "vllm:iteration_tokens_total_sum", **labels) == status.step_tokens
        assert status.steps > status_before.steps
        assert les(samples, "vllm:iteration_tokens_total_bucket") == VLLM_ITERATION_BUCKETS
        (info,) = [l for n, l, v in samples if n == "vllm:cache_config_info" and v == 1]
        assert info["engine"] == "0" and info["cache_dtype"] == "float32"
        assert int(info["kv_capacity_bytes"]) == status.kv_capacity_bytes > 0
        assert int(info["kv_capacity_tokens"]) == status.kv_capacity_tokens
        assert int(info["block_size"]) * int(info["num_gpu_blocks"]) == status.kv_capacity_tokens


def test_metrics_on_the_api_port_and_process_metrics_everywhere(cluster):
    api = httpx.get(cluster.http_url + "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"},
                    timeout=10)
    assert api.status_code == 200 and api.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "vllm:e2e_request_latency_seconds_count{" in api.text  # the colon kept (text format)
    on_api = {n for n, _, _ in scrape(cluster.http_url + "/metrics")}
    assert on_api == {n for n, _, _ in scrape(cluster.metrics_url)}  # the same registry as the metrics port
    for samples in (scrape(cluster.metrics_url), tier_scrape(cluster, "target"), tier_scrape(cluster, "draft")):
        assert value(samples, "process_resident_memory_bytes") > 50 * 2**20
        assert value(samples, "process_cpu_seconds_total") > 0
        assert value(samples, "process_open_fds") > 0
