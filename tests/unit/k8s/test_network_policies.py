"""Network policies allow exactly the connections keyroute needs."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import yaml

from tests.k8s_render import (
    Obj,
    find,
    of_kind,
    pod_template,
    render,
    workloads,
)
from tests.unit.k8s.manifests import (
    OBJECT_STORAGE,
    PROD_OVERLAYS,
    container_env,
    container_port,
    executor_template_text,
    pipeline_pods,
    spark_confs,
    with_object_store_secret,
)

EXTERNAL = {"external": "true"}  # stands for an address outside the cluster (clients, API server, S3)
KUBE_DNS = {"k8s-app": "kube-dns"}
# Stands for a scraper in the monitoring namespace (components/monitoring admits it by the namespace's name).
MONITORING = {"app.kubernetes.io/name": "prometheus"}
MONITORING_NAMESPACE = "monitoring"
OUTSIDERS = (EXTERNAL, KUBE_DNS, MONITORING)


def component_labels(objs: list[Obj]) -> dict[str, dict[str, str]]:
    """component -> pod labels, for every pod the overlay makes (Spark's executors from their template)."""
    out = {}
    for w in workloads(objs):
        labels = pod_template(w)["metadata"]["labels"]
        out[labels["app.kubernetes.io/component"]] = labels
    executor = yaml.safe_load(executor_template_text(objs))
    out["spark-executor"] = executor["metadata"]["labels"]
    return out


def _peer_matches(peer: Obj, labels: Mapping[str, str], same_namespace: bool) -> bool:
    if "ipBlock" in peer:
        return labels is EXTERNAL
    if "namespaceSelector" in peer:
        ns = peer["namespaceSelector"].get("matchLabels", {}).get("kubernetes.io/metadata.name")
        in_ns = (ns == "kube-system" and labels is KUBE_DNS) or (ns == MONITORING_NAMESPACE and labels is MONITORING)
        return in_ns and label_selector_matches(peer.get("podSelector", {}), labels)
    return same_namespace and label_selector_matches(peer["podSelector"], labels)


def label_selector_matches(selector: Obj, labels: Mapping[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value = labels.get(expr["key"])
        if expr["operator"] == "In" and value not in expr["values"]:
            return False
        if expr["operator"] == "NotIn" and value in expr["values"]:
            return False
        if expr["operator"] == "Exists" and value is None:
            return False
    return True


def _rules_allow(rules: list[Obj], side: str, peer: Mapping[str, str], port: int, protocol: str) -> bool:
    for rule in rules:
        peers = rule.get(side)
        if peers is not None and not any(_peer_matches(p, peer, not any(peer is o for o in OUTSIDERS)) for p in peers):
            continue
        ports = rule.get("ports")
        if ports is None or any(p.get("port") == port and p.get("protocol", "TCP") == protocol for p in ports):
            return True
    return False


def allowed(policies: list[Obj], src: Mapping[str, str], dst: Mapping[str, str], port: int, proto: str = "TCP") -> bool:
    """Would the namespace's NetworkPolicies let `src` open a connection to `dst`:port? (Pods outside the
    namespace are not restricted by these policies.)"""

    def side_allows(pod: Mapping[str, str], kind: str, rules_key: str, peer_key: str, peer: Mapping[str, str]) -> bool:
        if any(pod is o for o in OUTSIDERS):
            return True
        selecting = [
            p
            for p in policies
            if label_selector_matches(p["spec"]["podSelector"], pod) and kind in p["spec"]["policyTypes"]
        ]
        if not selecting:
            return True
        return any(_rules_allow(p["spec"].get(rules_key, []), peer_key, peer, port, proto) for p in selecting)

    return side_allows(src, "Egress", "egress", "to", dst) and side_allows(dst, "Ingress", "ingress", "from", src)


def expected_connections(objs: list[Obj], object_storage: bool) -> set[tuple[str, str, int, str]]:
    """(from, to, port, protocol) of every connection keyroute makes, ports read from the manifests."""
    def port_of(kind: str, name: str, port: str) -> int:
        [c] = pod_template(find(objs, kind, name))["spec"]["containers"]
        return container_port(c, port)

    router = port_of("Deployment", "keyroute-router", "http")
    node = port_of("StatefulSet", "keyroute-node", "http")
    zk = {p: port_of("StatefulSet", "keyroute-zookeeper", p) for p in ("client", "follower", "election")}
    [driver] = pipeline_pods(objs)[:1]
    env = container_env(with_object_store_secret(objs), driver["spec"]["containers"][0], pod_name="keyroute-pipeline-1")
    confs = spark_confs(env["PYSPARK_SUBMIT_ARGS"])
    spark_rpc, blocks = int(confs["spark.driver.port"]), int(confs["spark.blockManager.port"])
    want = {
        ("external", "router", router, "TCP"),
        ("router", "node", node, "TCP"),
        ("node", "node", node, "TCP"),
        ("zookeeper", "zookeeper", zk["follower"], "TCP"),
        ("zookeeper", "zookeeper", zk["election"], "TCP"),
        ("spark-executor", "pipeline", spark_rpc, "TCP"),
        ("spark-executor", "pipeline", blocks, "TCP"),
        ("pipeline", "spark-executor", blocks, "TCP"),
        ("spark-executor", "spark-executor", blocks, "TCP"),
        ("pipeline", "external", 443, "TCP"),  # the Kubernetes API (its Service port)
        ("pipeline", "external", 6443, "TCP"),  # ... and the API server's, after kube-proxy
        ("node", "external", 443, "TCP"),  # the nodes' init container reads its Node's zone from the API
        ("node", "external", 6443, "TCP"),
    }
    want |= {(who, "zookeeper", zk["client"], "TCP") for who in ("router", "node", "pipeline")}
    want |= {(who, "kube-dns", 53, proto) for who in ("router", "node", "zookeeper", "pipeline", "spark-executor")
             for proto in ("UDP", "TCP")}
    if object_storage:
        want |= {(who, "external", 443, "TCP") for who in ("node", "pipeline", "spark-executor")}
    # The monitoring namespace's scrapers (components/monitoring) to each part's metrics port.
    want |= {("monitoring", "router", router, "TCP"), ("monitoring", "node", node, "TCP")}
    want.add(("monitoring", "zookeeper", port_of("StatefulSet", "keyroute-zookeeper", "metrics"), "TCP"))
    return want


@pytest.mark.parametrize("overlay_name", PROD_OVERLAYS)
def test_network_policies_allow_exactly_what_keyroute_needs(overlay_name: str) -> None:
    objs = render(overlay_name)
    policies = of_kind(objs, "NetworkPolicy")
    deny = [p for p in policies if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")
            and not p["spec"].get("egress")]
    assert deny and set(deny[0]["spec"]["policyTypes"]) == {"Ingress", "Egress"}, "no default deny"
    pods: dict[str, Mapping[str, str]] = {
        **component_labels(objs),
        "external": EXTERNAL,
        "kube-dns": KUBE_DNS,
        "monitoring": MONITORING,
    }
    want = expected_connections(objs, object_storage=overlay_name == OBJECT_STORAGE)
    # Every port any pod listens on, every port it connects to, and a few it must not reach.
    ports = {port for _, _, port, _ in want} | {22, 80, 4040, 9092}
    # Traffic among outsiders (and from kube-dns, which answers but never calls) is not these policies' business.
    outside = ("external", "kube-dns", "monitoring")
    got = {
        (src, dst, port, proto)
        for src in pods
        for dst in pods
        for port in ports
        for proto in ("TCP", "UDP")
        if src != "kube-dns" and not (src in outside and dst in outside)
        if allowed(policies, pods[src], pods[dst], port, proto)
    }
    assert got == want, f"allowed but not needed: {sorted(got - want)}; needed but refused: {sorted(want - got)}"


def test_development_has_no_network_policies() -> None:
    # A kind or minikube cluster often enforces none; the rules are prod's (and documented for dev).
    assert of_kind(render("dev"), "NetworkPolicy") == []
