"""The Grafana dashboards: every query reads series the server exports, with the right kind of function; and
against real data, a real Prometheus scrapes a real `ddtree serve` (the demo model), and every panel query must
evaluate without error and return data once requests have run."""

from __future__ import annotations

import json
import math
import re
import shutil
import time
import urllib.parse
from pathlib import Path
from typing import Any

import httpx
import pytest
from ddtree.api.metrics import ServerMetrics
from k8s_testing import REPO, ddtree_serve_available, free_port, http_get, running

DASHBOARDS = sorted((REPO / "dashboards").glob("*.json"))
# Grafana's variables as a single deployment scraped with the labels our ServiceMonitor/PodMonitor add.
VARIABLES = {"$__rate_interval": "2m", "$namespace": "demo-ns", "$deployment": "demo", "$model_name": ".*"}
# A vector selector (the series name before its label matchers), and whether a counter function takes it.
SELECTOR = re.compile(r"(\b(?:rate|irate|increase)\(\s*)?([A-Za-z_:][\w:]*)\{([^}]*)\}")


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def substitute(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unknown variable in {expr}"
    return expr


def exported_series() -> dict[str, str]:
    """Every series name the server's registry exposes to Prometheus, as `counter` (only rate() makes sense:
    counters and histogram parts) or `gauge`; from the metric families, so series without samples yet count."""
    metrics = ServerMetrics("demo", method="ddtree", budget=32, block_size=16, max_model_len=1024)
    names = {}
    for family in metrics.registry.collect():
        if family.type == "histogram":
            names.update(dict.fromkeys((f"{family.name}_bucket", f"{family.name}_sum", f"{family.name}_count"),
                                       "counter"))
        elif family.type == "counter":
            names[f"{family.name}_total"] = "counter"
        else:
            names[family.name] = "gauge"
    return names


def test_every_query_reads_an_exported_series_the_right_way():
    exported = exported_series()
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for title, expr in panel_queries(dashboard):
            selectors = SELECTOR.findall(expr)
            assert selectors, f"{title}: no series selector (name{{labels}}) in {expr}"
            for rated, name, _ in selectors:
                assert name in exported, f"{path.name}: {title}: {name} is not a series ServerMetrics exports"
                kind = "counter" if rated else "gauge"
                assert exported[name] == kind, f"{path.name}: {title}: {name} is a {exported[name]}, read as a {kind}"
        for var in dashboard["templating"]["list"]:
            if series := re.match(r"label_values\(([A-Za-z_:][\w:]*)", var.get("definition", "")):
                assert series.group(1) in exported, f"{path.name}: variable {var['name']}: {series.group(1)}"
    used = {name for path in DASHBOARDS for _, expr in panel_queries(json.loads(path.read_text()))
            for _, name, _ in SELECTOR.findall(expr)}
    batching = {"vllm:kv_cache_usage_perc", "vllm:num_preemptions_total", "ddtree_batch_size_bucket",
                "ddtree_step_draft_nodes_sum", "ddtree_batch_budget"}
    assert batching <= used, f"no panel for {batching - used}"


def test_dashboards_are_well_formed():
    assert DASHBOARDS, "no dashboards in dashboards/"
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        assert dashboard["uid"] and dashboard["title"]
        names = {v["name"] for v in dashboard["templating"]["list"]}
        assert {"datasource", "namespace", "deployment", "model_name"} <= names  # per-deployment selector
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids))
        for _, expr in panel_queries(dashboard):
            assert 'ddtree_deployment=~"$deployment"' in expr, expr
        deployment = next(v for v in dashboard["templating"]["list"] if v["name"] == "deployment")
        assert deployment["allValue"] == ".+"  # "All" means every DDTreeDeployment, not every server's series
        titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
        for topic in ("acceptance length", "per-position", "tokens/s", "ttft", "tpot", "queue", "phase", "tree size",
                      "kv cache", "preemptions", "batch size", "batch budget"):
            assert topic in titles, topic


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus (apt-get install prometheus)")
@pytest.mark.skipif(not ddtree_serve_available(), reason="`ddtree serve` is not available yet")
def test_every_panel_returns_data_from_a_real_server(tmp_path: Path):
    server_port, prom_port = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "ddtree", "static_configs": [{
            "targets": [f"127.0.0.1:{server_port}"],
            "labels": {"namespace": "demo-ns", "ddtree_deployment": "demo"}}]},
            # The same server seen as another vLLM-style server of the namespace, without our label.
            {"job_name": "other", "static_configs": [{"targets": [f"127.0.0.1:{server_port}"],
                                                      "labels": {"namespace": "demo-ns"}}]}],
    }))
    prom = f"http://127.0.0.1:{prom_port}"
    server = ["ddtree", "serve", "--host", "127.0.0.1", "--port", str(server_port), "--served-model-name", "demo"]
    prometheus = ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                  f"--web.listen-address=127.0.0.1:{prom_port}"]
    with running(server, f"http://127.0.0.1:{server_port}/ready", log=tmp_path / "server.log"), \
            running(prometheus, f"{prom}/-/ready", log=tmp_path / "prometheus.log"):
        def query(expr: str) -> list[dict[str, Any]]:
            status, body = http_get(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
            assert status == 200, body
            return json.loads(body)["data"]["result"]

        def wait_for(expr: str, want: str | None, what: str) -> None:
            """Poll until Prometheus has a sample of `expr` (equal to `want` when given): scrapes can
            time out while the engine is busy, so a fixed sleep is not enough on a loaded machine."""
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                result = query(expr)
                if result and (want is None or result[0]["value"][1] == want):
                    return
                time.sleep(0.5)
            raise AssertionError(f"Prometheus never scraped {what}")

        # A first sample of the (zero) counters, so the rates below have a starting point.
        wait_for("vllm:spec_decode_num_drafts_total", None, "the server before the requests")
        with httpx.Client(base_url=f"http://127.0.0.1:{server_port}/v1", timeout=60) as client:
            for i in range(6):  # spread over several scrapes
                reply = client.post("/chat/completions", json={
                    "model": "demo", "messages": [{"role": "user", "content": f"count to {i + 3}"}], "max_tokens": 24})
                assert reply.status_code == 200, reply.text
                time.sleep(0.7)
        _, text = http_get(f"http://127.0.0.1:{server_port}/metrics")
        final = next(line.split()[-1] for line in text.splitlines() if line.startswith("vllm:generation_tokens_total"))
        wait_for("vllm:generation_tokens_total", str(int(float(final))), "the server after the last request")

        assert query('up{job="ddtree"}')[0]["value"][1] == "1"
        wait_for('up{job="other"}', "1", "the unlabelled copy")
        for path in DASHBOARDS:  # "All" in every selector still leaves the other server out
            variables = {v["name"]: v["allValue"] for v in json.loads(path.read_text())["templating"]["list"]
                         if "allValue" in v}
            namespace, deployment = variables["namespace"], variables["deployment"]
            series = query(f'vllm:num_requests_running{{namespace=~"{namespace}", ddtree_deployment=~"{deployment}"}}')
            assert [r["metric"]["job"] for r in series] == ["ddtree"]
        empty = []
        for path in DASHBOARDS:
            dashboard = json.loads(path.read_text())
            for title, expr in panel_queries(dashboard):
                values = [float(r["value"][1]) for r in query(substitute(expr))]
                if not any(math.isfinite(v) for v in values):
                    empty.append(f"{path.name}: {title}: {expr}")
            for var in dashboard["templating"]["list"]:
                match = re.fullmatch(r"label_values\((?:(.+), )?(\w+)\)", var.get("definition", ""))
                if match:
                    selector, label = substitute(match.group(1) or ""), match.group(2)
                    status, body = http_get(f"{prom}/api/v1/label/{label}/values?" +
                                            urllib.parse.urlencode({"match[]": selector}))
                    assert status == 200 and json.loads(body)["data"], f"variable {var['name']}: {body}"
        assert not empty, "panels without data:\n" + "\n".join(empty)
