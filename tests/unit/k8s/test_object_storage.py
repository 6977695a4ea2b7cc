"""The object-storage variant: overlays/object-storage = prod + components/object-storage."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from keyroute.cli import build_parser
from tests.k8s_render import (
    Obj,
    find,
    of_kind,
    pod_template,
    resolve_argv,
    resolve_env,
    workloads,
)
from tests.unit.k8s import test_environment, test_objects, test_pipeline, test_probes
from tests.unit.k8s.manifests import (
    KUBERNETES_VERSIONS,
    OBJECT_STORE_READ_SECRET,
    OBJECT_STORE_SECRET,
    container_env,
    executor_template_text,
    node_pod,
    objs_namespace,
    pipeline_pods,
    readme_section,
    sample_field,
    spark_confs,
    with_object_store_secret,
)

# The variables live stores' Kafka settings name ("${NAME}"): optional, for nodes and the pipeline only.
KAFKA_SECRET = "keyroute-kafka"
OBJECT_STORE_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
SNAPSHOT_STORE_CONFIG = "keyroute-snapshot-store"


def object_store_consumers(objs: list[Obj]) -> list[tuple[str, Obj]]:
    """(where, container) of every container that reads or writes snapshots: nodes, the pipeline's driver
    (CronJob, and a one-off Job if the overlay has one) and the executor pod template."""
    out = [("node", node_pod(objs)["spec"]["containers"][0])]
    out += [(f"pipeline {i}", pod["spec"]["containers"][0]) for i, pod in enumerate(pipeline_pods(objs))]
    executor = yaml.safe_load(executor_template_text(objs))
    out.append(("executor", executor["spec"]["containers"][0]))
    return out


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_object_storage_overlay_renders_and_every_object_is_valid(
    object_storage_objs: list[Obj], version: str
) -> None:
    test_objects.test_every_object_is_valid_for_the_kubernetes_api(object_storage_objs, version)
    template = yaml.safe_load(executor_template_text(object_storage_objs))
    kubernetes_validate.validate(template, version, strict=True)
    # prod's shape (it is prod now): serving in `keyroute`, the pipeline in its own namespace.
    assert objs_namespace(object_storage_objs) == "keyroute"
    test_objects.test_every_namespaced_object_lands_in_the_overlay_namespace(object_storage_objs, "prod")


# The overlay-independent checks of the other modules, run on the object-storage overlay as well (prod's sizes).
GENERIC_CHECKS = {
    "names_unique": test_objects.test_names_are_unique_per_kind,
    "selectors": test_objects.test_workload_selectors_match_their_own_pods,
    "services": test_objects.test_services_select_pods_and_target_ports_they_declare,
    "disruption_budgets": test_objects.test_disruption_budgets_cover_existing_pods,
    "stateful_sets": test_objects.test_stateful_sets_have_their_headless_service,
    "volumes": test_objects.test_volumes_refer_to_existing_claims_and_config_maps,
    "router": lambda objs: test_objects.test_the_router_is_one_load_balancer_address_scaled_by_the_autoscaler(
        objs, "prod"
    ),
    "sizes": lambda objs: test_objects.test_overlay_sizes(objs, "prod"),
    "probes": test_probes.test_http_probes_hit_paths_the_apps_serve,
    "zookeeper_probes": test_probes.test_zookeeper_probes_speak_whitelisted_four_letter_words,
    "keyroute_env": test_environment.test_keyroute_env_is_exactly_what_the_cli_reads,
    "references": test_environment.test_every_reference_resolves_in_kubernetes_order,
    "cli": test_environment.test_the_cli_accepts_each_container_as_written,
    "addresses": test_environment.test_addresses_in_the_environment_name_existing_services,
    "zookeeper_servers": test_environment.test_zookeeper_servers_are_exactly_the_stateful_set_members,
    "grace": test_environment.test_nodes_get_the_time_their_graceful_leave_takes,
    "no_one_off_job": lambda objs: test_pipeline.test_development_runs_the_cronjob_pod_once(objs, "prod"),
    "spark_rbac": test_pipeline.test_spark_may_manage_its_executor_pods,
    "non_root": test_pipeline.test_pods_run_as_non_root,
}


@pytest.mark.parametrize("check", sorted(GENERIC_CHECKS))
def test_object_storage_overlay_passes_the_overlay_checks(object_storage_objs: list[Obj], check: str) -> None:
    # The credentials are read by pyarrow's S3 client (in the node, the pipeline and its executors), not
    # by the keyroute CLI (manifests.OTHER_READERS says so).
    GENERIC_CHECKS[check](with_object_store_secret(object_storage_objs))


def test_object_storage_sources_still_parse_and_are_read_where_executors_read(
    object_storage_objs: list[Obj], tmp_path: Path
) -> None:
    test_pipeline.test_the_spec_parses_and_reads_from_the_shared_volume(
        with_object_store_secret(object_storage_objs), tmp_path
    )


def test_object_storage_snapshots_go_to_an_s3_uri_from_one_config_map(object_storage_objs: list[Obj]) -> None:
    from urllib.parse import urlparse

    from keyroute.storage.snapshot import is_local

    objs = with_object_store_secret(object_storage_objs)
    config = find(objs, "ConfigMap", SNAPSHOT_STORE_CONFIG)  # unsuffixed: the component names it so
    output = config["data"]["output"]
    uri = urlparse(output)
    assert uri.scheme in ("s3", "s3a") and uri.netloc and uri.path.strip("/"), output
    assert not is_local(output)
    pods = pipeline_pods(objs)
    assert pods
    for pod in pods:
        [c] = pod["spec"]["containers"]
        [entry] = [e for e in c["env"] if e["name"] == "KEYROUTE_OUTPUT"]
        assert entry == {
            "name": "KEYROUTE_OUTPUT",
            "valueFrom": {"configMapKeyRef": {"name": SNAPSHOT_STORE_CONFIG, "key": "output"}},
        }
        env = container_env(objs, c, pod_name="keyroute-pipeline-123-abcde")
        assert env["KEYROUTE_OUTPUT"] == output
        args = build_parser(env).parse_args(resolve_argv(c, env)[1:])
        assert args.output == output  # what `keyroute pipeline build` is given
        # Executors still run the driver's image and find their (replaced) template where Spark looks.
        confs = spark_confs(env["PYSPARK_SUBMIT_ARGS"])
        assert confs["spark.kubernetes.container.image"] == c["image"]
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        folder, _, filename = confs["spark.kubernetes.executor.podTemplateFile"].rpartition("/")
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mounts[folder])
        template_text = find(objs, "ConfigMap", volume["configMap"]["name"])["data"][filename]
        assert template_text == executor_template_text(objs)
        assert "keyroute-object-store" in template_text
        # No credential goes through Spark's configuration (it is shown in Spark's UI and logs): a Secret
        # is at most named there, for Spark to mount into executors (its value a path).
        mounts = {key: value for key, value in confs.items() if key.startswith("spark.kubernetes.executor.secrets.")}
        assert all(value.startswith("/") for value in mounts.values()), mounts
        assert not any("AWS" in key.upper() or "secret" in key.lower() for key in confs if key not in mounts)


def test_object_storage_has_no_snapshot_volume(object_storage_objs: list[Obj]) -> None:
    """Nodes mount no shared claim (only their own data volume); what is left of the shared claim holds the
    pipeline's input events and is mounted read-only wherever it is mounted: nothing writes snapshots to a
    shared volume, so no ReadWriteMany volume is needed for them."""
    objs = object_storage_objs
    nodes = node_pod(objs)["spec"]
    assert not [v for v in nodes.get("volumes", []) if "persistentVolumeClaim" in v]
    mounts = {m["mountPath"] for m in nodes["containers"][0]["volumeMounts"]}
    assert "/shared" not in mounts
    templates = find(objs, "StatefulSet", "keyroute-node")["spec"]["volumeClaimTemplates"]
    assert [t["metadata"]["name"] for t in templates] == ["data"]  # the node's own volume, nothing shared
    executor = yaml.safe_load(executor_template_text(objs))["spec"]
    pod_specs = [p["spec"] for p in pipeline_pods(objs)] + [executor]
    for spec in pod_specs:
        claims = {v["name"] for v in spec.get("volumes", []) if "persistentVolumeClaim" in v}
        for c in spec["containers"]:
            for m in c.get("volumeMounts", []):
                if m["name"] in claims:
                    assert m.get("readOnly") is True, f"{c['name']} mounts claim volume {m['name']} writable"
    # The shared claim (if any is left) is mounted by the pipeline and its executors only.
    for pvc in of_kind(objs, "PersistentVolumeClaim"):
        users = [
            w["metadata"]["name"]
            for w in workloads(objs)
            for v in pod_template(w)["spec"].get("volumes", [])
            if v.get("persistentVolumeClaim", {}).get("claimName") == pvc["metadata"]["name"]
        ]
        assert users and set(users) <= {"keyroute-pipeline"}, (pvc["metadata"]["name"], users)


def credentials_volume(spec: Obj, container: Obj) -> tuple[Obj, str]:
    """The Secret volume holding the AWS shared credentials file the container names, and the file's key."""
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    path = env["AWS_SHARED_CREDENTIALS_FILE"]
    [(mount, volume)] = [
        (m, v)
        for m in container["volumeMounts"]
        for v in spec["volumes"]
        if v["name"] == m["name"] and path.startswith(m["mountPath"] + "/")
    ]
    assert mount["readOnly"] is True
    return volume["secret"], path[len(mount["mountPath"]) + 1 :]


