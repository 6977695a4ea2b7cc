"""components/admin-port and components/restart-grace on top of prod: /admin and /metrics on a port of their
own that only the monitoring and operators' namespaces reach, never the client load balancer; nodes held in
their assignment while they restart, within a grace period consistent with the kubelet's."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from keyroute.cli import build_parser
from tests.k8s_render import K8S, Obj, find, of_kind, pod_template, render, resolve_argv
from tests.unit.k8s import test_environment
from tests.unit.k8s.manifests import (
    KUBERNETES_VERSIONS,
    NODE_SHUTDOWN_S,
    cli_options,
    container_env,
    container_port,
    is_custom_resource,
    pods_selected,
    readme_section,
    with_object_store_secret,
)
from tests.unit.k8s.test_isolation import render_with
from tests.unit.k8s.test_network_policies import (
    EXTERNAL,
    MONITORING,
    MONITORING_NAMESPACE,
    OPERATORS_NAMESPACE,
    allowed,
    assert_exactly_what_keyroute_needs,
    component_labels,
)

ADMIN_PORT = 8081
ADMIN_PORT_COMPONENT = K8S / "components" / "admin-port"
RESTART_GRACE_COMPONENT = K8S / "components" / "restart-grace"


@pytest.fixture(scope="module")
def day_two(tmp_path_factory: pytest.TempPathFactory) -> list[Obj]:
    """prod with both components, as prod lists them once the CLI reads their options (or prod itself)."""
    listed = set(yaml.safe_load((K8S / "overlays" / "prod" / "kustomization.yaml").read_text())["components"])
    missing = [c for c in (ADMIN_PORT_COMPONENT, RESTART_GRACE_COMPONENT) if f"../../components/{c.name}" not in listed]
    if not missing:
        return render("prod")
    return render_with(tmp_path_factory.mktemp("day-two"), [K8S / "overlays" / "prod"], missing, "keyroute", True)


def serving_container(objs: list[Obj], kind: str, name: str) -> Obj:
    [c] = pod_template(find(objs, kind, name))["spec"]["containers"]
    return c


SERVING = (("Deployment", "keyroute-router"), ("StatefulSet", "keyroute-node"))
SERVING_BY_NAME = {"router": SERVING[0], "node": SERVING[1]}


def test_the_admin_port_is_a_named_port_and_the_option_that_opens_it(day_two: list[Obj]) -> None:
    for obj in day_two:
        if not is_custom_resource(obj):
            kubernetes_validate.validate(obj, KUBERNETES_VERSIONS[-1], strict=True)
    for kind, name in SERVING:
        c = serving_container(day_two, kind, name)
        assert container_port(c, "admin") == ADMIN_PORT
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["KEYROUTE_ADMIN_PORT"] == str(ADMIN_PORT)
        # The probes stay on the data port, which keeps answering them.
        for probe in ("livenessProbe", "readinessProbe"):
            assert c[probe]["httpGet"]["port"] == "http", (name, probe)
        assert container_port(c, "http") != ADMIN_PORT


def test_the_client_load_balancer_serves_data_only_and_the_admin_service_is_internal(day_two: list[Obj]) -> None:
    router = find(day_two, "Deployment", "keyroute-router")
    [c] = pod_template(router)["spec"]["containers"]
    for svc in of_kind(day_two, "Service"):
        if svc["spec"].get("type") == "LoadBalancer":
            assert [p["targetPort"] for p in svc["spec"]["ports"]] == ["http"], svc["metadata"]["name"]
    admin = find(day_two, "Service", "keyroute-admin")
    assert admin["spec"]["type"] == "ClusterIP"
    assert pods_selected(day_two, admin["spec"]["selector"]) == [router]
    assert [container_port(c, p["targetPort"]) for p in admin["spec"]["ports"]] == [ADMIN_PORT]
    nodes = find(day_two, "Service", "keyroute-nodes")
    assert {p["name"]: p["port"] for p in nodes["spec"]["ports"]} == {"http": 8000, "admin": ADMIN_PORT}


def test_only_monitoring_and_operators_reach_the_admin_port(day_two: list[Obj]) -> None:
    policies = of_kind(day_two, "NetworkPolicy")
    pods = component_labels(day_two)
    scraper = (MONITORING_NAMESPACE, MONITORING)
    operator = (OPERATORS_NAMESPACE, {"app": "kubectl-debug"})
    stranger = ("team-a", {"app": "anything"})
    for who in ("router", "node"):
        data = container_port(serving_container(day_two, *SERVING_BY_NAME[who]), "http")
        assert allowed(policies, scraper, pods[who], ADMIN_PORT), who
        assert allowed(policies, operator, pods[who], ADMIN_PORT), who
        for refused in ((None, EXTERNAL), stranger, pods["pipeline"], pods["router"], pods["node"]):
            assert not allowed(policies, refused, pods[who], ADMIN_PORT), (refused, who)
        # Scrapers use the admin port now, not the data port (nodes' data port stays routers' and nodes').
        if who == "node":
            assert not allowed(policies, scraper, pods[who], data)
    # Clients still read through the routers' data port.
    assert allowed(policies, (None, EXTERNAL), pods["router"], 8080)


def test_with_the_admin_port_the_policies_still_allow_exactly_what_keyroute_needs(day_two: list[Obj]) -> None:
    assert_exactly_what_keyroute_needs(day_two)


def test_pod_monitors_scrape_the_admin_port(day_two: list[Obj]) -> None:
    for monitor in of_kind(day_two, "PodMonitor"):
        [target] = pods_selected(day_two, monitor["spec"]["selector"]["matchLabels"])
        if target["metadata"]["name"] in ("keyroute-router", "keyroute-node"):
            [endpoint] = monitor["spec"]["podMetricsEndpoints"]
            assert endpoint["port"] == "admin"
            [c] = pod_template(target)["spec"]["containers"]
            assert container_port(c, endpoint["port"]) == ADMIN_PORT
    annotations = pod_template(find(day_two, "Deployment", "keyroute-router"))["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ADMIN_PORT)


def test_a_restarting_node_is_held_for_its_way_back(day_two: list[Obj]) -> None:
    sts = find(day_two, "StatefulSet", "keyroute-node")
    spec = pod_template(sts)["spec"]
    [c] = spec["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    grace = float(env["KEYROUTE_RESTART_GRACE_S"])
    startup = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    session = float(env["KEYROUTE_ZK_SESSION_TIMEOUT_S"])
    assert grace >= NODE_SHUTDOWN_S + startup + session, "a node still starting would lose its partitions"
    # A departure (after node-drain) still hands over within the kubelet's grace period.
    drain = float(env["KEYROUTE_DRAIN_TIMEOUT_S"])
    assert spec["terminationGracePeriodSeconds"] >= drain + NODE_SHUTDOWN_S + 10
    # It comes back as itself, to its own files: the pod's name as node id, the data dir on its own claim.
    id_ref = next(e for e in c["env"] if e["name"] == "KEYROUTE_NODE_ID")
    assert id_ref["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    [data_mount] = [m for m in c["volumeMounts"] if m["mountPath"] == env["KEYROUTE_DATA_DIR"]]
    assert data_mount["name"] in {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    assert "KEYROUTE_RESTART_GRACE_S" in readme_section("Restarts")


def _cli_reads(variable: str) -> bool:
    return variable in cli_options(["node"])


@pytest.mark.parametrize(
    ("variable", "component"),
    [("KEYROUTE_ADMIN_PORT", ADMIN_PORT_COMPONENT), ("KEYROUTE_RESTART_GRACE_S", RESTART_GRACE_COMPONENT)],
)
def test_production_lists_the_component_once_the_cli_reads_its_option(variable: str, component: Path) -> None:
    """The components set options the CLI gains elsewhere; once it reads them, prod must use them (and the
    environment checks then hold for prod as rendered)."""
    if not _cli_reads(variable):
        pytest.skip(f"`keyroute node` does not read {variable} in this checkout")
    listed = yaml.safe_load((K8S / "overlays" / "prod" / "kustomization.yaml").read_text())["components"]
    assert f"../../components/{component.name}" in listed, (
        f"the CLI reads {variable}: list ../../components/{component.name} in overlays/prod's components"
    )
    objs = with_object_store_secret(render("prod"))
    test_environment.test_keyroute_env_is_exactly_what_the_cli_reads(objs)
    test_environment.test_the_cli_accepts_each_container_as_written(objs)
    c = serving_container(objs, "StatefulSet", "keyroute-node")
    assert variable in {e["name"] for e in c["env"]}
    env = container_env(objs, c, pod_name="keyroute-node-0")
    args = build_parser(env).parse_args(resolve_argv(c, env)[1:])
    expected = {"KEYROUTE_ADMIN_PORT": ("admin_port", ADMIN_PORT), "KEYROUTE_RESTART_GRACE_S": ("restart_grace_s", 320)}
    attribute, value = expected[variable]
    assert getattr(args, attribute) == value
