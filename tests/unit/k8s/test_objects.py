"""Every object is valid for the Kubernetes API, refers to objects that exist and selects the pods
it means."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from tests.k8s_render import (
    Obj,
    find,
    of_kind,
    pod_template,
    selects,
    workloads,
)
from tests.unit.k8s.manifests import (
    KUBERNETES_VERSIONS,
    NAMESPACED_EXEMPT,
    OPERATOR_CONFIG_MAPS,
    PIPELINE_NAMESPACE,
    ZONE_LABEL,
    container_port,
    executor_template_text,
    is_custom_resource,
    namespaces,
    objs_namespace,
    pods_selected,
)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_is_valid_for_the_kubernetes_api(objs: list[Obj], version: str) -> None:
    assert len(objs) >= 15
    for obj in objs:
        if is_custom_resource(obj):
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{obj['kind']} {obj['metadata']['name']} is not valid for Kubernetes {version}: {exc}"
            )


def test_the_spark_executor_pod_template_is_a_valid_pod(objs: list[Obj]) -> None:
    template = yaml.safe_load(executor_template_text(objs))
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(template, version, strict=True)


# What prod puts in the pipeline's own namespace: its driver and everything the driver alone uses
# (generated ConfigMaps by their name before the hash suffix), and the NetworkPolicies of that namespace.
PIPELINE_OBJECTS = {
    ("ServiceAccount", "keyroute-spark"),
    ("Role", "keyroute-spark"),
    ("RoleBinding", "keyroute-spark"),
    ("CronJob", "keyroute-pipeline"),
    ("ConfigMap", "keyroute-stores"),
    ("ConfigMap", "keyroute-spark-executor"),
    ("ConfigMap", "keyroute-snapshot-store"),
    ("PersistentVolumeClaim", "keyroute-shared"),
    ("NetworkPolicy", "keyroute-pipeline-default-deny"),
    ("NetworkPolicy", "keyroute-pipeline-dns"),
    ("NetworkPolicy", "keyroute-pipeline"),
    ("NetworkPolicy", "keyroute-spark-executor"),
    ("NetworkPolicy", "keyroute-pipeline-object-storage"),
}


def unhashed(obj: Obj) -> str:
    name = str(obj["metadata"]["name"])
    if obj["kind"] == "ConfigMap" and name.rpartition("-")[0] in ("keyroute-stores", "keyroute-spark-executor"):
        return name.rpartition("-")[0]
    return name


def test_every_namespaced_object_lands_in_the_overlay_namespace(objs: list[Obj], overlay: str) -> None:
    """dev: one namespace. prod: the serving namespace, and the pipeline in its own (PIPELINE_OBJECTS)."""
    namespace = objs_namespace(objs)
    assert namespace == {"dev": "keyroute-dev", "prod": "keyroute"}[overlay]
    pipeline_namespace = {"dev": namespace, "prod": PIPELINE_NAMESPACE}[overlay]
    assert namespaces(objs) == {namespace, pipeline_namespace}
    placed = set()
    for obj in objs:
        if obj["kind"] not in NAMESPACED_EXEMPT:
            key = (obj["kind"], unhashed(obj))
            want = pipeline_namespace if key in PIPELINE_OBJECTS else namespace
            assert obj["metadata"].get("namespace") == want, key
            if key in PIPELINE_OBJECTS:
                placed.add(key)
    if overlay == "prod":
        assert placed == PIPELINE_OBJECTS
    for binding in of_kind(objs, "RoleBinding"):
        assert all(s.get("namespace") == binding["metadata"]["namespace"] for s in binding["subjects"])
    # The nodes' ClusterRoleBinding names their ServiceAccount where it is.
    for binding in of_kind(objs, "ClusterRoleBinding"):
        for subject in binding["subjects"]:
            account = find(objs, "ServiceAccount", subject["name"])
            assert subject["namespace"] == account["metadata"]["namespace"] == namespace


def test_names_are_unique_per_kind(objs: list[Obj]) -> None:
    seen = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(seen) == len(set(seen))


def test_workload_selectors_match_their_own_pods(objs: list[Obj]) -> None:
    for w in workloads(objs):
        if w["kind"] in ("Job", "CronJob"):
            continue  # Kubernetes generates their selectors
        labels = pod_template(w)["metadata"]["labels"]
        assert selects(w["spec"]["selector"]["matchLabels"], labels), w["metadata"]["name"]
        # ...and only their own: no two workloads' pods answer to one selector.
        assert pods_selected(objs, w["spec"]["selector"]["matchLabels"]) == [w]


def test_services_select_pods_and_target_ports_they_declare(objs: list[Obj]) -> None:
    for svc in of_kind(objs, "Service"):
        selected = pods_selected(objs, svc["spec"]["selector"])
        assert len(selected) == 1, f"Service {svc['metadata']['name']} selects {len(selected)} workloads"
        containers = pod_template(selected[0])["spec"]["containers"]
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            numbers = {
                container_port(c, target)
                for c in containers
                if any(target in (p.get("name"), p["containerPort"]) for p in c.get("ports", []))
            }
            assert len(numbers) == 1, f"Service {svc['metadata']['name']} port {port['name']} -> {target!r}"


def test_disruption_budgets_cover_existing_pods(objs: list[Obj]) -> None:
    budgets = {pdb["metadata"]["name"]: pdb for pdb in of_kind(objs, "PodDisruptionBudget")}
    assert set(budgets) == {"keyroute-zookeeper", "keyroute-node", "keyroute-router"}
    for name, pdb in budgets.items():
        assert [
            w["metadata"]["name"] for w in pods_selected(objs, pdb["spec"]["selector"]["matchLabels"])
        ] == [name]
        # maxUnavailable (not minAvailable) never blocks a drain of a 1-replica development workload.
        assert pdb["spec"]["maxUnavailable"] == 1


def test_stateful_sets_have_their_headless_service(objs: list[Obj]) -> None:
    for sts in of_kind(objs, "StatefulSet"):
        svc = find(objs, "Service", sts["spec"]["serviceName"])
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["publishNotReadyAddresses"] is True  # names resolve before readiness
        assert pods_selected(objs, svc["spec"]["selector"]) == [sts]
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        claims = {t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates", [])}
        mounts = {
            m["name"] for c in pod_template(sts)["spec"]["containers"] for m in c.get("volumeMounts", [])
        }
        assert claims and claims <= mounts


def test_volumes_refer_to_existing_claims_and_config_maps(objs: list[Obj]) -> None:
    for w in workloads(objs):
        spec = pod_template(w)["spec"]
        declared = {v["name"] for v in spec.get("volumes", [])}
        declared |= {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        for c in spec["containers"]:
            assert {m["name"] for m in c.get("volumeMounts", [])} <= declared, c["name"]
        for v in spec.get("volumes", []):
            if "persistentVolumeClaim" in v:
                find(objs, "PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"])
            if "configMap" in v and v["configMap"]["name"] not in OPERATOR_CONFIG_MAPS:
                find(objs, "ConfigMap", v["configMap"]["name"])
        if "serviceAccountName" in spec:
            find(objs, "ServiceAccount", spec["serviceAccountName"])


def test_the_router_is_one_load_balancer_address_scaled_by_the_autoscaler(
    objs: list[Obj], overlay: str
) -> None:
    router = find(objs, "Deployment", "keyroute-router")
    lbs = [s for s in of_kind(objs, "Service") if s["spec"].get("type") == "LoadBalancer"]
    assert [s["metadata"]["name"] for s in lbs] == ["keyroute-router"]
    assert pods_selected(objs, lbs[0]["spec"]["selector"]) == [router]
    [hpa] = of_kind(objs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "keyroute-router",
    }
    # The autoscaler owns the count: a Deployment `replicas` would be reset by every `kubectl apply`.
    assert "replicas" not in router["spec"]
    assert hpa["spec"]["minReplicas"] == {"dev": 1, "prod": 3}[overlay]
    assert hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    container = pod_template(router)["spec"]["containers"][0]
    assert "cpu" in container["resources"]["requests"]  # utilization is relative to the request
    assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pause < pod_template(router)["spec"]["terminationGracePeriodSeconds"]


def test_overlay_sizes(objs: list[Obj], overlay: str) -> None:
    zk = find(objs, "StatefulSet", "keyroute-zookeeper")
    nodes = find(objs, "StatefulSet", "keyroute-node")
    if overlay == "dev":
        assert (zk["spec"]["replicas"], nodes["spec"]["replicas"]) == (1, 2)
    else:
        assert zk["spec"]["replicas"] == 3 and nodes["spec"]["replicas"] >= 3
        affinity = pod_template(nodes)["spec"]["affinity"]["podAntiAffinity"]
        required = affinity["requiredDuringSchedulingIgnoredDuringExecution"]
        assert [t["topologyKey"] for t in required] == ["kubernetes.io/hostname"]
        spread = pod_template(nodes)["spec"]["topologySpreadConstraints"]
        assert [t["topologyKey"] for t in spread] == [ZONE_LABEL, "kubernetes.io/hostname"]
    for w in workloads(objs):
        for c in pod_template(w)["spec"]["containers"]:
            assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"], c["name"]
