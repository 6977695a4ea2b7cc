"""Production keeps the pipeline away from what serves (its own namespace, a batch pool of hosts, its own
cloud identity and object-store keys), keeps snapshots on object storage, and the opt-in variants (a shared
ReadWriteMany volume, AWS's Network Load Balancer) render as documented."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.k8s_render import (
    K8S,
    Obj,
    find,
    kubectl,
    of_kind,
    pod_template,
    render,
    workloads,
)
from tests.unit.k8s.manifests import (
    KUBERNETES_VERSIONS,
    OBJECT_STORE_READ_SECRET,
    OBJECT_STORE_SECRET,
    PIPELINE_NAMESPACE,
    README,
    executor_template_text,
    is_custom_resource,
    node_pod,
    objs_namespace,
    pipeline_pods,
    readme_section,
)
from tests.unit.k8s.test_production import secret_references

BATCH_POOL = {"keyroute.io/pool": "batch"}
BATCH_TOLERATION = {"key": "keyroute.io/pool", "operator": "Equal", "value": "batch", "effect": "NoSchedule"}
IDENTITY_ANNOTATIONS = ("eks.amazonaws.com/role-arn", "iam.gke.io/gcp-service-account")
PLACEHOLDER_CLASS = "set-me-rwx-storage-class"


@pytest.fixture(scope="module")
def prod() -> list[Obj]:
    return render("prod")


def render_with(
    tmp_path: Path, resources: list[Path], components: list[Path], namespace: str | None, unset_only: bool = False
) -> list[Obj]:
    """A throwaway overlay of the given bases and components, rendered by real kustomize; `namespace` for
    what has none (`unset_only`, as prod sets it) or for everything."""
    folder = tmp_path / "overlay"
    folder.mkdir()
    kustomization: Obj = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(r, folder) for r in resources],
        "components": [os.path.relpath(c, folder) for c in components],
    }
    if namespace and unset_only:
        kustomization["transformers"] = [
            yaml.safe_dump(
                {
                    "apiVersion": "builtin",
                    "kind": "NamespaceTransformer",
                    "metadata": {"name": "serving-namespace", "namespace": namespace},
                    "unsetOnly": True,
                }
            )
        ]
    elif namespace:
        kustomization["namespace"] = namespace
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    done = subprocess.run(
        [str(kubectl()), "kustomize", str(folder)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def test_production_runs_the_pipeline_on_the_batch_pool_and_nothing_serving_there(prod: list[Obj]) -> None:
    executor = yaml.safe_load(executor_template_text(prod))["spec"]
    for where, spec in [("executor template", executor), *[("driver", p["spec"]) for p in pipeline_pods(prod)]]:
        assert spec["nodeSelector"] == BATCH_POOL, where
        assert spec["tolerations"] == [BATCH_TOLERATION], where
    # The serving pods neither select nor tolerate the pool: its taint keeps them off it.
    for w in workloads(prod):
        if w["kind"] in ("StatefulSet", "Deployment"):
            spec = pod_template(w)["spec"]
            assert "keyroute.io/pool" not in yaml.safe_dump(spec), w["metadata"]["name"]
    # The pool's labels and taint are documented where the operator reads how to make the pool.
    section = readme_section("The pipeline's namespace and pool")
    assert "kubectl label node NODE keyroute.io/pool=batch" in section
    assert "kubectl taint node NODE keyroute.io/pool=batch:NoSchedule" in section


def test_development_runs_the_pipeline_anywhere() -> None:
    """A kind or minikube cluster has no batch pool: dev's pipeline pods would stay Pending."""
    objs = render("dev")
    executor = yaml.safe_load(executor_template_text(objs))["spec"]
    for spec in [executor, *[p["spec"] for p in pipeline_pods(objs)]]:
        assert "nodeSelector" not in spec and "tolerations" not in spec


def test_the_production_executor_template_is_the_component_s_on_the_pool(prod: list[Obj]) -> None:
    """prod replaces the object-storage component's template to add the pool: nothing else may drift."""
    component = yaml.safe_load((K8S / "components" / "object-storage" / "spark-executor-pod.yaml").read_text())
    ours = yaml.safe_load(executor_template_text(prod))
    for key in ("nodeSelector", "tolerations", "serviceAccountName"):
        ours["spec"].pop(key)
    # ...and the static keys optional: keyroute-spark carries the pipeline's cloud identity in prod.
    [keys] = [
        v["secret"] for v in ours["spec"]["volumes"] if v.get("secret", {}).get("secretName") == OBJECT_STORE_SECRET
    ]
    assert keys.pop("optional") is True
    keys["optional"] = False
    assert ours == component
    assert yaml.safe_load(executor_template_text(prod))["spec"]["serviceAccountName"] == "keyroute-spark"
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(yaml.safe_load(executor_template_text(prod)), version, strict=True)


def test_service_accounts_carry_cloud_identity_placeholders(prod: list[Obj]) -> None:
    for name in ("keyroute-spark", "keyroute-node"):
        account = find(prod, "ServiceAccount", name)
        annotations = account["metadata"].get("annotations", {})
        assert set(IDENTITY_ANNOTATIONS) <= set(annotations), name
        assert re.fullmatch(r"arn:aws:iam::\d{12}:role/[\w+=,.@-]+", annotations["eks.amazonaws.com/role-arn"])
        assert annotations["iam.gke.io/gcp-service-account"].endswith(".iam.gserviceaccount.com")
    # Two identities, not one: the nodes' role is not the pipeline's.
    roles = {
        find(prod, "ServiceAccount", n)["metadata"]["annotations"]["eks.amazonaws.com/role-arn"]
        for n in ("keyroute-spark", "keyroute-node")
    }
    assert len(roles) == 2
    # Documented, with the static keys as the fallback.
    section = readme_section("Snapshots on object storage")
    assert all(a in section for a in IDENTITY_ANNOTATIONS) and "fallback" in section


