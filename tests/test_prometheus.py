"""A real Prometheus (Debian's `prometheus`, installed by `make prometheus` if missing) scrapes a real local
cluster (coordinator and both tiers' /metrics on loopback, every second, labelled with `namespace` and
`pod` as deploy/observability's scrape configs label them), while generations run that move every
panel: concurrent streams through the OpenAI API on tight tier KV budgets (evictions, re-prefills), a
request for an unknown model (a public API error), then the draft tier stopped (prompt-lookup fallback,
tier call errors), then the target tier stopped (a request refused with 503). Then EVERY PromQL
expression of the Grafana dashboard, the prometheus-adapter rule behind the tier autoscalers and the
alert rules (loaded into this Prometheus) is evaluated through Prometheus' HTTP API, and each must return
data: at least one series with a finite value (for an alert: the side it measures; the tier-down alerts'
conditions must hold after their tier stopped and not before)."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from specdec.serving.ports import free_port
from specdec.engine.sessions import SessionStoreConfig
from specdec.serving.metrics import serve_metrics
from tests.helpers import Cluster

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parent.parent
OBSERVABILITY = ROOT / "deploy" / "observability"
RULES = OBSERVABILITY / "prometheus-rules.yaml"
SCRAPE_S = 1  # scrape interval, seconds
RATE_INTERVAL = "5s"  # Grafana's $__rate_interval for a 1 s scrape: max(4 x scrape, step + scrape)
NAMESPACE = "specdec-test"
PODS = {"coordinator": "specdec-coordinator-0", "target": "specdec-target-0", "draft": "specdec-draft-0"}


def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:  # a fresh machine: the Makefile's rule installs Debian's package
        run = subprocess.run(["make", "-s", "prometheus"], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, f"`make prometheus` failed:\n{run.stdout}\n{run.stderr}"
        path = shutil.which("prometheus")
    assert path, "prometheus is not installed (make prometheus)"
    return path


class Prometheus:
    """A Prometheus server on loopback scraping `targets` (component -> host:port) every SCRAPE_S."""

    def __init__(self, targets: dict[str, str], workdir: Path) -> None:
        rules = yaml.safe_load(RULES.read_text())["spec"]  # the PrometheusRule's spec is a plain rules file
        (workdir / "rules.yml").write_text(yaml.safe_dump(rules))
        check = subprocess.run([str(Path(prometheus_binary()).with_name("promtool")), "check", "rules",
                                str(workdir / "rules.yml")], capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, f"promtool check rules:\n{check.stdout}{check.stderr}"
        config = {
            "rule_files": [str(workdir / "rules.yml")],
            "global": {"scrape_interval": f"{SCRAPE_S}s", "scrape_timeout": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
            "scrape_configs": [{
                "job_name": "specdec", "metrics_path": "/metrics", "honor_labels": True,  # as deploy/observability
                "static_configs": [{"targets": [address], "labels": {"namespace": NAMESPACE, "pod": PODS[name],
                                                                     "service": f"specdec-{name}"}}
                                   for name, address in targets.items()],
            }],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [prometheus_binary(), f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(self.url + "/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, (workdir / "prometheus.log").read_text()
            time.sleep(0.1)

    def wait_up(self, n: int, timeout_s: float = 30) -> None:
        """Until `n` targets are scraped successfully (Prometheus hands discovered targets over every 5 s)."""
        deadline = time.monotonic() + timeout_s
        while True:
            targets = self.api("targets")["activeTargets"]
            if len(targets) == n and all(t["health"] == "up" for t in targets):
                return
            assert time.monotonic() < deadline, f"targets not up: {targets}"
            time.sleep(0.2)

    def api(self, path: str, **params) -> dict:
        r = httpx.get(self.url + "/api/v1/" + path, params=params, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def finite(result: list[dict]) -> bool:
    """Some point of some series (instant vector or matrix) is a finite number."""
    values = [v for series in result for v in ([series["value"]] if "value" in series else series["values"])]
    return any(math.isfinite(float(v[1])) for v in values)


def dashboard_exprs(dashboard: dict) -> list[tuple[str, str]]:
    return [(f"{p['title']} / {t.get('legendFormat', t.get('refId'))}", t["expr"])
            for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]


@pytest.fixture(scope="module")
def scraped(tiny_target, tmp_path_factory):
    """(prometheus, served model name, start time) after the traffic, once Prometheus has scraped its end."""
    # Room for about one session's tokens per tier: concurrent sessions evict each other between rounds,
    # so their next rounds re-prefill (FAILED_PRECONDITION, then the committed tokens resent).
    cluster = Cluster(tiny_target, tiny_target, sessions=SessionStoreConfig(max_cached_tokens=48))
    servers = []
    prometheus = None
    try:
        for name in ("target", "draft"):
            servers.append(serve_metrics(cluster.tier_registries[f"{name.capitalize()}Config"], "127.0.0.1:0"))
        urls = {"coordinator": cluster.metrics_url, "target": servers[0].url, "draft": servers[1].url}
        prometheus = Prometheus({n: u.removeprefix("http://").removesuffix("/metrics") for n, u in urls.items()},
                                tmp_path_factory.mktemp("prometheus"))
        start = time.time()
        model = cluster.coordinator.frontend.model_name
        oai = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def stream(i: int) -> str:  # half of them at a fixed K, which drafts whatever the policy would choose
            chunks = oai.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Tell me story number {i}"}], max_tokens=24,
                stream=True, extra_body={"ignore_eos": True, **({"num_speculative_tokens": 2} if i % 2 else {})})
            return [c.choices[0].finish_reason for c in chunks if c.choices][-1]

        prometheus.wait_up(len(urls))
        time.sleep(SCRAPE_S)  # a scrape before the traffic: rates start from a sample
        with ThreadPoolExecutor(3) as pool:
            assert list(pool.map(stream, range(6))) == ["length"] * 6
        with pytest.raises(openai.NotFoundError):  # a public API error
            oai.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
        time.sleep(2 * SCRAPE_S)
        all_up = time.time()  # every tier up until here
        cluster.stop_draft()  # the draft tier gone: prompt lookup drafts, the coordinator counts its errors
        r = oai.completions.create(model=model, prompt="one two three one two three one two", max_tokens=12,
                                   extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length"
        cluster.stop_target()  # the target gone too: the coordinator refuses requests with 503
        deadline = time.monotonic() + 10
        while cluster.coordinator.pipeline.target_reachability.reachable:
            assert time.monotonic() < deadline, "the coordinator did not notice the target's absence"
            time.sleep(0.05)
        with pytest.raises(openai.APIStatusError) as refused:
            oai.completions.create(model=model, prompt="Hi", max_tokens=2)
        assert refused.value.status_code == 503
        oai.close()
        # Prometheus has scraped the end of the traffic once it holds every finished request
        deadline = time.monotonic() + 10
        while True:
            done = prometheus.api("query", query="sum(vllm:e2e_request_latency_seconds_count)")["result"]
            if done and float(done[0]["value"][1]) == 7:
                break
            assert time.monotonic() < deadline, f"Prometheus did not see the 7 requests: {done}"
            time.sleep(0.2)
        # a few more scrapes: the series born during the traffic (labelled counters) get the two samples a
        # rate needs
        time.sleep(3 * SCRAPE_S)
        yield prometheus, model, start, all_up
    finally:
        if prometheus is not None:
            prometheus.close()
        for s in servers:
            s.close()
        cluster.close()


def test_every_scrape_target_is_up(scraped):
    prometheus, *_ = scraped
    targets = prometheus.api("targets")["activeTargets"]
    assert sorted(t["labels"]["pod"] for t in targets) == sorted(PODS.values())
    assert all(t["health"] == "up" for t in targets), [(t["scrapeUrl"], t["lastError"]) for t in targets]


def test_every_dashboard_expression_returns_data(scraped):
    prometheus, model, start, _ = scraped
    dashboard = json.loads((OBSERVABILITY / "grafana-dashboard.json").read_text())
    # The model_name variable: Grafana's label_values(metric, label) is the label's values on that metric.
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "model_name"]
    metric, label = re.fullmatch(r"label_values\((\S+), (\w+)\)", variable["definition"]).groups()
    assert model in prometheus.api(f"label/{label}/values", **{"match[]": metric})
    end = time.time()
    empty = []
    exprs = dashboard_exprs(dashboard)
    assert len(exprs) >= 25
    for where, expr in exprs:
        query = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$model_name", re.escape(model))
        assert "$" not in query, f"{where}: a Grafana variable left: {query}"
        result = prometheus.api("query_range", query=query, start=start, end=end, step=SCRAPE_S)["result"]
        if not finite(result):
            empty.append(f"{where}: {query}")
    assert not empty, "dashboard expressions without data:\n" + "\n".join(empty)


def test_prometheus_adapter_rule_returns_the_tier_load(scraped):
    """The rule behind the tier autoscalers, as prometheus-adapter runs it: its series query finds the tiers'
    series (by pod), and its metrics query, with the adapter's templates filled in for the tier pods,
    gives one value per tier pod."""
    prometheus, *_ = scraped
    values = yaml.safe_load((OBSERVABILITY / "prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    series = prometheus.api("series", **{"match[]": rule["seriesQuery"]})
    assert {s["pod"] for s in series} == {PODS["target"], PODS["draft"]}
    assert all(s["namespace"] == NAMESPACE for s in series)
    pods = "|".join(PODS[t] for t in ("target", "draft"))
    query = (rule["metricsQuery"].replace("<<.LabelMatchers>>", f'namespace="{NAMESPACE}",pod=~"{pods}"')
             .replace("<<.GroupBy>>", "pod"))
    assert "<<" not in query
    result = prometheus.api("query", query=query)["result"]
    assert {r["metric"]["pod"] for r in result} == {PODS["target"], PODS["draft"]} and finite(result)


def test_alert_rules_evaluate_and_measure(scraped):
    """Every rule evaluates without error in Prometheus; each alert's measured side (its expression without
    the final threshold) returns data; the reachability alerts' conditions hold now (both tiers stopped) and
    did not while every tier was up."""
    prometheus, _, _, all_up = scraped
    groups = prometheus.api("rules")["groups"]
    loaded = {r["name"]: r for g in groups for r in g["rules"]}
    expected = {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["spec"]["groups"] for r in g["rules"]}
    assert set(loaded) == set(expected)
    for name, rule in loaded.items():
        assert rule["health"] == "ok" and rule["lastEvaluation"] != "0001-01-01T00:00:00Z", (name, rule.get("lastError"))
    empty = []
    for name, rule in expected.items():
        measured, op, threshold = re.fullmatch(r"(.+?)\s*(==|!=|>=|<=|>|<)\s*([0-9.]+)", " ".join(rule["expr"].split())).groups()
        if not finite(prometheus.api("query", query=measured)["result"]):
            empty.append(f"{name}: {measured}")
    assert not empty, "alert expressions without data:\n" + "\n".join(empty)
    for name in ("SpecdecNoTargetReachable", "SpecdecDraftUnreachable"):
        expr = expected[name]["expr"]
        assert prometheus.api("query", query=expr)["result"], f"{name}: its tier is down, the condition must hold"
        assert not prometheus.api("query", query=expr, time=all_up)["result"], f"{name} held while every tier was up"
