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
import shutil
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
    ALL_OVERLAYS,
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
# The Dockerfile's two targets, as the manifests name them (kustomize `images:` sets registry and tag).
SERVING_IMAGE = "keyroute-serving"
PIPELINE_IMAGE = "keyroute-pipeline"
KEYROUTE_IMAGES = (SERVING_IMAGE, PIPELINE_IMAGE)
ENV_IN_HELP = re.compile(r"\[env (KEYROUTE_[A-Z0-9_]+)\]")
# Variables a keyroute container may set that the keyroute CLI does not read, and who reads them.
OTHER_READERS = {
    "PYSPARK_SUBMIT_ARGS": "pyspark, when it launches Spark's JVM (the pipeline's Spark settings)",
}
NAMESPACED_EXEMPT = {"Namespace", "PriorityClass"}
# The node's zone, as the API server copies it onto the pod (Kubernetes 1.34 and later).
ZONE_LABEL = "topology.kubernetes.io/zone"
ZONE_FIELD = f"metadata.labels['{ZONE_LABEL}']"


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
            if image_name(c["image"]) in KEYROUTE_IMAGES:
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
        ZONE_FIELD: "eu-west-1a",
    }[path]


# The Secrets deploy/k8s/README.md tells the operator to create (made-up values), except the object store's,
# which the object-storage tests add themselves: what the kubelet resolves references against. prod requires
# them, dev runs without.
OPERATOR_SECRETS: dict[str, dict[str, str]] = {
    "keyroute-zookeeper-auth": {"writer": "keyroute-writer:w-secret", "reader": "keyroute-reader:r-secret"},
    "keyroute-cluster": {"cluster-secret": "c" * 64, "admin-token": "a" * 64},
    "keyroute-zookeeper-super": {"digest": "super:D/InIHSb7yEEbrWz8b9l71RjZJU="},
    "keyroute-kafka": {},
}


def operator_secrets(namespace: str) -> list[Obj]:
    return [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace}, "data": data}
        for name, data in OPERATOR_SECRETS.items()
    ]


def container_env(objs: list[Obj], container: Obj, pod_name: str = "keyroute-x-0") -> dict[str, str]:
    """The container's environment once the operator has created the documented Secrets."""
    namespace = objs_namespace(objs)
    given = {(o["kind"], o["metadata"]["name"]) for o in objs}
    extra = [s for s in operator_secrets(namespace) if ("Secret", s["metadata"]["name"]) not in given]
    return resolve_env(container, lambda p: sample_field(p, pod_name, namespace), [*objs, *extra])


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
        from keyroute.state_node.app import create_app as node_app

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
        assert [t["topologyKey"] for t in spread] == [ZONE_LABEL, "kubernetes.io/hostname"]
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


# --- the image -------------------------------------------------------------------------------------------

DOCKERFILE = ROOT / "Dockerfile"
CONSTRAINTS = "deploy/docker/constraints.txt"
TINI = "/usr/bin/tini"
# The manifests' image names are the Dockerfile's targets with this prefix.
IMAGE_PREFIX = "keyroute-"


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerfile_stages() -> dict[str, list[tuple[str, str]]]:
    """Each build stage's instructions, by the stage's name, the FROM line first."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for word, rest in dockerfile_instructions():
        if word == "FROM":
            image, _, name = rest.partition(" AS ")
            current = stages.setdefault(name.strip() or image, [])
        assert current is not None, f"{word} before the first FROM"
        current.append((word, rest))
    return stages


def dockerfile_target(target: str) -> list[tuple[str, str]]:
    """A target's instructions as built: those of the stages it is FROM, then its own."""
    stages = dockerfile_stages()
    own = stages[target]
    parent = own[0][1].partition(" AS ")[0].strip()
    return (dockerfile_target(parent) if parent in stages else [own[0]]) + own[1:]