def test_object_storage_credentials_come_from_the_secret_as_a_file(object_storage_objs: list[Obj]) -> None:
    objs = object_storage_objs
    assert of_kind(objs, "Secret") == []  # the operator creates it; no credential is in the manifests
    executor_spec = yaml.safe_load(executor_template_text(objs))["spec"]
    specs = {"node": node_pod(objs)["spec"], "executor": executor_spec}
    specs |= {f"pipeline {i}": pod["spec"] for i, pod in enumerate(pipeline_pods(objs))}
    for where, c in object_store_consumers(objs):
        # Nodes only read: their own read-only credentials; the pipeline's driver and executors write and
        # delete: the other Secret. Neither side ever names the other's.
        secret = OBJECT_STORE_READ_SECRET if where == "node" else OBJECT_STORE_SECRET
        other = OBJECT_STORE_SECRET if where == "node" else OBJECT_STORE_READ_SECRET
        # The keys are a file (the AWS SDK's shared credentials file), never environment variables.
        assert not [e for e in c.get("env", []) if e["name"] in OBJECT_STORE_KEYS], where
        source, key = credentials_volume(specs[where], c)
        assert (source["secretName"], key) == (secret, "credentials"), where
        # Optional in prod: each pod's ServiceAccount carries a cloud identity, which the SDK takes instead.
        assert source["optional"] is True, where
        # The settings that are not secret (AWS_REGION, AWS_ENDPOINT_URL) from a ConfigMap when it exists;
        # nodes and the pipeline's driver also read the Kafka secrets of live stores, a mounted folder required
        # as every Secret in production (executors never consume).
        settings = {"configMapRef": {"name": "keyroute-object-store-settings", "optional": True}}
        assert c.get("envFrom") == [settings], where
        assert (kafka_folder(specs[where], c) is not None) == (where != "executor"), where
        assert f"name: {other}\n" not in yaml.safe_dump(c), where
    # Routers never touch snapshots: no credentials there.
    router = pod_template(find(objs, "Deployment", "keyroute-router"))["spec"]
    assert OBJECT_STORE_SECRET not in yaml.safe_dump(router)
    # The file the SDK reads is a shared credentials file of the documented shape.
    documented = readme_section("Snapshots on object storage")
    assert "aws_access_key_id" in documented and "AWS_SHARED_CREDENTIALS_FILE" in documented


