"""The pipeline's pods: Spark in client mode on Kubernetes, its spec, volumes and permissions."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.k8s_render import (
    Obj,
    find,
    of_kind,
    pod_template,
    workloads,
)
from tests.unit.k8s.manifests import (
    KEYROUTE_IMAGES,
    PIPELINE_NAMESPACE,
    container_env,
    container_port,
    dockerfile_copy_target,
    dockerfile_entrypoint,
    dockerfile_user,
    executor_template_text,
    image_name,
    objs_namespace,
    pipeline_pods,
    spark_confs,
    subcommand,
)


def test_the_pipeline_runs_spark_in_client_mode_on_kubernetes(objs: list[Obj], overlay: str) -> None:
    cron = find(objs, "CronJob", "keyroute-pipeline")
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    assert cron["spec"].get("suspend", False) is (overlay == "dev")
    template = yaml.safe_load(executor_template_text(objs))
    for pod in pipeline_pods(objs):
        [c] = pod["spec"]["containers"]
        assert subcommand(c) == ["pipeline", "build"]
        env = container_env(
            objs, c, pod_name="keyroute-pipeline-123-abcde", namespace=cron["metadata"]["namespace"]
        )
        assert env["KEYROUTE_MASTER"] == "k8s://https://kubernetes.default.svc"
        confs = spark_confs(env["PYSPARK_SUBMIT_ARGS"])
        assert confs["spark.kubernetes.container.image"] == c["image"]  # executors run the driver's image
        assert confs["spark.kubernetes.driver.pod.name"] == "keyroute-pipeline-123-abcde"
        # Executors go where the driver runs (prod: the pipeline's own namespace).
        assert confs["spark.kubernetes.namespace"] == cron["metadata"]["namespace"]
        assert cron["metadata"]["namespace"] == {"dev": objs_namespace(objs), "prod": PIPELINE_NAMESPACE}[overlay]
        assert confs["spark.driver.host"] == "10.0.0.7"
        assert "spark.submit.deployMode" not in confs  # client mode: this pod is the driver
        for port in ("spark.driver.port", "spark.blockManager.port"):
            assert container_port(c, int(confs[port]))
        # The executor pod template is mounted where Spark is told to find it, and names its container.
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        folder, _, filename = confs["spark.kubernetes.executor.podTemplateFile"].rpartition("/")
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mounts[folder])
        assert find(objs, "ConfigMap", volume["configMap"]["name"])["data"][
            filename
        ] == executor_template_text(objs)
        assert (
            confs["spark.kubernetes.executor.podTemplateContainerName"]
            == template["spec"]["containers"][0]["name"]
        )
        # Executors start the launcher the image installs (Spark adds `executor` as the argument), under
        # the image's PID 1.
        *init, launcher = template["spec"]["containers"][0]["command"]
        assert launcher == Path(dockerfile_copy_target()).name
        assert init == dockerfile_entrypoint("pipeline")[:-1]
        # Driver, executors and nodes see the snapshot root on one claim at one path: a snapshot path
        # published by the pipeline is a path every node can open. (prod keeps snapshots on object storage:
        # an s3:// root, whose readers test_object_storage.py checks.)
        output = env["KEYROUTE_OUTPUT"]
        if overlay == "prod":
            assert output.startswith("s3://"), output
            assert pod["spec"]["serviceAccountName"] == "keyroute-spark"
            continue
        assert claim_at(pod["spec"], c, output) == claim_at(
            template["spec"], template["spec"]["containers"][0], output
        )
        nodes = pod_template(find(objs, "StatefulSet", "keyroute-node"))["spec"]
        assert claim_at(pod["spec"], c, output) == claim_at(nodes, nodes["containers"][0], output)
        assert pod["spec"]["serviceAccountName"] == "keyroute-spark"


def claim_at(pod_spec: Obj, container: Obj, path: str) -> tuple[str, str]:
    """(claim name, mount path) of the persistent volume that holds `path` in this container."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    for m in container.get("volumeMounts", []):
        if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/"):
            return volumes[m["name"]]["persistentVolumeClaim"]["claimName"], m["mountPath"]
    raise AssertionError(f"{container['name']} has no volume at {path}")