def dockerfile_copy_target(source: str = "deploy/docker/spark-executor.sh") -> str:
    [target] = [
        rest.split()[-1] for word, rest in dockerfile_instructions() if word == "COPY" and source in rest
    ]
    return target


def dockerfile_user(image: str = SERVING_IMAGE) -> int:
    users = [rest for word, rest in dockerfile_target(image.removeprefix(IMAGE_PREFIX)) if word == "USER"]
    return int(users[-1].split(":")[0])


def dockerfile_entrypoint(target: str) -> list[str]:
    entrypoints = [rest for word, rest in dockerfile_target(target) if word == "ENTRYPOINT"]
    return list(yaml.safe_load(entrypoints[-1]))


def bind_mount_sources(run: str) -> list[str]:
    """The build-context files a RUN mounts (`--mount=type=bind,source=...` without `from=`)."""
    sources = []
    for mount in re.findall(r"--mount=(\S+)", run):
        options = dict(part.partition("=")[::2] for part in mount.split(","))
        if options.get("type") == "bind" and "from" not in options:
            sources.append(options["source"])
    return sources


def test_the_images_run_keyroute_under_tini_as_a_non_root_user() -> None:
    stages = dockerfile_stages()
    assert {IMAGE_PREFIX + target for target in ("serving", "pipeline")} == set(KEYROUTE_IMAGES)
    for target in ("serving", "pipeline"):
        instructions = dockerfile_target(target)
        assert instructions[-1] == ("CMD", '["--help"]')
        # tini as PID 1 forwards SIGTERM and reaps Spark's and uvloop's children; the manifests' `args` follow.
        assert dockerfile_entrypoint(target) == [TINI, "--", "keyroute"]
        words = [w for w, _ in instructions]
        assert dockerfile_user(IMAGE_PREFIX + target) >= 1000
        assert len(words) - 1 - words[::-1].index("USER") > max(i for i, w in enumerate(words) if w == "RUN"), (
            f"{target}: USER comes after every RUN (installing needs root, running does not)"
        )
        runs = " ".join(rest for word, rest in instructions if word == "RUN")
        assert re.search(r"apt-get install [^&]*\btini\b", runs), f"{target} does not install tini"
        assert TINI == "/usr/bin/tini"  # where Debian's package puts it
    # The stages a target is built from never reach it: the wheel stage's sources stay behind.
    assert not any(word == "COPY" for word, _ in stages["serving"])
    assert list(stages)[-1] == "serving", "a plain `docker build .` makes the lean image"


def test_the_base_image_is_pinned_by_digest() -> None:
    froms = [rest.partition(" AS ")[0].strip() for word, rest in dockerfile_instructions() if word == "FROM"]
    stages = dockerfile_stages()
    external = [image for image in froms if image not in stages]
    assert external, "no base image"
    for image in external:
        name, _, digest = image.partition("@")
        assert name == "python:3.11-slim-bookworm", image
        assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest), f"{image} is not pinned by digest"


def test_the_serving_image_has_no_jre_and_no_pyspark() -> None:
    serving = " ".join(rest for word, rest in dockerfile_target("serving") if word in ("RUN", "ENV"))
    pipeline = " ".join(rest for word, rest in dockerfile_target("pipeline") if word in ("RUN", "ENV"))
    assert "openjdk" not in serving and "[pipeline]" not in serving and "SPARK_HOME" not in serving
    assert "openjdk-17-jre-headless" in pipeline and "keyroute[pipeline]" in pipeline and "SPARK_HOME" in pipeline
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert not [d for d in pyproject["project"]["dependencies"] if d.lower().startswith(("pyspark", "pandas"))], (
        "pyspark or pandas in the default dependencies would land in the serving image"
    )
    for target, text in (("serving", serving), ("pipeline", pipeline)):
        installs = re.findall(r"pip install ([^&]*)", text)
        assert installs, target
        for install in installs:
            assert "--constraint /tmp/constraints.txt" in install, f"{target}: {install} is not constrained"
        assert CONSTRAINTS in [s for word, rest in dockerfile_target(target) for s in bind_mount_sources(rest)]


