"""deploy/observability checked offline: the Grafana dashboard, the alert rules and the prometheus-adapter
rule query only series the services export, the ServiceMonitor selects every Service with a metrics
port in every overlay, and the scrape config keeps the project's metrics endpoints."""

from __future__ import annotations

import json
import re

import kubernetes_validate
import yaml

from tests.deploy_renders import (ADAPTER_VALUES, EXTRA_PORTS, OBSERVABILITY, SCHEMA_VERSIONS, TIER_LOAD_METRIC, component,
                                  kustomize, of_kind, selects)


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
