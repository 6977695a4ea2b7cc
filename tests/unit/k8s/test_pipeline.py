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
        env = container_env(objs, c, pod_name="keyroute-pipeline-123-abcde")
        assert env["KEYROUTE_MASTER"] == "k8s://https://kubernetes.default.svc"
        confs = spark_confs(env["PYSPARK_SUBMIT_ARGS"])
        assert confs["spark.kubernetes.container.image"] == c["image"]  # executors run the driver's image
        assert confs["spark.kubernetes.driver.pod.name"] == "keyroute-pipeline-123-abcde"
        assert confs["spark.kubernetes.namespace"] == objs_namespace(objs)
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
        # published by the pipeline is a path every node can open.
        output = env["KEYROUTE_OUTPUT"]
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
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "keyroute-spark", "namespace": objs_namespace(objs)}
    ]
    verbs = {r: set(rule["verbs"]) for rule in role["rules"] for r in rule["resources"]}
    assert {"create", "delete", "get", "list", "watch"} <= verbs["pods"]
    assert {"create", "delete"} <= verbs["configmaps"]


def test_pods_run_as_non_root(objs: list[Obj]) -> None:
    for w in workloads(objs):
        spec = pod_template(w)["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            if image_name(c["image"]) in KEYROUTE_IMAGES:
                assert spec["securityContext"]["runAsUser"] == dockerfile_user(image_name(c["image"]))