def test_the_object_storage_component_also_fits_the_dev_overlay(tmp_path: Path) -> None:
    """dev + the component (what one would run on kind against MinIO): the one-off Job still runs exactly
    the CronJob's pod, now writing to the bucket."""
    from tests.k8s_render import K8S, kubectl

    overlay = tmp_path / "dev-object-storage"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": "keyroute-dev",
                "resources": [os.path.relpath(K8S / "overlays" / "dev", overlay)],
                "components": [os.path.relpath(K8S / "components" / "object-storage", overlay)],
                "configMapGenerator": [
                    {
                        "name": SNAPSHOT_STORE_CONFIG,
                        "options": {"disableNameSuffixHash": True},
                        "literals": ["output=s3://dev-bucket/keyroute"],
                    }
                ],
            }
        )
    )
    done = subprocess.run(
        [str(kubectl()), "kustomize", str(overlay)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    objs = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    for obj in objs:
        kubernetes_validate.validate(obj, KUBERNETES_VERSIONS[-1], strict=True)
    [job] = of_kind(objs, "Job")
    cron = find(objs, "CronJob", "keyroute-pipeline")
    assert job["spec"]["template"] == cron["spec"]["jobTemplate"]["spec"]["template"]
    for pod in pipeline_pods(objs):
        env = container_env(with_object_store_secret(objs), pod["spec"]["containers"][0])
        assert env["KEYROUTE_OUTPUT"] == "s3://dev-bucket/keyroute"
    assert not [v for v in node_pod(objs)["spec"].get("volumes", []) if "persistentVolumeClaim" in v]


def kafka_folder(spec: Obj, c: Obj) -> Obj | None:
    """The Secret volume of the Kafka secrets a container reads as files (KEYROUTE_SECRETS_DIR), None."""
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    for volume in spec.get("volumes", []):
        if volume.get("secret", {}).get("secretName") != KAFKA_SECRET:
            continue
        for mount in c.get("volumeMounts", []):
            if mount["name"] == volume["name"] and env.get("KEYROUTE_SECRETS_DIR") == mount["mountPath"]:
                return dict(volume["secret"])
    return None


def test_kafka_variables_reach_nodes_and_the_pipeline_only(objs: list[Obj], overlay: str) -> None:
    consumers = [("node", node_pod(objs)["spec"], node_pod(objs)["spec"]["containers"][0])]
    for i, pod in enumerate(pipeline_pods(objs)):
        consumers.append((f"pipeline {i}", pod["spec"], pod["spec"]["containers"][0]))
    # Optional environment variables in development; in production a mounted folder (no secret in a process's
    # environment), required like every Secret (empty without live stores).
    optional = overlay == "dev"
    for where, spec, c in consumers:
        if optional:
            assert {"secretRef": {"name": KAFKA_SECRET, "optional": True}} in c.get("envFrom", []), where
        else:
            folder = kafka_folder(spec, c)
            assert folder is not None and folder.get("optional") is False, where
            assert KAFKA_SECRET not in yaml.safe_dump(c.get("envFrom", [])), where
    router = pod_template(find(objs, "Deployment", "keyroute-router"))["spec"]["containers"][0]
    assert KAFKA_SECRET not in yaml.safe_dump(router)
    assert of_kind(objs, "Secret") == []  # the operator creates it; no secret is in the manifests
    node = node_pod(objs)["spec"]["containers"][0]
    if optional:
        # Without any Secret the pods still start (a spec without live stores needs none of it).
        resolve_env(node, lambda p: sample_field(p, "keyroute-node-0"), objs)
    # In production the Secret is a required volume (asserted above): without it the kubelet starts no pod.
