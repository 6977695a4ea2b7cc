"""What the Kubernetes manifest tests share: the rendered objects' helpers, the image names and
the Dockerfile's instructions."""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml
from starlette.routing import Match, Route

from keyroute.cli import build_parser
from keyroute.runtime.settings import NodeSettings, RouterSettings
from tests.k8s_render import (
    ROOT,
    Obj,
    find,
    of_kind,
    pod_template,
    resolve_env,
    selects,
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
    # Snapshots on object storage (prod's default): nodes, the pipeline and its executors.
    "AWS_ACCESS_KEY_ID": "pyarrow's S3 client, for snapshots on object storage",
    "AWS_SECRET_ACCESS_KEY": "pyarrow's S3 client, for snapshots on object storage",
    # The static keys as a file (components/object-storage): the AWS SDK inside pyarrow reads it.
    "AWS_SHARED_CREDENTIALS_FILE": "pyarrow's S3 client (the AWS SDK), for snapshots on object storage",
    # prod's ZooKeeper backup (overlays/prod/zk-backup.yaml): where its upload writes the dump.
    "ZK_BACKUP_URI": "the ZooKeeper backup's upload step",
}
NAMESPACED_EXEMPT = {"Namespace", "PriorityClass", "ClusterRole", "ClusterRoleBinding"}
# API groups of custom resources (the Prometheus Operator's, components/monitoring; cert-manager's,
# components/cert-manager): not in Kubernetes' schemas, so not validated against them;
# tests/unit/k8s/test_monitoring.py and test_tls.py check them.
CUSTOM_RESOURCE_GROUPS = ("monitoring.coreos.com", "cert-manager.io")


def is_custom_resource(obj: Any) -> bool:
    return str(obj["apiVersion"]).partition("/")[0] in CUSTOM_RESOURCE_GROUPS


# The Kubernetes Node's zone label (the API server copies it onto pods only from Kubernetes 1.35 on).
ZONE_LABEL = "topology.kubernetes.io/zone"
ZONE_FIELD = f"metadata.labels['{ZONE_LABEL}']"


def keyroute_containers(objs: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """(workload, container) for every container that runs the keyroute command of a keyroute image (the
    image's ENTRYPOINT; prod's ZooKeeper backup also runs Python from the image to upload its dump)."""
    for w in workloads(objs):
        for c in pod_template(w)["spec"]["containers"]:
            if image_name(c["image"]) in KEYROUTE_IMAGES and c.get("command") in (None, ["keyroute"]):
                yield w, c


def keyroute_init_containers(objs: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """(workload, init container) for every init container that runs the keyroute command."""
    for w in workloads(objs):
        for c in pod_template(w)["spec"].get("initContainers", []):
            if image_name(c["image"]) in KEYROUTE_IMAGES and c.get("command") in (None, ["keyroute"]):
                yield w, c


def cli_has(command: list[str]) -> bool:
    """Whether this checkout's `keyroute` has the subcommand (manifests may name one that is on its way)."""
    parser = build_parser({})
    for word in command:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or word not in sub.choices:
            return False
        parser = sub.choices[word]
    return True


def zookeeper_cfg(container: Obj) -> dict[str, str]:
    """The zoo.cfg entries a ZooKeeper container adds (ZOO_CFG_EXTRA, space-separated key=value)."""
    env = {e["name"]: e.get("value", "") for e in container["env"]}
    return dict(entry.split("=", 1) for entry in env.get("ZOO_CFG_EXTRA", "").split())


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
        "metadata.labels['batch.kubernetes.io/job-name']": "keyroute-zk-backup-29412345",
        ZONE_FIELD: "eu-west-1a",
    }[path]


# The Secrets deploy/k8s/README.md tells the operator to create (made-up values): what the kubelet resolves
# references against. prod requires them, dev runs without. The object store's two (the pipeline's
# read/write/delete keys, the nodes' read-only ones) differ in their key id only.
OPERATOR_SECRETS: dict[str, dict[str, str]] = {
    "keyroute-zookeeper-auth": {"writer": "keyroute-writer:w-secret", "reader": "keyroute-reader:r-secret"},
    "keyroute-cluster": {"cluster-secret": "c" * 64, "admin-token": "a" * 64},
    "keyroute-zookeeper-super": {"digest": "super:D/InIHSb7yEEbrWz8b9l71RjZJU="},
    "keyroute-access-tokens": {"tokens.toml": '[[tokens]]\nname = "ops"\ntoken = "t"\nstores = "*"\n'},
    "keyroute-kafka": {},
    "keyroute-object-store": {
        "credentials": "[default]\naws_access_key_id = AKIAEXAMPLE\naws_secret_access_key = example-secret\n",
    },
    "keyroute-object-store-read": {
        "credentials": "[default]\naws_access_key_id = AKIAREADONLY\naws_secret_access_key = example-secret\n",
    },
    "keyroute-zk-backup-store": {
        "credentials": "[default]\naws_access_key_id = AKIABACKUP\naws_secret_access_key = example-secret\n",
    },
}


# ConfigMaps the README tells the operator to create (their content is the operator's: a CA certificate).
OPERATOR_CONFIG_MAPS = {"keyroute-client-ca": {"ca.crt": "-----BEGIN CERTIFICATE-----\n..."}}


def operator_secrets(namespace: str, leave_out: tuple[str, ...] = ()) -> list[Obj]:
    return [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace}, "data": data}
        for name, data in OPERATOR_SECRETS.items()
        if name not in leave_out
    ]


