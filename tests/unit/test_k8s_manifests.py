"""The Kubernetes manifests, proven without a cluster: every object of each rendered overlay is valid for
the Kubernetes API, and the objects agree with each other and with the programs they run.

Rendering is real kustomize (tests/k8s_render.py); the schemas are the Kubernetes OpenAPI schemas shipped
in the `kubernetes-validate` package (offline, strict: an unknown field is an error). What the CLI reads
is taken from `keyroute.cli.build_parser`, what the apps serve from their route tables.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import shlex
import subprocess
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from starlette.routing import Match, Route

from keyroute.cli import build_parser
from keyroute.core.settings import NodeSettings, RouterSettings, ZkSettings
from tests.k8s_render import (
    OVERLAYS,
    ROOT,
    Obj,
    expand,
    find,
    of_kind,
    pod_template,
    render,
    resolve_argv,
    resolve_env,
    selects,
    unresolved,
    workloads,
)

# The oldest Kubernetes these manifests are meant for, and the newest the schemas know.
KUBERNETES_VERSIONS = ("1.29", kubernetes_validate.latest_version())
KEYROUTE_IMAGE = "keyroute"
ENV_IN_HELP = re.compile(r"\[env (KEYROUTE_[A-Z0-9_]+)\]")
# Variables a keyroute container may set that the keyroute CLI does not read, and who reads them.
OTHER_READERS = {
    "PYSPARK_SUBMIT_ARGS": "pyspark, when it launches Spark's JVM (the pipeline's Spark settings)",
}
NAMESPACED_EXEMPT = {"Namespace"}


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def objs(overlay: str) -> list[Obj]:
    return render(overlay)


# --- helpers ------------------------------------------------------------------------------------------


def keyroute_containers(objs: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """(workload, container) for every container that runs the keyroute image."""
    for w in workloads(objs):
        for c in pod_template(w)["spec"]["containers"]:
            if image_name(c["image"]) == KEYROUTE_IMAGE:
                yield w, c


def image_name(image: str) -> str:
    return image.rsplit("/", 1)[-1].split("@")[0].split(":")[0]


def subcommand(container: Obj) -> list[str]:
    """The keyroute subcommand a container runs: ["node"], ["router"], ["pipeline", "build"]."""
    return [a for a in container.get("args", []) if not a.startswith("-")]


def cli_options(command: list[str]) -> dict[str, argparse.Action]:
    """env var -> option for `keyroute <command>`: the top-level options and those of each subcommand."""
    parser = build_parser({})
    found: dict[str, argparse.Action] = {}
    path = list(command)
    while True:
        sub = None
        for action in parser._actions:
            if m := ENV_IN_HELP.search(action.help or ""):
                found[m.group(1)] = action
            if isinstance(action, argparse._SubParsersAction):
                sub = action
        if sub is None or not path:
            return found
        parser = sub.choices[path.pop(0)]


def sample_field(path: str, pod_name: str = "keyroute-x-0", namespace: str = "ns") -> str:
    return {
        "metadata.name": pod_name,
        "metadata.namespace": namespace,
        "status.podIP": "10.0.0.7",
        "spec.nodeName": "worker-1",
        "spec.serviceAccountName": "default",
    }[path]


def container_env(objs: list[Obj], container: Obj, pod_name: str = "keyroute-x-0") -> dict[str, str]:
    namespace = objs_namespace(objs)
    return resolve_env(container, lambda p: sample_field(p, pod_name, namespace), objs)


def objs_namespace(objs: list[Obj]) -> str:
    return str(next(o for o in objs if o["kind"] == "Namespace")["metadata"]["name"])


def container_port(container: Obj, port: int | str) -> int:
    for p in container.get("ports", []):
        if port in (p.get("name"), p["containerPort"]):
            return int(p["containerPort"])
    raise AssertionError(f"container {container['name']} has no port {port!r}")


def pods_selected(objs: list[Obj], selector: Mapping[str, str]) -> list[Obj]:
    return [w for w in workloads(objs) if selects(selector, pod_template(w)["metadata"].get("labels", {}))]


def app_for(command: list[str]) -> Any:
    if command == ["router"]:
        from keyroute.router.app import create_app as router_app

        return router_app(RouterSettings())
    if command == ["node"]:
        from keyroute.node.app import create_app as node_app

        return node_app(NodeSettings(node_id="probe", data_dir=Path("/nonexistent")))
    return None


def serves_get(app: Any, path: str) -> bool:
    scope = {
        "type": "http",
        "method": "GET",
        "path": path,
        "root_path": "",
        "query_string": b"",
        "headers": [],
    }
    return any(isinstance(r, Route) and r.matches(scope)[0] is Match.FULL for r in app.routes)


def host_port_pairs(text: str) -> list[tuple[str, int]]:
    return [(h, int(p)) for h, p in re.findall(r"([A-Za-z0-9][A-Za-z0-9.-]*):(\d+)", text)]


def service_dns(objs: list[Obj]) -> dict[str, Obj]:
    """Every DNS name a Service answers to inside the overlay's namespace (short, .ns, .ns.svc)."""
    ns = objs_namespace(objs)
    names: dict[str, Obj] = {}
    for svc in of_kind(objs, "Service"):
        name = svc["metadata"]["name"]
        for dns in (name, f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local"):
            names[dns] = svc
    return names


# --- the API server would accept every object -----------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_is_valid_for_the_kubernetes_api(objs: list[Obj], version: str) -> None:
    assert len(objs) >= 15
    for obj in objs:
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


def test_every_namespaced_object_lands_in_the_overlay_namespace(objs: list[Obj], overlay: str) -> None:
    namespace = objs_namespace(objs)
    assert namespace == {"dev": "keyroute-dev", "prod": "keyroute"}[overlay]
    for obj in objs:
        if obj["kind"] not in NAMESPACED_EXEMPT:
            assert obj["metadata"].get("namespace") == namespace, obj["metadata"]["name"]
    for binding in of_kind(objs, "RoleBinding"):
        assert all(s.get("namespace") == namespace for s in binding["subjects"])


def test_names_are_unique_per_kind(objs: list[Obj]) -> None:
    seen = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(seen) == len(set(seen))


# --- objects refer to objects that exist, and select the pods they mean ---------------------------------


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
            if "configMap" in v:
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
        assert [t["topologyKey"] for t in spread] == ["topology.kubernetes.io/zone"]
    for w in workloads(objs):
        for c in pod_template(w)["spec"]["containers"]:
            assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"], c["name"]


# --- probes ask what the apps answer --------------------------------------------------------------------


def test_http_probes_hit_paths_the_apps_serve(objs: list[Obj]) -> None:
    probed = set()
    for w, c in keyroute_containers(objs):
        app = app_for(subcommand(c))
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = c.get(kind)
            if probe is None:
                continue
            assert app is not None, f"{c['name']} is probed but serves no HTTP"
            get = probe["httpGet"]
            container_port(c, get["port"])
            assert serves_get(app, get["path"]), f"{c['name']} {kind}: nothing serves GET {get['path']}"
            probed.add((c["name"], kind, get["path"]))
        annotations = pod_template(w)["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") == "true":
            assert serves_get(app, annotations["prometheus.io/path"])
            assert container_port(c, int(annotations["prometheus.io/port"]))
    assert {("node", "readinessProbe", "/readyz"), ("node", "livenessProbe", "/healthz")} <= probed
    assert {("router", "readinessProbe", "/readyz"), ("router", "livenessProbe", "/healthz")} <= probed


def test_zookeeper_probes_speak_whitelisted_four_letter_words(objs: list[Obj]) -> None:
    [zk] = pod_template(find(objs, "StatefulSet", "keyroute-zookeeper"))["spec"]["containers"]
    env = {e["name"]: e.get("value", "") for e in zk["env"]}
    whitelist = set(env["ZOO_4LW_COMMANDS_WHITELIST"].split(","))
    assert {"ruok", "srvr"} <= whitelist
    client = container_port(zk, "client")
    for kind in ("readinessProbe", "livenessProbe"):
        script = zk[kind]["exec"]["command"][-1]
        words = set(re.findall(r"printf (\w{4})", script))
        assert words and words <= whitelist, kind
        assert f"/dev/tcp/127.0.0.1/{client}" in script


# --- the environment is what the programs read -----------------------------------------------------------


def test_keyroute_env_is_exactly_what_the_cli_reads(objs: list[Obj]) -> None:
    checked = 0
    for w, c in keyroute_containers(objs):
        command = subcommand(c)
        reads = cli_options(command)
        names = [e["name"] for e in c.get("env", [])]
        assert len(names) == len(set(names)), f"{c['name']}: an env var is set twice"
        raw = " ".join(str(e.get("value", "")) for e in c.get("env", []))
        for name in names:
            if name.startswith("KEYROUTE_"):
                where = f"{w['metadata']['name']}/{c['name']}"
                assert name in reads, f"{where}: `keyroute {' '.join(command)}` does not read {name}"
            else:
                used = f"$({name})" in raw or name in OTHER_READERS
                assert used, f"{c['name']}: {name} is read by nothing (not a CLI option, not referenced)"
        # Service links would add KEYROUTE_<SERVICE>_PORT=tcp://... variables to the environment.
        assert pod_template(w)["spec"].get("enableServiceLinks") is False, w["metadata"]["name"]
        checked += 1
    assert checked >= 3


def test_every_reference_resolves_in_kubernetes_order(objs: list[Obj]) -> None:
    """$(VAR) in env sees only earlier entries: a patch that reorders env would leave a literal $(VAR)."""
    for _, c in keyroute_containers(objs):
        env = container_env(objs, c)
        for name, value in env.items():
            assert not unresolved(value), f"{c['name']}: {name}={value!r} keeps {unresolved(value)}"
        for part in resolve_argv(c, env):
            assert not unresolved(part), f"{c['name']}: argument {part!r}"


def test_the_cli_accepts_each_container_as_written(objs: list[Obj]) -> None:
    for w, c in keyroute_containers(objs):
        command = subcommand(c)
        assert c.get("command") in (None, ["keyroute"]), "the image's ENTRYPOINT is `keyroute`"
        env = container_env(objs, c, pod_name=f"{w['metadata']['name']}-0")
        for action in cli_options(command).values():
            if action.required:
                assert any(f"[env {k}]" in (action.help or "") for k in env), (
                    f"{c['name']}: required {action.option_strings[0]} is not set"
                )
        try:
            args = build_parser(env).parse_args(resolve_argv(c, env)[1:])
        except SystemExit:
            pytest.fail(f"`keyroute {' '.join(command)}` rejects the environment of {c['name']}: {env}")
        if command in (["node"], ["router"]):
            assert args.host == "0.0.0.0"
            assert args.port == container_port(c, "http")
        ZkSettings.parse(args.zk)


def test_addresses_in_the_environment_name_existing_services(objs: list[Obj]) -> None:
    dns = service_dns(objs)
    ns = objs_namespace(objs)
    for w, c in keyroute_containers(objs):
        env = container_env(objs, c, pod_name=f"{w['metadata']['name']}-0")
        hosts = ZkSettings.parse(env["KEYROUTE_ZK"]).hosts
        for host, port in host_port_pairs(hosts):
            svc = dns[host]
            assert port in [p["port"] for p in svc["spec"]["ports"]]
            assert pods_selected(objs, svc["spec"]["selector"]) == [
                find(objs, "StatefulSet", "keyroute-zookeeper")
            ]
        if "KEYROUTE_ADVERTISE_URL" in env:
            sts = find(objs, "StatefulSet", w["metadata"]["name"])
            [(host, port)] = host_port_pairs(env["KEYROUTE_ADVERTISE_URL"])
            pod, _, domain = host.partition(".")
            assert pod == f"{sts['metadata']['name']}-0" == env["KEYROUTE_NODE_ID"]
            assert domain == f"{sts['spec']['serviceName']}.{ns}.svc"
            svc = find(objs, "Service", sts["spec"]["serviceName"])
            assert port == container_port(c, "http") == svc["spec"]["ports"][0]["port"]


def test_zookeeper_servers_are_exactly_the_stateful_set_members(objs: list[Obj]) -> None:
    sts = find(objs, "StatefulSet", "keyroute-zookeeper")
    [zk] = pod_template(sts)["spec"]["containers"]
    env = {e["name"]: e.get("value", "") for e in zk["env"]}
    ports = {p["name"]: p["containerPort"] for p in zk["ports"]}
    headless = sts["spec"]["serviceName"]
    expected = [
        f"server.{i + 1}={sts['metadata']['name']}-{i}.{headless}:{ports['follower']}:{ports['election']};"
        f"{ports['client']}"
        for i in range(sts["spec"]["replicas"])
    ]
    assert env["ZOO_SERVERS"].split() == expected
    # The ordinal-to-myid script leaves nothing for Kubernetes' own $(VAR) expansion to touch.
    assert all(expand(part, lambda _: "X") == part for part in zk["command"])


# After the drain, the server finishes in-flight requests for at most this long (state_node/service.py).
NODE_SHUTDOWN_S = 10


def test_nodes_get_the_time_their_graceful_leave_takes(objs: list[Obj]) -> None:
    sts = find(objs, "StatefulSet", "keyroute-node")
    spec = pod_template(sts)["spec"]
    [c] = spec["containers"]
    env = container_env(objs, c, pod_name="keyroute-node-0")
    args = build_parser(env).parse_args(resolve_argv(c, env)[1:])
    drain_s = getattr(args, "drain_timeout_s", 60.0)  # the CLI's value for the drain, as configured
    assert spec["terminationGracePeriodSeconds"] >= 120
    assert spec["terminationGracePeriodSeconds"] >= drain_s + NODE_SHUTDOWN_S + 10, (
        "the kubelet would SIGKILL a node still handing its partitions over"
    )


# --- the pipeline ----------------------------------------------------------------------------------------


def pipeline_pods(objs: list[Obj]) -> list[Obj]:
    return [pod_template(w) for w in workloads(objs) if w["kind"] in ("CronJob", "Job")]


def executor_template_text(objs: list[Obj]) -> str:
    [cm] = [
        o for o in of_kind(objs, "ConfigMap") if o["metadata"]["name"].startswith("keyroute-spark-executor")
    ]
    return str(cm["data"]["executor-pod.yaml"])


def spark_confs(submit_args: str) -> dict[str, str]:
    words = shlex.split(submit_args)
    assert words[-1] == "pyspark-shell"
    confs = {}
    for flag, value in zip(words[:-1:2], words[1:-1:2], strict=True):
        assert flag == "--conf"
        key, _, val = value.partition("=")
        confs[key] = val
    return confs


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
        # Executors start the launcher the image installs (Spark adds `executor` as the argument).
        assert template["spec"]["containers"][0]["command"] == [Path(dockerfile_copy_target()).name]
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
            if image_name(c["image"]) == KEYROUTE_IMAGE:
                assert spec["securityContext"]["runAsUser"] == dockerfile_user()


# --- the image -------------------------------------------------------------------------------------------

DOCKERFILE = ROOT / "Dockerfile"


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerfile_copy_target(source: str = "deploy/docker/spark-executor.sh") -> str:
    [target] = [
        rest.split()[-1] for word, rest in dockerfile_instructions() if word == "COPY" and source in rest
    ]
    return target


def dockerfile_user() -> int:
    [user] = [rest for word, rest in dockerfile_instructions() if word == "USER"]
    return int(user.split(":")[0])


def test_the_image_runs_keyroute_as_a_non_root_user() -> None:
    instructions = dockerfile_instructions()
    assert instructions[-1] == ("CMD", '["--help"]')
    assert ("ENTRYPOINT", '["keyroute"]') in instructions
    assert dockerfile_user() >= 1000
    assert [w for w, _ in instructions].index("USER") > max(
        i for i, (w, _) in enumerate(instructions) if w == "RUN"
    ), "USER comes after every RUN (installing needs root, running does not)"
    [base] = [rest for word, rest in instructions if word == "FROM"]
    assert base.startswith("python:3.11-slim")
    assert any("openjdk-17-jre-headless" in rest for word, rest in instructions if word == "RUN")


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if pattern.startswith("**/"):
            hit = any(fnmatch.fnmatch(c.rsplit("/", 1)[-1], pattern[3:]) for c in candidates)
        else:
            hit = any(fnmatch.fnmatch(c, pattern) and c.count("/") == pattern.count("/") for c in candidates)
        if hit:
            excluded = not negate
    return excluded


def test_every_copy_source_exists_and_reaches_the_build_context() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = []
    for word, rest in dockerfile_instructions():
        if word == "COPY":
            args = [a for a in rest.split() if not a.startswith("--")]
            sources += args[:-1]
    assert "pyproject.toml" in sources and "README.md" in sources
    for source in sources:
        path = ROOT / source
        assert path.exists(), f"COPY {source}: no such file"
        files = [p for p in path.rglob("*.py")] if path.is_dir() else [path]
        assert files, source
        for f in files:
            relative = f.relative_to(ROOT).as_posix()
            if "__pycache__" not in relative:
                assert not dockerignored(relative, patterns), f"{relative} is excluded by .dockerignore"
    # Every package pyproject installs is copied.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert folders <= set(sources)
    assert dockerignored(".venv/bin/python", patterns) and dockerignored("tests/conftest.py", patterns)


def test_the_executor_launcher_starts_spark_s_executor_backend(tmp_path: Path) -> None:
    """The image's `keyroute-spark-executor` (named in the executor pod template) with a stand-in `java`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    java = bin_dir / "java"
    java.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    java.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SPARK_HOME": "/opt/pyspark",
        "SPARK_EXECUTOR_MEMORY": "4g",
        "SPARK_DRIVER_URL": "spark://CoarseGrainedScheduler@10.0.0.7:7078",
        "SPARK_EXECUTOR_ID": "3",
        "SPARK_EXECUTOR_CORES": "2",
        "SPARK_APPLICATION_ID": "spark-app-1",
        "SPARK_EXECUTOR_POD_IP": "10.0.0.9",
        "SPARK_RESOURCE_PROFILE_ID": "0",
        "SPARK_EXECUTOR_POD_NAME": "keyroute-pipeline-exec-3",
        "SPARK_JAVA_OPT_10": "-Dten",
        "SPARK_JAVA_OPT_2": "-Dspark.driver.port=7078",
        "SPARK_JAVA_OPT_0": "--add-opens=java.base/java.lang=ALL-UNNAMED",
    }
    script = ROOT / "deploy" / "docker" / "spark-executor.sh"
    assert dockerfile_copy_target() == "/usr/local/bin/keyroute-spark-executor"  # on PATH in the image
    done = subprocess.run(
        ["bash", str(script), "executor"], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.splitlines() == [
        "--add-opens=java.base/java.lang=ALL-UNNAMED",
        "-Dspark.driver.port=7078",
        "-Dten",
        "-Xms4g",
        "-Xmx4g",
        "-cp",
        "/opt/pyspark/jars/*",
        "org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend",
        "--driver-url",
        "spark://CoarseGrainedScheduler@10.0.0.7:7078",
        "--executor-id",
        "3",
        "--cores",
        "2",
        "--app-id",
        "spark-app-1",
        "--hostname",
        "10.0.0.9",
        "--resourceProfileId",
        "0",
        "--podName",
        "keyroute-pipeline-exec-3",
    ]
    refused = subprocess.run(["bash", str(script), "driver"], env=env, capture_output=True, text=True)
    assert refused.returncode == 2


# --- the object-storage variant: overlays/object-storage = prod + components/object-storage ---------------
# Snapshots go to s3:// (the pipeline's executors upload them, nodes fetch them); credentials come from the
# Secret keyroute-object-store, which the operator creates (never part of the manifests).

OBJECT_STORAGE = "object-storage"
OBJECT_STORE_SECRET = "keyroute-object-store"
# The variables live stores' Kafka settings name ("${NAME}"): optional, for nodes and the pipeline only.
KAFKA_SECRET = "keyroute-kafka"
OBJECT_STORE_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
SNAPSHOT_STORE_CONFIG = "keyroute-snapshot-store"


@pytest.fixture(scope="module")
def object_storage_objs() -> list[Obj]:
    return render(OBJECT_STORAGE)


def with_object_store_secret(objs: list[Obj]) -> list[Obj]:
    """The rendered objects plus the Secret the operator creates (made-up values): what the kubelet would
    resolve the references against. The Secret is required: without it no env resolves (see below)."""
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": OBJECT_STORE_SECRET, "namespace": objs_namespace(objs)},
        "data": {
            "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
            "AWS_SECRET_ACCESS_KEY": "example-secret",
            "AWS_REGION": "eu-west-1",
        },
    }
    return [*objs, secret]


def node_pod(objs: list[Obj]) -> Obj:
    return pod_template(find(objs, "StatefulSet", "keyroute-node"))


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
    test_every_object_is_valid_for_the_kubernetes_api(object_storage_objs, version)
    template = yaml.safe_load(executor_template_text(object_storage_objs))
    kubernetes_validate.validate(template, version, strict=True)
    # prod's shape: the variant changes where snapshots live, nothing else.
    assert objs_namespace(object_storage_objs) == "keyroute"
    for obj in object_storage_objs:
        if obj["kind"] not in NAMESPACED_EXEMPT:
            assert obj["metadata"].get("namespace") == "keyroute", obj["metadata"]["name"]


# The overlay-independent checks above, run on the object-storage overlay as well (prod's sizes).
GENERIC_CHECKS = {
    "names_unique": test_names_are_unique_per_kind,
    "selectors": test_workload_selectors_match_their_own_pods,
    "services": test_services_select_pods_and_target_ports_they_declare,
    "disruption_budgets": test_disruption_budgets_cover_existing_pods,
    "stateful_sets": test_stateful_sets_have_their_headless_service,
    "volumes": test_volumes_refer_to_existing_claims_and_config_maps,
    "router": lambda objs: test_the_router_is_one_load_balancer_address_scaled_by_the_autoscaler(objs, "prod"),
    "sizes": lambda objs: test_overlay_sizes(objs, "prod"),
    "probes": test_http_probes_hit_paths_the_apps_serve,
    "zookeeper_probes": test_zookeeper_probes_speak_whitelisted_four_letter_words,
    "keyroute_env": test_keyroute_env_is_exactly_what_the_cli_reads,
    "references": test_every_reference_resolves_in_kubernetes_order,
    "cli": test_the_cli_accepts_each_container_as_written,
    "addresses": test_addresses_in_the_environment_name_existing_services,
    "zookeeper_servers": test_zookeeper_servers_are_exactly_the_stateful_set_members,
    "grace": test_nodes_get_the_time_their_graceful_leave_takes,
    "no_one_off_job": lambda objs: test_development_runs_the_cronjob_pod_once(objs, "prod"),
    "spark_rbac": test_spark_may_manage_its_executor_pods,
    "non_root": test_pods_run_as_non_root,
}


@pytest.mark.parametrize("check", sorted(GENERIC_CHECKS))
def test_object_storage_overlay_passes_the_overlay_checks(
    object_storage_objs: list[Obj], check: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The credentials are read by pyarrow's S3 client (in the node, the pipeline and its executors), not
    # by the keyroute CLI.
    for name in OBJECT_STORE_KEYS:
        monkeypatch.setitem(OTHER_READERS, name, "pyarrow's S3 client, for snapshots on object storage")
    GENERIC_CHECKS[check](with_object_store_secret(object_storage_objs))


def test_object_storage_sources_still_parse_and_are_read_where_executors_read(
    object_storage_objs: list[Obj], tmp_path: Path
) -> None:
    test_the_spec_parses_and_reads_from_the_shared_volume(with_object_store_secret(object_storage_objs), tmp_path)


def test_object_storage_snapshots_go_to_an_s3_uri_from_one_config_map(object_storage_objs: list[Obj]) -> None:
    from urllib.parse import urlparse

    from keyroute.core.snapshot import is_local

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
        # No credential goes through Spark's configuration (it is shown in Spark's UI and logs).
        assert not any("AWS" in key.upper() or "secret" in key.lower() for key in confs)


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


def test_object_storage_credentials_come_from_the_required_secret(object_storage_objs: list[Obj]) -> None:
    objs = object_storage_objs
    assert of_kind(objs, "Secret") == []  # the operator creates it; no credential is in the manifests
    for where, c in object_store_consumers(objs):
        refs = {e["name"]: e for e in c.get("env", []) if e["name"].startswith("AWS_")}
        assert set(refs) == set(OBJECT_STORE_KEYS), where
        for name, entry in refs.items():
            assert "value" not in entry, f"{where}: {name} written into the manifest"
            assert entry["valueFrom"] == {
                "secretKeyRef": {"name": OBJECT_STORE_SECRET, "key": name, "optional": False}
            }, where
        # The Secret's optional keys (AWS_REGION, AWS_ENDPOINT_URL, AWS_SESSION_TOKEN) as a whole; nodes and
        # the pipeline's driver keep the optional Kafka variables of live stores (executors never consume).
        kafka = [] if where == "executor" else [{"secretRef": {"name": KAFKA_SECRET, "optional": True}}]
        assert c.get("envFrom") == [{"secretRef": {"name": OBJECT_STORE_SECRET, "optional": False}}, *kafka], where
    # Routers never touch snapshots: no credentials there.
    router = pod_template(find(objs, "Deployment", "keyroute-router"))["spec"]["containers"][0]
    assert OBJECT_STORE_SECRET not in yaml.safe_dump(router)
    # Resolved as the kubelet would: the Secret's values reach the node, and without the Secret the pod
    # does not start (the references are not optional).
    with_secret = with_object_store_secret(objs)
    node = node_pod(objs)["spec"]["containers"][0]
    env = container_env(with_secret, node, pod_name="keyroute-node-0")
    assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], env["AWS_REGION"]) == (
        "AKIAEXAMPLE",
        "example-secret",
        "eu-west-1",
    )
    with pytest.raises(AssertionError, match=OBJECT_STORE_SECRET):
        container_env(objs, node, pod_name="keyroute-node-0")


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


def test_kafka_variables_reach_nodes_and_the_pipeline_only_and_are_optional(objs: list[Obj]) -> None:
    consumers = [("node", node_pod(objs)["spec"]["containers"][0])]
    consumers += [(f"pipeline {i}", pod["spec"]["containers"][0]) for i, pod in enumerate(pipeline_pods(objs))]
    for where, c in consumers:
        assert {"secretRef": {"name": KAFKA_SECRET, "optional": True}} in c.get("envFrom", []), where
    router = pod_template(find(objs, "Deployment", "keyroute-router"))["spec"]["containers"][0]
    assert KAFKA_SECRET not in yaml.safe_dump(router)
    assert of_kind(objs, "Secret") == []  # the operator creates it; no secret is in the manifests
    # Without the Secret the pods still start (a spec without live stores needs none of it).
    container_env(objs, node_pod(objs)["spec"]["containers"][0], pod_name="keyroute-node-0")