def _requirement_closure(roots: list[str]) -> dict[str, str]:
    """name -> installed version of every distribution `roots` need here (markers for this interpreter)."""
    import importlib.metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, str] = {}
    todo = [(Requirement(r), "") for r in roots]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        dist = importlib.metadata.distribution(req.name)
        if name not in found:
            found[name] = dist.version
            todo += [(Requirement(r), "") for r in dist.requires or []]
        for wanted in req.extras:
            todo += [(Requirement(r), wanted) for r in dist.requires or [] if "extra" in r]
    return found


def test_the_constraints_pin_exactly_the_runtime_dependencies_as_tested() -> None:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins: dict[str, str] = {}
    for line in (ROOT / CONSTRAINTS).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version and not any(c in version for c in "<>=!~*, ;"), f"not an exact pin: {line}"
            pins[canonicalize_name(name)] = version
    assert pins, CONSTRAINTS
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    roots = [*project["dependencies"], *project["optional-dependencies"]["pipeline"]]
    closure = _requirement_closure(roots)
    # Every runtime dependency and everything it pulls in, at the version the tests run, and nothing else
    # (no test or development tool).
    assert set(pins) == set(closure), (
        f"missing: {sorted(set(closure) - set(pins))}, not needed: {sorted(set(pins) - set(closure))}"
    )
    assert {name: pins[name] for name in closure} == closure
    for root in roots:
        req = Requirement(root)
        if req.marker is None or req.marker.evaluate():
            assert req.specifier.contains(pins[canonicalize_name(req.name)], prereleases=True), root


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
        if word == "RUN":
            sources += bind_mount_sources(rest)
    assert CONSTRAINTS in sources
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
        # the pipeline's driver also take the Kafka variables of live stores, required as every Secret in
        # production (executors never consume).
        kafka = [] if where == "executor" else [{"secretRef": {"name": KAFKA_SECRET, "optional": False}}]
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


def test_kafka_variables_reach_nodes_and_the_pipeline_only(objs: list[Obj], overlay: str) -> None:
    consumers = [("node", node_pod(objs)["spec"]["containers"][0])]
    consumers += [(f"pipeline {i}", pod["spec"]["containers"][0]) for i, pod in enumerate(pipeline_pods(objs))]
    # Optional in development; required in production like every Secret (empty without live stores).
    optional = overlay == "dev"
    for where, c in consumers:
        assert {"secretRef": {"name": KAFKA_SECRET, "optional": optional}} in c.get("envFrom", []), where
    router = pod_template(find(objs, "Deployment", "keyroute-router"))["spec"]["containers"][0]
    assert KAFKA_SECRET not in yaml.safe_dump(router)
    assert of_kind(objs, "Secret") == []  # the operator creates it; no secret is in the manifests
    node = node_pod(objs)["spec"]["containers"][0]
    if optional:
        # Without any Secret the pods still start (a spec without live stores needs none of it).
        resolve_env(node, lambda p: sample_field(p, "keyroute-node-0"), objs)
    else:
        with pytest.raises(AssertionError, match=KAFKA_SECRET):
            resolve_env(node, lambda p: sample_field(p, "keyroute-node-0"), objs)


# --- production: secure by default ------------------------------------------------------------------------

PROD_OVERLAYS = ("prod", OBJECT_STORAGE)
README = ROOT / "deploy" / "k8s" / "README.md"


@pytest.fixture(scope="module", params=ALL_OVERLAYS)
def any_overlay(request: pytest.FixtureRequest) -> tuple[str, list[Obj]]:
    return str(request.param), render(str(request.param))


def pod_specs(objs: list[Obj]) -> list[tuple[str, Obj]]:
    """(where, pod spec) of every pod the overlay makes: its workloads' and Spark's executor template."""
    specs = [(f"{w['kind']} {w['metadata']['name']}", pod_template(w)["spec"]) for w in workloads(objs)]
    specs.append(("spark executor template", yaml.safe_load(executor_template_text(objs))["spec"]))
    return specs