def test_the_spec_parses_and_reads_from_the_shared_volume(objs: list[Obj], tmp_path: Path) -> None:
    from keyroute.pipeline.spec import load_spec

    for pod in pipeline_pods(objs):
        [c] = pod["spec"]["containers"]
        env = container_env(objs, c)
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        spec_dir, _, spec_file = env["KEYROUTE_SPEC"].rpartition("/")
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mounts[spec_dir])
        text = find(objs, "ConfigMap", volume["configMap"]["name"])["data"][spec_file]
        # The spec exactly as mounted, parsed as `keyroute pipeline build` parses it.
        (tmp_path / spec_file).write_text(text)
        spec = load_spec(tmp_path / spec_file)
        assert spec.stores
        for store in spec.stores:
            # Relative sources would be taken relative to the ConfigMap mount: sources are absolute,
            # on the claim the driver and its executors mount.
            executor = yaml.safe_load(executor_template_text(objs))["spec"]
            assert claim_at(pod["spec"], c, store.source) == claim_at(
                executor, executor["containers"][0], store.source
            )


def test_development_runs_the_cronjob_pod_once(objs: list[Obj], overlay: str) -> None:
    jobs = of_kind(objs, "Job")
    if overlay == "prod":
        assert jobs == []
        return
    [job] = jobs
    cron = find(objs, "CronJob", "keyroute-pipeline")
    assert job["spec"]["template"] == cron["spec"]["jobTemplate"]["spec"]["template"]


def test_spark_may_manage_its_executor_pods(objs: list[Obj]) -> None:
    role = find(objs, "Role", "keyroute-spark")
    binding = find(objs, "RoleBinding", "keyroute-spark")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "keyroute-spark",
    }
    cron = find(objs, "CronJob", "keyroute-pipeline")
    namespace = cron["metadata"]["namespace"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == namespace
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "keyroute-spark", "namespace": namespace}]
    verbs = {r: set(rule["verbs"]) for rule in role["rules"] for r in rule["resources"]}
    assert {"create", "delete", "get", "list", "watch"} <= verbs["pods"]
    assert {"create", "delete"} <= verbs["configmaps"]


def test_the_spark_role_is_what_client_mode_spark_needs_and_no_more(objs: list[Obj], overlay: str) -> None:
    """Executor pods and their ConfigMap, in the pipeline's namespace only: no Services (client mode makes
    none), no claims (Spark is told not to own or reuse any), never Secrets, nodes or anything cluster-wide;
    and in prod nothing at all in the serving namespace."""
    role = find(objs, "Role", "keyroute-spark")
    rules = {(group, r): set(rule["verbs"]) for rule in role["rules"] for group in rule["apiGroups"]
             for r in rule["resources"]}
    assert rules == {
        ("", "pods"): {"get", "list", "watch", "create", "delete", "deletecollection", "patch"},
        ("", "configmaps"): {"get", "list", "watch", "create", "delete", "deletecollection"},
    }
    assert not any("resourceNames" in rule or "nonResourceURLs" in rule for rule in role["rules"])
    # Spark's own use of claims is off, so the missing permission is never needed.
    [c] = pod_template(find(objs, "CronJob", "keyroute-pipeline"))["spec"]["containers"]
    confs = spark_confs(container_env(objs, c, pod_name="keyroute-pipeline-1")["PYSPARK_SUBMIT_ARGS"])
    assert confs["spark.kubernetes.driver.ownPersistentVolumeClaim"] == "false"
    assert confs["spark.kubernetes.driver.reusePersistentVolumeClaim"] == "false"
    assert not any(key.startswith("spark.kubernetes.executor.volumes.") for key in confs)
    # Whoever is bound to it: only the pipeline's ServiceAccount, and nothing cluster-wide names it.
    for binding in [*of_kind(objs, "RoleBinding"), *of_kind(objs, "ClusterRoleBinding")]:
        names = {s["name"] for s in binding["subjects"]}
        if "keyroute-spark" in names:
            assert binding["kind"] == "RoleBinding" and binding["roleRef"]["name"] == "keyroute-spark"
    if overlay == "prod":
        serving = objs_namespace(objs)
        assert role["metadata"]["namespace"] == PIPELINE_NAMESPACE != serving
        assert not [b for b in of_kind(objs, "RoleBinding") if b["metadata"]["namespace"] == serving]
        assert not [r for r in of_kind(objs, "Role") if r["metadata"]["namespace"] == serving]


def test_pods_run_as_non_root(objs: list[Obj]) -> None:
    for w in workloads(objs):
        spec = pod_template(w)["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            if image_name(c["image"]) in KEYROUTE_IMAGES:
                assert spec["securityContext"]["runAsUser"] == dockerfile_user(image_name(c["image"]))
