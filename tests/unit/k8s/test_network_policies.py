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
    PIPELINE_NAMESPACE,
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
# Where each outsider is: nowhere in the cluster, kube-system, the monitoring namespace.
OPERATOR = {"app": "kubectl-debug"}  # stands for an operator's pod in a namespace labelled as operators'
OUTSIDERS: dict[str, tuple[str | None, Mapping[str, str]]] = {
    "external": (None, EXTERNAL),
    "kube-dns": ("kube-system", KUBE_DNS),
    "monitoring": (MONITORING_NAMESPACE, MONITORING),
    "operators": ("sre", OPERATOR),
}
# A pod: (its namespace, its labels).
Pod = tuple[str | None, Mapping[str, str]]
# Labels of namespaces beyond the one Kubernetes sets (kubernetes.io/metadata.name): an operators' namespace.
OPERATORS_NAMESPACE = str(OUTSIDERS["operators"][0])
NAMESPACE_LABELS = {OPERATORS_NAMESPACE: {"keyroute.io/operators": "true"}}


def namespace_labels(namespace: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": namespace, **NAMESPACE_LABELS.get(namespace, {})}


def component_labels(objs: list[Obj]) -> dict[str, Pod]:
    """component -> (namespace, pod labels), for every pod the overlay makes (Spark's executors from their
    template, in the driver's namespace, where spark.kubernetes.namespace puts them)."""
    out: dict[str, Pod] = {}
    for w in workloads(objs):
        labels = pod_template(w)["metadata"]["labels"]
        out[labels["app.kubernetes.io/component"]] = (w["metadata"]["namespace"], labels)
    executor = yaml.safe_load(executor_template_text(objs))
    out["spark-executor"] = (out["pipeline"][0], executor["metadata"]["labels"])
    return out


def _peer_matches(peer: Obj, pod: Pod, policy_namespace: str) -> bool:
    namespace, labels = pod
    if "ipBlock" in peer:
        return labels is EXTERNAL
    if "namespaceSelector" in peer:
        selector = peer["namespaceSelector"]
        assert selector, "an empty namespaceSelector admits every namespace"
        return (
            namespace is not None
            and label_selector_matches(selector, namespace_labels(namespace))
            and label_selector_matches(peer.get("podSelector", {}), labels)
        )
    return namespace == policy_namespace and label_selector_matches(peer["podSelector"], labels)


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


def _rules_allow(policy: Obj, rules_key: str, side: str, peer: Pod, port: int, protocol: str) -> bool:
    for rule in policy["spec"].get(rules_key, []):
        peers = rule.get(side)
        if peers is not None and not any(_peer_matches(p, peer, policy["metadata"]["namespace"]) for p in peers):
            continue
        ports = rule.get("ports")
        if ports is None or any(p.get("port") == port and p.get("protocol", "TCP") == protocol for p in ports):
            return True
    return False


def allowed(policies: list[Obj], src: Pod, dst: Pod, port: int, proto: str = "TCP") -> bool:
    """Would the NetworkPolicies let `src` open a connection to `dst`:port? A policy applies to the pods of its
    own namespace; pods outside keyroute's namespaces are not restricted by these policies."""
    outsiders = [o[1] for o in OUTSIDERS.values()]

    def side_allows(pod: Pod, kind: str, rules_key: str, peer_key: str, peer: Pod) -> bool:
        if any(pod[1] is o for o in outsiders):
            return True
        selecting = [
            p
            for p in policies
            if p["metadata"]["namespace"] == pod[0]
            and label_selector_matches(p["spec"]["podSelector"], pod[1])
            and kind in p["spec"]["policyTypes"]
        ]
        if not selecting:
            return True
        return any(_rules_allow(p, rules_key, peer_key, peer, port, proto) for p in selecting)

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
    # components/jwt: routers and nodes fetch the issuer's signing keys over HTTPS.
    if any(p["metadata"]["name"] == "keyroute-jwks" for p in of_kind(objs, "NetworkPolicy")):
        want |= {(who, "external", 443, "TCP") for who in ("router", "node")}
    # prod's ZooKeeper backup: ZooKeeper's client port, then object storage.
    if any(w["metadata"]["name"] == "keyroute-zk-backup" for w in workloads(objs)):
        want |= {("zk-backup", "zookeeper", zk["client"], "TCP"), ("zk-backup", "external", 443, "TCP")}
        want |= {("zk-backup", "kube-dns", 53, proto) for proto in ("UDP", "TCP")}
    # The monitoring namespace's scrapers (components/monitoring) to the port each PodMonitor scrapes (the
    # data port, or `admin` with components/admin-port).
    for monitor in of_kind(objs, "PodMonitor"):
        [target] = [w for w in workloads(objs)
                    if label_selector_matches(monitor["spec"]["selector"], pod_template(w)["metadata"]["labels"])]
        component = pod_template(target)["metadata"]["labels"]["app.kubernetes.io/component"]
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            port = port_of(target["kind"], target["metadata"]["name"], endpoint["port"])
            want.add(("monitoring", component, port, "TCP"))
    # Operators' namespaces (components/admin-port): the admin port of routers and nodes. Like anyone, they
    # and the scrapers reach the routers' data port.
    want |= {("operators", "router", router, "TCP"), ("monitoring", "router", router, "TCP")}
    serving = (("Deployment", "keyroute-router", "router"), ("StatefulSet", "keyroute-node", "node"))
    for kind, name, component in serving:
        [c] = pod_template(find(objs, kind, name))["spec"]["containers"]
        if any(p.get("name") == "admin" for p in c.get("ports", [])):
            want |= {(who, component, container_port(c, "admin"), "TCP") for who in ("monitoring", "operators")}
    return want


@pytest.mark.parametrize("overlay_name", PROD_OVERLAYS)
def test_network_policies_allow_exactly_what_keyroute_needs(overlay_name: str) -> None:
    assert_exactly_what_keyroute_needs(render(overlay_name))


def assert_exactly_what_keyroute_needs(objs: list[Obj]) -> None:
    policies = of_kind(objs, "NetworkPolicy")
    deny = [p for p in policies if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")
            and not p["spec"].get("egress")]
    assert deny and set(deny[0]["spec"]["policyTypes"]) == {"Ingress", "Egress"}, "no default deny"
    # prod runs the pipeline in its own namespace: each namespace has its default deny.
    denied = {p["metadata"]["namespace"] for p in deny}
    assert denied == {"keyroute", PIPELINE_NAMESPACE}, denied
    pods: dict[str, Pod] = {**component_labels(objs), **OUTSIDERS}
    assert pods["pipeline"][0] == pods["spark-executor"][0] == PIPELINE_NAMESPACE
    # Both prod overlays keep snapshots on object storage (prod includes the component).
    want = expected_connections(objs, object_storage=True)
    # Every port any pod listens on, every port it connects to, and a few it must not reach.
    ports = {port for _, _, port, _ in want} | {22, 80, 4040, 9092}
    # Traffic among outsiders (and from kube-dns, which answers but never calls) is not these policies' business.
    outside = tuple(OUTSIDERS)
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


def test_zookeeper_admits_the_pipeline_only_from_its_own_namespace() -> None:
    """The one connection across namespaces: the driver in keyroute-pipeline to ZooKeeper's clients' port. A
    pod that merely carries the driver's labels elsewhere (a namespace anyone may create pods in) is refused,
    and the pipeline's namespace reaches nothing else of the serving one."""
    objs = render("prod")
    policies = of_kind(objs, "NetworkPolicy")
    pods = component_labels(objs)

    def port_of(kind: str, name: str, port: str) -> int:
        [c] = pod_template(find(objs, kind, name))["spec"]["containers"]
        return container_port(c, port)

    zk_port = port_of("StatefulSet", "keyroute-zookeeper", "client")
    driver_ns, driver = pods["pipeline"]
    assert allowed(policies, (driver_ns, driver), pods["zookeeper"], zk_port)
    for elsewhere in ("keyroute", "default", "team-a"):
        assert not allowed(policies, (elsewhere, driver), pods["zookeeper"], zk_port), elsewhere
    targets = {"node": port_of("StatefulSet", "keyroute-node", "http"),
               "router": port_of("Deployment", "keyroute-router", "http")}
    for who in ("pipeline", "spark-executor"):
        for target, port in targets.items():
            assert not allowed(policies, pods[who], pods[target], port), (who, target)