def test_nodes_hold_read_only_object_store_keys_and_the_pipeline_the_others(prod: list[Obj]) -> None:
    node_secrets = {name for name, _ in secret_references(node_pod(prod)["spec"])}
    assert OBJECT_STORE_READ_SECRET in node_secrets and OBJECT_STORE_SECRET not in node_secrets
    executor = yaml.safe_load(executor_template_text(prod))["spec"]
    for spec in [executor, *[p["spec"] for p in pipeline_pods(prod)]]:
        names = {name for name, _ in secret_references(spec)}
        assert OBJECT_STORE_SECRET in names and OBJECT_STORE_READ_SECRET not in names
    # The README says what each may do on the bucket.
    section = readme_section("Snapshots on object storage")
    [pipeline_row] = [line for line in section.splitlines() if line.startswith("| pipeline")]
    [node_row] = [line for line in section.splitlines() if line.startswith("| nodes")]
    assert "s3:DeleteObject" in pipeline_row and "s3:PutObject" in pipeline_row
    assert "s3:GetObject" in node_row and "Put" not in node_row and "Delete" not in node_row


def test_the_readme_creates_each_secret_where_its_readers_run(prod: list[Obj]) -> None:
    """A pod reads Secrets of its own namespace: every (namespace, Secret) prod's pods name is created there."""
    needed = set()
    for w in workloads(prod):
        for name, _ in secret_references(pod_template(w)["spec"]):
            needed.add((w["metadata"]["namespace"], name))
    executor_namespace = find(prod, "CronJob", "keyroute-pipeline")["metadata"]["namespace"]
    for name, _ in secret_references(yaml.safe_load(executor_template_text(prod))["spec"]):
        needed.add((executor_namespace, name))
    created = set(re.findall(r"kubectl -n ([a-z0-9-]+) create secret generic ([a-z0-9-]+)", README.read_text()))
    # ...or issued there by cert-manager (components/cert-manager).
    created |= {(c["metadata"]["namespace"], c["spec"]["secretName"]) for c in of_kind(prod, "Certificate")}
    assert needed <= created, f"not created where read: {sorted(needed - created)}"
    assert {ns for ns, _ in needed} == {objs_namespace(prod), PIPELINE_NAMESPACE}


def test_production_keeps_snapshots_on_object_storage(prod: list[Obj]) -> None:
    """The object-storage component is prod's default; overlays/object-storage renders exactly prod."""
    for pod in pipeline_pods(prod):
        [c] = pod["spec"]["containers"]
        [entry] = [e for e in c["env"] if e["name"] == "KEYROUTE_OUTPUT"]
        assert entry["valueFrom"]["configMapKeyRef"]["name"] == "keyroute-snapshot-store"
    assert find(prod, "ConfigMap", "keyroute-snapshot-store")["data"]["output"].startswith("s3://")
    assert not [v for v in node_pod(prod)["spec"].get("volumes", []) if "persistentVolumeClaim" in v]
    assert render("object-storage") == prod


def test_no_production_claim_without_a_storage_class(prod: list[Obj]) -> None:
    """A claim of no class waits for a default class, which is usually ReadWriteOnce only: Pending forever."""
    claims = of_kind(prod, "PersistentVolumeClaim")
    assert claims
    for claim in claims:
        assert claim["spec"].get("storageClassName"), claim["metadata"]["name"]
    assert PLACEHOLDER_CLASS in readme_section("Snapshots on object storage")


def test_the_shared_volume_component_is_read_write_many_of_an_explicit_class(tmp_path: Path) -> None:
    """Opt-in: base (one namespace, as dev) + components/shared-volume; nodes read the pipeline's claim."""
    objs = render_with(tmp_path, [K8S / "overlays" / "dev"], [K8S / "components" / "shared-volume"], None)
    for obj in objs:
        kubernetes_validate.validate(obj, KUBERNETES_VERSIONS[-1], strict=True)
    claim = find(objs, "PersistentVolumeClaim", "keyroute-shared")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["storageClassName"] == PLACEHOLDER_CLASS
    assert {
        v["persistentVolumeClaim"]["claimName"]
        for v in node_pod(objs)["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    } == {"keyroute-shared"}
    assert PLACEHOLDER_CLASS in readme_section("Snapshots on a shared volume")
    assert "components/shared-volume" in readme_section("Snapshots on a shared volume")


def test_the_aws_variant_hands_the_client_address_to_the_load_balancer_controller() -> None:
    objs = render("aws")
    svc = find(objs, "Service", "keyroute-router")
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["spec"]["loadBalancerClass"] == "service.k8s.aws/nlb"
    annotations = svc["metadata"]["annotations"]
    assert annotations["service.beta.kubernetes.io/aws-load-balancer-type"] == "external"
    assert annotations["service.beta.kubernetes.io/aws-load-balancer-scheme"] == "internal"
    assert annotations["service.beta.kubernetes.io/aws-load-balancer-nlb-target-type"] == "ip"
    for obj in objs:
        if not is_custom_resource(obj):
            kubernetes_validate.validate(obj, KUBERNETES_VERSIONS[-1], strict=True)
    # Otherwise exactly prod; and prod itself names no class (other clouds would ignore the Service).
    prod = render("prod")
    assert "loadBalancerClass" not in find(prod, "Service", "keyroute-router")["spec"]
    assert [o for o in objs if o["kind"] != "Service"] == [o for o in prod if o["kind"] != "Service"]
    assert "service.k8s.aws/nlb" in readme_section("The client address in prod")
