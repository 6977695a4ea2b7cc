"""components/monitoring, as prod renders it: PodMonitors that scrape pods and ports that exist, ZooKeeper's
metrics provider, alerts that Prometheus accepts and docs/operations.md describes, a dashboard that
parses, and every metric they name one that routers and nodes export."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from keyroute.router.metrics import RouterMetrics
from keyroute.state_node.metrics import NodeMetrics
from tests.k8s_render import ROOT, Obj, find, of_kind, pod_template, render
from tests.unit.k8s.manifests import PROD_OVERLAYS, container_port, is_custom_resource, pods_selected
from tests.unit.node.fakes import FakeOwnership, Held
from tests.unit.node.fakes import build as build_node_map
from tests.unit.router.fakes import build_map, store_record

OPERATIONS = ROOT / "docs" / "operations.md"
# The zone metrics routers export (router/metrics.py): named by the alerts whether or not this checkout's
# renderer has them yet.
ZONE_METRICS = {"keyroute_router_partitions_sharing_zone", "keyroute_router_nodes_without_zone"}
# Metrics the alerts name that other changes are adding to routers and nodes (none at present).
PENDING_METRICS: set[str] = set()
PROMTOOL_TESTS = Path(__file__).with_name("alerts.promtool.yaml")
METRIC = re.compile(r"\bkeyroute_[a-z0-9_]+\b")


@pytest.fixture(scope="module")
def prod() -> list[Obj]:
    return render("prod")


def rule_groups(objs: list[Obj]) -> list[dict[str, Any]]:
    [rule] = of_kind(objs, "PrometheusRule")
    return list(rule["spec"]["groups"])


def dashboard(objs: list[Obj]) -> dict[str, Any]:
    config_map = find(objs, "ConfigMap", "keyroute-dashboard")
    [text] = config_map["data"].values()
    return dict(json.loads(text))


def dashboard_queries(board: dict[str, Any]) -> list[str]:
    queries = [t["expr"] for panel in board["panels"] for t in panel["targets"]]
    queries += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return queries


def exported_names(text: str) -> set[str]:
    """Every series name a scrape of this exposition can hold (a family's, even with no sample yet)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "summary": ("_count", "_sum")}
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
    return names


class _Ownership(FakeOwnership):
    """A node's ownership as the metrics read it: one partition served, no live partitions."""

    def serving_view(self) -> dict[str, dict[int, int]]:
        return {"s": {0: 1}}

    def live_partitions(self) -> list[Any]:
        return []


def keyroute_exports() -> set[str]:
    """Series names of the real renderers of a router and a node, each having answered reads."""
    router = RouterMetrics()
    router.map_installed(build_map([store_record("s", 4)], {"a": {"s": [0, 1, 2, 3]}}))
    router.count("s", "key", 200)
    router.observe_request("s", 200, 0.001)
    node = NodeMetrics()
    node.watch(_Ownership(build_node_map({"n1": {"s": {0: 1}}}), {("s", 0): Held(1, {})}))  # type: ignore[arg-type]
    node.count("s", "key", 200)
    node.observe_request("s", 200, 0.001)
    return exported_names(router.render()) | exported_names(node.render().decode()) | ZONE_METRICS | PENDING_METRICS


@pytest.mark.parametrize("overlay_name", PROD_OVERLAYS)
def test_production_has_the_monitoring_objects(overlay_name: str) -> None:
    objs = render(overlay_name)
    monitors = {m["metadata"]["name"]: m for m in of_kind(objs, "PodMonitor")}
    assert set(monitors) == {"keyroute-router", "keyroute-node", "keyroute-zookeeper"}
    for name, monitor in monitors.items():
        # Each selects its part's pods, on a port their container has, at the path it serves.
        [workload] = pods_selected(objs, monitor["spec"]["selector"]["matchLabels"])
        assert workload["metadata"]["name"] == name
        [container] = pod_template(workload)["spec"]["containers"]
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            container_port(container, endpoint["port"])
            assert endpoint["path"] == "/metrics"
    assert len(of_kind(objs, "PrometheusRule")) == 1
    assert dashboard(objs)["panels"]
    assert find(objs, "ConfigMap", "keyroute-dashboard")["metadata"]["labels"]["grafana_dashboard"] == "1"
    policies = {p["metadata"]["name"] for p in of_kind(objs, "NetworkPolicy")}
    assert {"keyroute-monitoring-router", "keyroute-monitoring-node", "keyroute-monitoring-zookeeper"} <= policies
    # (What the policies let through is tests/unit/k8s/test_network_policies.py's business.)


def test_development_has_no_custom_resources() -> None:
    # A kind or minikube cluster rarely has the Prometheus Operator's CRDs: applying dev must not need them.
    assert [o["kind"] for o in render("dev") if is_custom_resource(o)] == []


def test_zookeeper_serves_prometheus_metrics_on_its_metrics_port(prod: list[Obj]) -> None:
    [container] = pod_template(find(prod, "StatefulSet", "keyroute-zookeeper"))["spec"]["containers"]
    env = {e["name"]: e.get("value", "") for e in container["env"]}
    # The image's entrypoint appends each space-separated entry of ZOO_CFG_EXTRA to zoo.cfg.
    config = dict(entry.split("=", 1) for entry in env["ZOO_CFG_EXTRA"].split())
    assert config["metricsProvider.className"] == ("org.apache.zookeeper.metrics.prometheus.PrometheusMetricsProvider")
    assert int(config["metricsProvider.httpPort"]) == container_port(container, "metrics") == 7000
    assert config["quorumListenOnAllIPs"] == "true"


def test_prometheus_accepts_the_alert_rules(prod: list[Obj], tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": rule_groups(prod)}))
    done = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def alert_rules(objs: list[Obj]) -> list[dict[str, Any]]:
    """The alerting rules (the groups also hold recording rules, `record:`)."""
    return [rule for group in rule_groups(objs) for rule in group["rules"] if "alert" in rule]


def test_every_alert_has_a_severity_a_summary_and_a_unique_name(prod: list[Obj]) -> None:
    alerts = alert_rules(prod)
    names = [rule["alert"] for rule in alerts]
    assert len(names) == len(set(names))
    for rule in alerts:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_the_alerts_are_the_ones_the_operations_guide_describes(prod: list[Obj]) -> None:
    alerts = {rule["alert"] for rule in alert_rules(prod)}
    section = OPERATIONS.read_text().split("### Alerts", 1)[1].split("\n## ", 1)[0]
    described = set(re.findall(r"^\| `(Keyroute\w+)` \|", section, re.MULTILINE))
    assert described == alerts, (
        f"not described: {sorted(alerts - described)}; no such rule: {sorted(described - alerts)}"
    )


def test_every_alert_has_a_promtool_case_that_fires_it_and_one_that_does_not(prod: list[Obj]) -> None:
    cases = yaml.safe_load(PROMTOOL_TESTS.read_text())["tests"]
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in cases:
        for check in case["alert_rule_test"]:
            (fires if check["exp_alerts"] else quiet).add(check["alertname"])
    alerts = {rule["alert"] for rule in alert_rules(prod)}
    assert fires == alerts, f"never fired: {sorted(alerts - fires)}; no such alert: {sorted(fires - alerts)}"
    assert quiet == alerts, f"never shown quiet: {sorted(alerts - quiet)}; no such alert: {sorted(quiet - alerts)}"


def test_the_alerts_fire_exactly_as_their_promtool_tests_say(prod: list[Obj], tmp_path: Path) -> None:
    """Whole outages (absent targets, every member down), burn rates over both windows, and each other alert,
    on the series of tests/unit/k8s/alerts.promtool.yaml."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    groups = rule_groups(prod)
    for group in groups:
        for rule in group["rules"]:
            rule.pop("annotations", None)  # promtool compares them too; their text is checked apart
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    cases = yaml.safe_load(PROMTOOL_TESTS.read_text())
    cases["rule_files"] = ["rules.yaml"]
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(cases))
    done = subprocess.run(
        [promtool, "test", "rules", "tests.yaml"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_metric_the_alerts_and_the_dashboard_name_is_exported(prod: list[Obj]) -> None:
    exported = keyroute_exports()
    expressions = [rule["expr"] for group in rule_groups(prod) for rule in group["rules"]]
    named = {name for text in [*expressions, *dashboard_queries(dashboard(prod))] for name in METRIC.findall(text)}
    # The recording rules' own series (keyroute:...) are not exports: the regex leaves them out.
    assert not [n for n in named if ":" in n]
    assert named, "no keyroute metric named at all"
    assert named <= exported, f"not exported by routers or nodes: {sorted(named - exported)}"
    # And the new families are among the exports: request durations and version age.
    assert {
        "keyroute_router_request_duration_seconds_bucket",
        "keyroute_node_request_duration_seconds_bucket",
        "keyroute_store_version_age_seconds",
    } <= named


def test_the_dashboard_shows_what_an_operator_watches(prod: list[Obj]) -> None:
    board = dashboard(prod)
    queries = "\n".join(dashboard_queries(board))
    for needed in (
        "rate(keyroute_router_requests_total",  # reads/s
        "histogram_quantile(0.5, sum by (store, le) (rate(keyroute_router_request_duration_seconds_bucket",
        "histogram_quantile(0.99, sum by (store, le) (rate(keyroute_router_request_duration_seconds_bucket",
        'code_class!="2xx"',  # errors by code
        "sum by (store) (keyroute_node_partition_serving",  # served
        "count by (store) (keyroute_node_partition_serving",  # assigned
        "keyroute_node_live_lag_seconds",
        "keyroute_store_version_age_seconds",
        "keyroute_router_map_stale_seconds",
    ):
        assert needed in queries, needed
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "namespace"}