def container_env(
    objs: list[Obj], container: Obj, pod_name: str = "keyroute-x-0", namespace: str | None = None
) -> dict[str, str]:
    """The container's environment once the operator has created the documented Secrets, for a pod in
    `namespace` (the serving one unless given)."""
    namespace = namespace or objs_namespace(objs)
    given = {(o["kind"], o["metadata"]["name"]) for o in objs}
    extra = [s for s in operator_secrets(namespace) if ("Secret", s["metadata"]["name"]) not in given]
    return resolve_env(container, lambda p: sample_field(p, pod_name, namespace), [*objs, *extra])


def objs_namespace(objs: list[Obj]) -> str:
    """The overlay's serving namespace: where its nodes run (prod runs the pipeline in another one)."""
    return namespace_of(find(objs, "StatefulSet", "keyroute-node"))


def namespace_of(obj: Obj) -> str:
    return str(obj["metadata"]["namespace"])


def namespaces(objs: list[Obj]) -> set[str]:
    return {str(o["metadata"]["name"]) for o in objs if o["kind"] == "Namespace"}


# Where prod runs the pipeline's driver and executors: a namespace of its own.
PIPELINE_NAMESPACE = "keyroute-pipeline"


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


def service_dns(objs: list[Obj], from_namespace: str | None = None) -> dict[str, Obj]:
    """Every DNS name a Service answers to for a pod of `from_namespace` (the serving one unless given):
    the short name only within the Service's own namespace, .ns, .ns.svc and .ns.svc.cluster.local anywhere."""
    here = from_namespace or objs_namespace(objs)
    names: dict[str, Obj] = {}
    for svc in of_kind(objs, "Service"):
        name, ns = svc["metadata"]["name"], namespace_of(svc)
        for dns in (f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local"):
            names[dns] = svc
        if ns == here:
            names[name] = svc
    return names


# After the drain, the server finishes in-flight requests for at most this long (state_node/service.py).
NODE_SHUTDOWN_S = 10


def pipeline_pods(objs: list[Obj]) -> list[Obj]:
    """The pipeline's driver pods: its CronJob's, and a one-off Job's if the overlay has one."""
    return [
        pod_template(w)
        for w in workloads(objs)
        if w["kind"] in ("CronJob", "Job") and w["metadata"]["labels"].get("app.kubernetes.io/component") == "pipeline"
    ]


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


DOCKERFILE = ROOT / "Dockerfile"
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


# Snapshots go to s3:// (the pipeline's executors upload them, nodes fetch them); credentials come from the
# Secret keyroute-object-store, which the operator creates (never part of the manifests).

OBJECT_STORAGE = "object-storage"
# The pipeline's read/write/delete credentials, and the nodes' read-only ones (same keys, other values).
OBJECT_STORE_SECRET = "keyroute-object-store"
OBJECT_STORE_READ_SECRET = "keyroute-object-store-read"


def with_object_store_secret(objs: list[Obj]) -> list[Obj]:
    """The rendered objects plus the two Secrets the operator creates (made-up values): what the kubelet would
    resolve the references against. They are required: without them no env resolves (test_object_storage.py).
    The nodes' read-only keys differ from the pipeline's in their key id only."""
    names = (OBJECT_STORE_SECRET, OBJECT_STORE_READ_SECRET)
    return [*objs, *[s for s in operator_secrets(objs_namespace(objs)) if s["metadata"]["name"] in names]]


def node_pod(objs: list[Obj]) -> Obj:
    return pod_template(find(objs, "StatefulSet", "keyroute-node"))


PROD_OVERLAYS = ("prod", OBJECT_STORAGE)
README = ROOT / "deploy" / "k8s" / "README.md"


def pod_specs(objs: list[Obj]) -> list[tuple[str, Obj]]:
    """(where, pod spec) of every pod the overlay makes: its workloads' and Spark's executor template."""
    specs = [(f"{w['kind']} {w['metadata']['name']}", pod_template(w)["spec"]) for w in workloads(objs)]
    specs.append(("spark executor template", yaml.safe_load(executor_template_text(objs))["spec"]))
    return specs


def readme_section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]