def secret_references(spec: Obj) -> Iterator[tuple[str, Obj]]:
    """(secret name, reference) of every Secret a pod spec names: env, envFrom and volumes."""
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        for e in c.get("env", []):
            if ref := e.get("valueFrom", {}).get("secretKeyRef"):
                yield ref["name"], ref
        for source in c.get("envFrom", []):
            if ref := source.get("secretRef"):
                yield ref["name"], ref
    for v in spec.get("volumes", []):
        if ref := v.get("secret"):
            yield ref["secretName"], ref


def readme_section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


@pytest.mark.parametrize("overlay_name", PROD_OVERLAYS)
def test_production_requires_every_secret_it_names_and_documents_them(overlay_name: str) -> None:
    objs = render(overlay_name)
    named = set()
    for where, spec in pod_specs(objs):
        for name, ref in secret_references(spec):
            named.add(name)
            assert ref.get("optional") is not True, f"{where}: Secret {name} is optional in {overlay_name}"
    assert {"keyroute-zookeeper-auth", "keyroute-cluster", "keyroute-zookeeper-super", "keyroute-kafka"} <= named
    # Each one is created in the README (the object store's in its own section).
    documented = set(re.findall(r"create secret generic ([a-z0-9-]+)", README.read_text()))
    assert named <= documented, f"not documented: {sorted(named - documented)}"
    assert "rotat" in readme_section("Secrets").lower()
    # Without them a keyroute pod does not start: the kubelet refuses the container.
    for _, c in keyroute_containers(objs):
        with pytest.raises(AssertionError, match="does not exist"):
            resolve_env(c, lambda p: sample_field(p), objs)


def test_development_starts_without_any_secret() -> None:
    objs = render("dev")
    for where, spec in pod_specs(objs):
        for name, ref in secret_references(spec):
            assert ref.get("optional") is True, f"{where}: {name}"
    for _, c in keyroute_containers(objs):
        resolve_env(c, lambda p: sample_field(p), objs)


def test_production_zookeeper_has_a_recovery_superuser_from_the_required_secret() -> None:
    from kazoo.security import make_digest_acl_credential

    objs = render("prod")
    [zk] = pod_template(find(objs, "StatefulSet", "keyroute-zookeeper"))["spec"]["containers"]
    digest = make_digest_acl_credential("super", "recovery-password")
    secrets = [{"kind": "Secret", "metadata": {"name": "keyroute-zookeeper-super"}, "data": {"digest": digest}}]
    env = resolve_env(zk, lambda p: sample_field(p), [*objs, *secrets])
    flags = shlex.split(env["SERVER_JVMFLAGS"])
    assert f"-Dzookeeper.DigestAuthenticationProvider.superDigest={digest}" in flags
    with pytest.raises(AssertionError, match="keyroute-zookeeper-super"):
        resolve_env(zk, lambda p: sample_field(p), objs)
    # Development has no superuser: nothing to recover there that a fresh ZooKeeper would not do.
    [dev_zk] = pod_template(find(render("dev"), "StatefulSet", "keyroute-zookeeper"))["spec"]["containers"]
    assert "superDigest" not in yaml.safe_dump(dev_zk)


def test_the_documented_super_digest_recipe_is_zookeeper_s_digest(tmp_path: Path) -> None:
    """The README's shell recipe computes what ZooKeeper's DigestAuthenticationProvider (and kazoo) compute."""
    from kazoo.security import make_digest_acl_credential

    if not shutil.which("openssl"):
        pytest.skip("openssl is not installed")
    [recipe] = re.findall(r"\$\((printf 'super:%s' [^)]*openssl base64)\)", readme_section("Secrets"))
    done = subprocess.run(
        ["bash", "-c", f"printf 'super:%s' \"$({recipe})\""],
        env={**os.environ, "ZK_SUPER_PASSWORD": "recovery-password"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout == make_digest_acl_credential("super", "recovery-password")


# --- network policies ------------------------------------------------------------------------------------

EXTERNAL = {"external": "true"}  # stands for an address outside the cluster (clients, API server, S3)
KUBE_DNS = {"k8s-app": "kube-dns"}


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
        ns = peer["namespaceSelector"].get("matchLabels", {})
        in_ns = ns.get("kubernetes.io/metadata.name") == "kube-system" and labels is KUBE_DNS
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
        if peers is not None and not any(_peer_matches(p, peer, peer not in (EXTERNAL, KUBE_DNS)) for p in peers):
            continue
        ports = rule.get("ports")
        if ports is None or any(p.get("port") == port and p.get("protocol", "TCP") == protocol for p in ports):
            return True
    return False


def allowed(policies: list[Obj], src: Mapping[str, str], dst: Mapping[str, str], port: int, proto: str = "TCP") -> bool:
    """Would the namespace's NetworkPolicies let `src` open a connection to `dst`:port? (Pods outside the
    namespace are not restricted by these policies.)"""

    def side_allows(pod: Mapping[str, str], kind: str, rules_key: str, peer_key: str, peer: Mapping[str, str]) -> bool:
        if pod in (EXTERNAL, KUBE_DNS):
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
    }
    want |= {(who, "zookeeper", zk["client"], "TCP") for who in ("router", "node", "pipeline")}
    want |= {(who, "kube-dns", 53, proto) for who in ("router", "node", "zookeeper", "pipeline", "spark-executor")
             for proto in ("UDP", "TCP")}
    if object_storage:
        want |= {(who, "external", 443, "TCP") for who in ("node", "pipeline", "spark-executor")}
    return want


@pytest.mark.parametrize("overlay_name", PROD_OVERLAYS)
def test_network_policies_allow_exactly_what_keyroute_needs(overlay_name: str) -> None:
    objs = render(overlay_name)
    policies = of_kind(objs, "NetworkPolicy")
    deny = [p for p in policies if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress")
            and not p["spec"].get("egress")]
    assert deny and set(deny[0]["spec"]["policyTypes"]) == {"Ingress", "Egress"}, "no default deny"
    pods: dict[str, Mapping[str, str]] = {**component_labels(objs), "external": EXTERNAL, "kube-dns": KUBE_DNS}
    want = expected_connections(objs, object_storage=overlay_name == OBJECT_STORAGE)
    # Every port any pod listens on, every port it connects to, and a few it must not reach.
    ports = {port for _, _, port, _ in want} | {22, 80, 4040, 9092}
    # Traffic among outsiders (and from kube-dns, which answers but never calls) is not these policies' business.
    outside = ("external", "kube-dns")
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


# --- the client address ----------------------------------------------------------------------------------

INTERNAL_LB_ANNOTATIONS = {
    "service.beta.kubernetes.io/aws-load-balancer-internal": "true",
    "service.beta.kubernetes.io/aws-load-balancer-scheme": "internal",
    "networking.gke.io/load-balancer-type": "Internal",
    "service.beta.kubernetes.io/azure-load-balancer-internal": "true",
}
# The router's server stops in at most 30 s for requests in flight + 1 s to abort + 5 s for the lifespan
# (keyroute/http/server.py, HttpServer.stop).
ROUTER_STOP_S = 36
# How long a cloud load balancer takes to notice a host without a ready router (two failed health checks,
# 10 s apart, with externalTrafficPolicy: Local), and kube-proxy everywhere to drop the endpoint.
LB_DEREGISTRATION_S = 15


@pytest.mark.parametrize("overlay_name", PROD_OVERLAYS)
def test_production_client_address_is_an_internal_load_balancer(overlay_name: str) -> None:
    import ipaddress

    objs = render(overlay_name)
    svc = find(objs, "Service", "keyroute-router")
    assert svc["spec"]["type"] == "LoadBalancer"
    annotations = svc["metadata"].get("annotations", {})
    assert INTERNAL_LB_ANNOTATIONS.items() <= annotations.items()
    assert svc["spec"]["externalTrafficPolicy"] == "Local"
    ranges = svc["spec"]["loadBalancerSourceRanges"]
    assert ranges and all(ipaddress.ip_network(r).is_private for r in ranges), ranges
    assert "loadBalancerSourceRanges" in README.read_text()
    spec = pod_template(find(objs, "Deployment", "keyroute-router"))["spec"]
    [c] = spec["containers"]
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pause = int(command[1])
    assert pause >= LB_DEREGISTRATION_S
    assert spec["terminationGracePeriodSeconds"] >= pause + ROUTER_STOP_S, "the kubelet would cut the drain short"


# --- Pod Security Standards: restricted ------------------------------------------------------------------

PSS_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                    "projected", "secret"}


def restricted_violations(spec: Obj) -> list[str]:
    """What the Pod Security Standards' `restricted` profile (latest) refuses in a pod spec."""
    out = []
    pod_sc = spec.get("securityContext", {})
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(host):
            out.append(host)
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= PSS_VOLUME_TYPES:
            out.append(f"volume {v['name']}: {sorted(kinds)}")
    if not isinstance(pod_sc.get("runAsUser", 1), int) or pod_sc.get("runAsUser") == 0:
        out.append("pod runAsUser")
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities not dropped")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: capabilities added")
        if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True:
            out.append(f"{name}: runAsNonRoot")
        user = sc.get("runAsUser", pod_sc.get("runAsUser"))
        if not isinstance(user, int) or user == 0:
            out.append(f"{name}: no numeric non-root runAsUser")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile {seccomp}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{name}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{name}: procMount")
    return out


def test_the_restricted_check_refuses_what_restricted_refuses() -> None:
    good = {"securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False,
                                                             "capabilities": {"drop": ["ALL"]}}}]}
    assert restricted_violations(good) == []
    for breaking in (
        {"hostNetwork": True},
        {"volumes": [{"name": "h", "hostPath": {"path": "/"}}]},
        {"securityContext": {**good["securityContext"], "seccompProfile": {"type": "Unconfined"}}},
        {"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}},
        {"containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False}}]},
    ):
        assert restricted_violations({**good, **breaking}), breaking


def test_every_pod_passes_the_restricted_pod_security_standard(any_overlay: tuple[str, list[Obj]]) -> None:
    overlay_name, objs = any_overlay
    [namespace] = of_kind(objs, "Namespace")
    labels = namespace["metadata"]["labels"]
    for mode in ("enforce", "audit", "warn"):
        assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted", mode
    for where, spec in pod_specs(objs):
        assert restricted_violations(spec) == [], f"{overlay_name}: {where}"


# --- priorities and resources ----------------------------------------------------------------------------


def quantity(text: str | int) -> float:
    """A Kubernetes quantity (or a JVM size such as 6g, 512m) in bytes."""
    text = str(text)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9,
             "g": 2**30, "m": 2**20}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def test_serving_pods_outrank_batch_pods(any_overlay: tuple[str, list[Obj]]) -> None:
    overlay_name, objs = any_overlay
    classes = {pc["metadata"]["name"]: pc for pc in of_kind(objs, "PriorityClass")}
    assert set(classes) == {"keyroute-serving", "keyroute-batch"}
    assert classes["keyroute-serving"]["value"] > classes["keyroute-batch"]["value"]
    assert classes["keyroute-batch"].get("preemptionPolicy") == "Never"
    assert not any(pc.get("globalDefault") for pc in classes.values())
    for where, spec in pod_specs(objs):
        batch = where.startswith(("CronJob", "Job", "spark executor"))
        assert spec.get("priorityClassName") == ("keyroute-batch" if batch else "keyroute-serving"), where


def test_every_container_bounds_memory_and_ephemeral_storage(any_overlay: tuple[str, list[Obj]]) -> None:
    _, objs = any_overlay
    for where, spec in pod_specs(objs):
        for c in spec["containers"]:
            resources = c.get("resources", {})
            for kind in ("requests", "limits"):
                assert "ephemeral-storage" in resources.get(kind, {}), f"{where}/{c['name']}: {kind}"
    nodes = pod_template(find(objs, "StatefulSet", "keyroute-node"))["spec"]["containers"][0]["resources"]
    assert quantity(nodes["requests"]["memory"]) == quantity(nodes["limits"]["memory"])


# The driver's JVM beyond its heap (Spark's rule for the pods it sizes) and the Python process driving it.
def jvm_overhead(heap: float) -> float:
    return max(384 * 2**20, 0.1 * heap)


DRIVER_PYTHON_BYTES = 512 * 2**20


def test_the_spark_driver_heap_fits_its_container(any_overlay: tuple[str, list[Obj]]) -> None:
    _, objs = any_overlay
    for pod in pipeline_pods(objs):
        [c] = pod["spec"]["containers"]
        confs = spark_confs(container_env(with_object_store_secret(objs), c)["PYSPARK_SUBMIT_ARGS"])
        heap = quantity(confs["spark.driver.memory"])
        limit = quantity(c["resources"]["limits"]["memory"])
        assert heap + jvm_overhead(heap) + DRIVER_PYTHON_BYTES <= limit, (confs["spark.driver.memory"], limit)
        assert heap >= limit / 3, "most of the container should be the heap"
        # Executors: memory from Spark's settings, the Python workers' share on top.
        assert quantity(confs["spark.executor.memory"]) > 0
        assert float(confs["spark.executor.memoryOverheadFactor"]) >= 0.4


RESULTS = ROOT / "benchmarks" / "RESULTS.md"


def measured_partition_move_s() -> float:
    """The slowest measured move of a 1,000,000-row partition to another node (benchmarks/RESULTS.md,
    "Rebalance": assignment -> the new owner's serving record, median)."""
    section = RESULTS.read_text().split("### Rebalance", 1)[1].split("\n## ", 1)[0]
    medians = [float(m) for m in re.findall(r"^\| [^|]+\| 1,000,000 \| [^|]+\| \*\*([0-9.]+) s\*\*", section, re.M)]
    assert medians, "no 1,000,000-row rebalance figure in benchmarks/RESULTS.md"
    return max(medians)


def test_node_grace_period_is_sized_from_the_measured_hand_over(objs: list[Obj], tmp_path: Path) -> None:
    move_s = measured_partition_move_s()
    sts = find(objs, "StatefulSet", "keyroute-node")
    spec = pod_template(sts)["spec"]
    [c] = spec["containers"]
    env = container_env(objs, c, pod_name="keyroute-node-0")
    drain_s = build_parser(env).parse_args(resolve_argv(c, env)[1:]).drain_timeout_s
    # What a leaving node holds, and must see served by its new assignees before it goes.
    from keyroute.pipeline.spec import load_spec

    spec_text = find(objs, "ConfigMap", next(
        v["configMap"]["name"] for v in pipeline_pods(objs)[0]["spec"]["volumes"] if v["name"] == "stores"
    ))["data"]["stores.toml"]
    path = tmp_path / "stores.toml"
    path.write_text(spec_text)
    stores = load_spec(path).stores
    nodes = sts["spec"]["replicas"]
    replicas = sum(s.partitions * s.replication_factor for s in stores)
    held = -(-replicas // nodes)
    # With fewer other nodes than replicas, the others already hold every partition: nothing moves.
    moves = held if nodes - 1 >= max(s.replication_factor for s in stores) else 0
    assert drain_s >= 2 * moves * move_s, f"{moves} moves of {move_s} s need a drain of {2 * moves * move_s:.0f} s"
    assert spec["terminationGracePeriodSeconds"] >= drain_s + NODE_SHUTDOWN_S + 2
    # The arithmetic is written where operators look, with the figure it starts from.
    figure = f"{move_s:.2f} s"
    node_yaml = (ROOT / "deploy" / "k8s" / "base" / "node.yaml").read_text()
    assert figure in node_yaml and figure in README.read_text()


# --- zones -----------------------------------------------------------------------------------------------


def test_nodes_take_their_zone_from_the_pod_s_zone_label(objs: list[Obj]) -> None:
    [c] = node_pod(objs)["spec"]["containers"]
    [entry] = [e for e in c["env"] if e["name"] == "KEYROUTE_ZONE"]
    assert entry["valueFrom"] == {"fieldRef": {"fieldPath": ZONE_FIELD}}
    env = container_env(objs, c, pod_name="keyroute-node-0")
    assert build_parser(env).parse_args(resolve_argv(c, env)[1:]).zone == "eu-west-1a"
    # Before Kubernetes 1.34 the pod has no such label: the value is empty, which the node takes as no zone.
    def without_zone(path: str) -> str:
        if path == ZONE_FIELD:
            raise KeyError(path)
        return sample_field(path, "keyroute-node-0", objs_namespace(objs))

    env = resolve_env(c, without_zone, [*objs, *operator_secrets(objs_namespace(objs))])
    assert env["KEYROUTE_ZONE"] == ""
    assert build_parser(env).parse_args(resolve_argv(c, env)[1:]).zone == ""
    assert "1.34" in readme_section("Zones")


def test_serving_pods_spread_over_zones_and_hosts(any_overlay: tuple[str, list[Obj]]) -> None:
    overlay_name, objs = any_overlay
    for kind, name in (("StatefulSet", "keyroute-node"), ("Deployment", "keyroute-router"),
                       ("StatefulSet", "keyroute-zookeeper")):
        w = find(objs, kind, name)
        spec = pod_template(w)["spec"]
        spread = {t["topologyKey"]: t for t in spec["topologySpreadConstraints"]}
        assert set(spread) == {ZONE_LABEL, "kubernetes.io/hostname"}, name
        for t in spread.values():
            assert t["maxSkew"] == 1
            assert t["labelSelector"]["matchLabels"] == w["spec"]["selector"]["matchLabels"]
        strict = overlay_name != "dev" and name != "keyroute-router"
        assert spread[ZONE_LABEL]["whenUnsatisfiable"] == ("DoNotSchedule" if strict else "ScheduleAnyway"), name


# --- images ----------------------------------------------------------------------------------------------


def test_routers_and_nodes_run_the_serving_image_the_pipeline_its_own(any_overlay: tuple[str, list[Obj]]) -> None:
    overlay_name, objs = any_overlay
    images = {}
    for w in workloads(objs):
        for c in pod_template(w)["spec"]["containers"]:
            images[w["metadata"]["name"]] = c["image"]
    assert image_name(images["keyroute-router"]) == image_name(images["keyroute-node"]) == SERVING_IMAGE
    assert image_name(images["keyroute-pipeline"]) == PIPELINE_IMAGE
    assert image_name(images["keyroute-zookeeper"]) == "zookeeper"
    for pod in pipeline_pods(objs):
        env = container_env(with_object_store_secret(objs), pod["spec"]["containers"][0])
        confs = spark_confs(env["PYSPARK_SUBMIT_ARGS"])
        assert confs["spark.kubernetes.container.image"] == images["keyroute-pipeline"]
    kustomization_file = ROOT / "deploy" / "k8s" / "overlays" / overlay_name / "kustomization.yaml"
    kustomization = yaml.safe_load(kustomization_file.read_text())
    if overlay_name != OBJECT_STORAGE:  # it takes prod's
        assert {i["name"] for i in kustomization["images"]} == set(KEYROUTE_IMAGES)
