"""The dev overlay launched on this machine from the rendered manifests themselves: ZooKeeper, two nodes and
a router, probed as the kubelet probes them, and a key read through the LoadBalancer Service.

What stands in for Kubernetes, and the only rewrites made to what the manifests say:
- Each pod gets its own loopback address (127.a.b.N) as its pod IP. Ports stay exactly as written.
- Downward-API fields resolve to the pod's name, namespace and IP; $(VAR) references expand as Kubernetes
  expands them (env in order, then command/args).
- Service and pod DNS names in `host:port` pairs (a Service's port becomes the selected pod's targetPort;
  `<pod>.<headless service>.<ns>.svc` names become that pod's IP), the pod's wildcard address 0.0.0.0 (a pod
  listens on its own interfaces only) and, inside exec probes, 127.0.0.1 (the pod itself) become pod IPs.
- Volume mount paths in env and args become directories here (one per claim, per pod for claim templates).
- `keyroute` (the image's ENTRYPOINT) runs as `python -m keyroute`; the ZooKeeper container (the official
  image) is stood in for by the embedded ZooKeeper, on the ZooKeeper pod's IP and the container's port.
- Init containers run to completion before a pod's containers start, as the kubelet runs them. The
  Kubernetes API they call is a stand-in HTTP server on 127.0.0.1 answering GET /api/v1/nodes/{name} with
  the made-up Kubernetes Node each pod is scheduled on (`spec.nodeName`) and its zone label; it is given to
  them as KEYROUTE_API_URL (plain http: no CA to verify). The projected service-account volume is a
  directory holding a made-up token, which the stand-in checks; mounted where the command looks by default,
  it is given to them as KEYROUTE_SERVICE_ACCOUNT_DIR.
The snapshot is written by hand in the keyroute format on the shared claim (no Spark) and published in
ZooKeeper, as tests/integration/test_node.py does.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from keyroute.cluster import zk, zk_layout
from keyroute.cluster.partition_map import StoreRecord
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper
from keyroute.http.server import HttpServer
from keyroute.keys.key_format import KeyFormat, parse_key
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.runtime.settings import ZkSettings
from keyroute.storage.snapshot import Manifest, partition_dir, version_dir, write_manifest
from keyroute.zone import SERVICE_ACCOUNT_DIR
from tests.k8s_render import Obj, find, of_kind, pod_template, render, resolve_argv, resolve_env, selects
from tests.util import Proc, serve_in_thread, wait_for

pytestmark = pytest.mark.integration

OVERLAY = "dev"
STORE = "bookings"
PARTITIONS = 6
ROWS = {f"C{i:04d}": {"customer": i, "fare": round(10 + i * 1.5, 2)} for i in range(60)} | {"東京/1": {"x": 1}}
PROBE_PERIOD_CAP_S = 2.0  # the kubelet's periodSeconds, capped so the test does not idle
HOST_PORT = re.compile(r"([A-Za-z0-9][A-Za-z0-9.-]*):(\d+)")


# The stand-in API server's Kubernetes Nodes: pods are scheduled on them in turn.
KUBERNETES_NODES = {"worker-a": "zone-a", "worker-b": "zone-b"}
TOKEN = "stand-in-service-account-token"


@dataclass
class Pod:
    name: str
    ip: str
    workload: Obj
    node_name: str = ""
    volumes: dict[str, Path] = field(default_factory=dict)
    procs: dict[str, Proc] = field(default_factory=dict)

    @property
    def spec(self) -> Obj:
        return dict(pod_template(self.workload)["spec"])

    @property
    def labels(self) -> dict[str, str]:
        return dict(pod_template(self.workload)["metadata"]["labels"])

    @property
    def subdomain(self) -> str | None:
        return self.workload["spec"].get("serviceName") if self.workload["kind"] == "StatefulSet" else None


class LocalCluster:
    """The overlay's Deployments and StatefulSets as local processes; Services and DNS as a lookup table."""

    def __init__(self, objs: list[Obj], tmp: Path, api_url: str = "") -> None:
        self.objs = objs
        self.tmp = tmp
        self.api_url = api_url  # the stand-in Kubernetes API
        self.namespace = next(o for o in objs if o["kind"] == "Namespace")["metadata"]["name"]
        self.pods: list[Pod] = []
        self._net = f"127.{random.randint(64, 250)}.{random.randint(1, 250)}."
        self.http = httpx.Client(timeout=5.0, trust_env=False)

    # --- scheduling ---------------------------------------------------------------------------------

    def schedule(self, kind: str, name: str) -> list[Pod]:
        workload = find(self.objs, kind, name)
        if kind == "StatefulSet":
            names = [f"{name}-{i}" for i in range(workload["spec"]["replicas"])]
        else:  # a Deployment without `replicas` is sized by its autoscaler's minimum
            count = workload["spec"].get("replicas") or self._autoscaler_minimum(kind, name)
            names = [f"{name}-5f8d9c7b6-{'abcde'[i]}x{i}" for i in range(count)]
        pods = []
        for pod_name in names:
            node_name = list(KUBERNETES_NODES)[len(self.pods) % len(KUBERNETES_NODES)]
            pod = Pod(pod_name, f"{self._net}{len(self.pods) + 2}", workload, node_name)
            self._mount(pod)
            self.pods.append(pod)
            pods.append(pod)
        return pods

    def _autoscaler_minimum(self, kind: str, name: str) -> int:
        for hpa in of_kind(self.objs, "HorizontalPodAutoscaler"):
            if hpa["spec"]["scaleTargetRef"]["kind"] == kind and hpa["spec"]["scaleTargetRef"]["name"] == name:
                return int(hpa["spec"]["minReplicas"])
        return 1

    def _mount(self, pod: Pod) -> None:
        for template in pod.workload["spec"].get("volumeClaimTemplates", []):
            claim = f"{template['metadata']['name']}-{pod.name}"  # the PVC a StatefulSet creates
            pod.volumes[template["metadata"]["name"]] = self._dir("claims", claim)
        for volume in pod.spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                pvc = find(self.objs, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
                pod.volumes[volume["name"]] = self._dir("claims", pvc["metadata"]["name"])
            elif "emptyDir" in volume:
                pod.volumes[volume["name"]] = self._dir("pods", pod.name, volume["name"])
            elif "configMap" in volume:
                folder = self._dir("pods", pod.name, volume["name"])
                for key, text in find(self.objs, "ConfigMap", volume["configMap"]["name"])["data"].items():
                    (folder / key).write_text(text)
                pod.volumes[volume["name"]] = folder
            elif "secret" in volume:
                # The Secret's keys (or the listed items) as files; an optional Secret that is missing: none.
                folder = self._dir("pods", pod.name, volume["name"])
                source = volume["secret"]
                name = source["secretName"]
                found = [o for o in self.objs if o["kind"] == "Secret" and o["metadata"]["name"] == name]
                assert found or source.get("optional"), f"{pod.name}: Secret {name} does not exist"
                data = dict(found[0].get("data") or {}) if found else {}
                items = source.get("items") or [{"key": key, "path": key} for key in data]
                for item in items:
                    (folder / item["path"]).write_text(data[item["key"]])
                pod.volumes[volume["name"]] = folder
            elif "projected" in volume:
                # A service-account token and the cluster's CA, as the kubelet projects them.
                folder = self._dir("pods", pod.name, volume["name"])
                for source in volume["projected"]["sources"]:
                    if "serviceAccountToken" in source:
                        (folder / source["serviceAccountToken"]["path"]).write_text(TOKEN)
                    elif source.get("configMap", {}).get("name") == "kube-root-ca.crt":
                        for item in source["configMap"]["items"]:
                            (folder / item["path"]).write_text("stand-in CA (the stand-in API is plain http)\n")
                    else:
                        raise AssertionError(f"{pod.name}: no stand-in for projected source {source}")
                pod.volumes[volume["name"]] = folder
            else:
                raise AssertionError(f"{pod.name}: no stand-in for volume {volume}")

    def _dir(self, *parts: str) -> Path:
        path = self.tmp.joinpath(*parts)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def claim(self, name: str) -> Path:
        return self._dir("claims", name)

    # --- DNS and Services -----------------------------------------------------------------------------

    def resolve(self, host: str, port: int) -> tuple[str, int] | None:
        """Where a connection to host:port from inside the namespace ends up, or None for other names."""
        suffixes = (
            "",
            f".{self.namespace}",
            f".{self.namespace}.svc",
            f".{self.namespace}.svc.cluster.local",
        )
        for svc in of_kind(self.objs, "Service"):
            name = svc["metadata"]["name"]
            backends = [p for p in self.pods if selects(svc["spec"]["selector"], p.labels)]
            for suffix in suffixes:
                for pod in backends:
                    if pod.subdomain == name and host == f"{pod.name}.{name}{suffix}":
                        return pod.ip, port  # a pod's own DNS name: its IP, the port as dialled
                if host == name + suffix:
                    assert backends, f"Service {name} has no pods here"
                    pod = backends[0]
                    if svc["spec"].get("clusterIP") == "None":
                        return pod.ip, port
                    [entry] = [p for p in svc["spec"]["ports"] if p["port"] == port]
                    return pod.ip, self.container_port(pod, entry.get("targetPort", port))
        return None

    def rewrite(self, text: str) -> str:
        def one(m: re.Match[str]) -> str:
            found = self.resolve(m.group(1), int(m.group(2)))
            return m.group(0) if found is None else f"{found[0]}:{found[1]}"

        return HOST_PORT.sub(one, text)

    @staticmethod
    def container_port(pod: Pod, port: int | str) -> int:
        for c in pod.spec["containers"]:
            for p in c.get("ports", []):
                if port in (p.get("name"), p["containerPort"]):
                    return int(p["containerPort"])
        raise AssertionError(f"{pod.name} declares no port {port!r}")

    # --- containers -----------------------------------------------------------------------------------

    def container_env(self, pod: Pod, container: Obj) -> dict[str, str]:
        fields = {
            "metadata.name": pod.name,
            "metadata.namespace": self.namespace,
            "status.podIP": pod.ip,
            "spec.nodeName": pod.node_name,
        }
        env = resolve_env(container, fields.__getitem__, self.objs)
        return {k: self._localize(pod, container, v) for k, v in env.items()}

    def _localize(self, pod: Pod, container: Obj, value: str) -> str:
        if value in ("0.0.0.0", "::"):
            return pod.ip
        for mount in container.get("volumeMounts", []):
            path = mount["mountPath"].rstrip("/")
            if value == path or value.startswith(path + "/"):
                return str(pod.volumes[mount["name"]]) + value[len(path) :]
        return self.rewrite(value)

    def start(self, pod: Pod) -> None:
        for container in pod.spec.get("initContainers", []):
            env = {**self.container_env(pod, container), "KEYROUTE_API_URL": self.api_url}
            for mount in container.get("volumeMounts", []):
                if mount["mountPath"] == str(SERVICE_ACCOUNT_DIR):  # read there by default, named by no argument
                    env["KEYROUTE_SERVICE_ACCOUNT_DIR"] = str(pod.volumes[mount["name"]])
            argv = [self._localize(pod, container, a) for a in resolve_argv(container, env)]
            assert argv[0] == "keyroute", f"{pod.name}/{container['name']} runs {argv[0]}, not the image's keyroute"
            log = self.tmp / f"{pod.name}.{container['name']}.log"
            proc = pod.procs[container["name"]] = Proc(argv[1:], log, env=env).start()
            assert proc.popen is not None
            assert proc.popen.wait(timeout=60) == 0, f"init container {pod.name}/{container['name']}: {proc.output()}"
        for container in pod.spec["containers"]:
            env = self.container_env(pod, container)
            argv = [self._localize(pod, container, a) for a in resolve_argv(container, env)]
            assert argv[0] == "keyroute", f"{pod.name}/{container['name']} runs {argv[0]}, not the image's keyroute"
            log = self.tmp / f"{pod.name}.{container['name']}.log"
            pod.procs[container["name"]] = Proc(argv[1:], log, env=env).start()

    # --- the kubelet's probes -------------------------------------------------------------------------

    def probe(self, pod: Pod, container: Obj, kind: str) -> bool:
        spec = container[kind]
        timeout_s = float(spec.get("timeoutSeconds", 1))
        if "httpGet" in spec:
            get = spec["httpGet"]
            port = self.container_port(pod, get["port"])
            url = f"{get.get('scheme', 'HTTP').lower()}://{pod.ip}:{port}{get.get('path', '/')}"
            try:
                status = self.http.get(url, timeout=timeout_s).status_code
            except httpx.HTTPError:
                return False
            return 200 <= status < 400
        if "exec" in spec:
            # Run where the container would; inside the pod, 127.0.0.1 is the pod itself.
            command = [part.replace("127.0.0.1", pod.ip) for part in spec["exec"]["command"]]
            try:
                return subprocess.run(command, capture_output=True, timeout=timeout_s, check=False).returncode == 0
            except subprocess.TimeoutExpired:
                return False
        if "tcpSocket" in spec:
            try:
                socket.create_connection(
                    (pod.ip, self.container_port(pod, spec["tcpSocket"]["port"])), timeout_s
                ).close()
            except OSError:
                return False
            return True
        raise AssertionError(f"{pod.name}: unsupported probe {spec}")

    def wait_probe(self, pod: Pod, kind: str, timeout_s: float) -> None:
        for container in pod.spec["containers"]:
            if kind not in container:
                continue
            period = min(float(container[kind].get("periodSeconds", 10)), PROBE_PERIOD_CAP_S)

            def passed_or_exited(c: Obj = container) -> bool:
                return self.probe(pod, c, kind) or self._a_process_exited(pod)

            wait_for(
                passed_or_exited,
                timeout_s=timeout_s,
                interval_s=period,
                message=f"{kind} of {pod.name}/{container['name']}",
            )
            assert self.probe(pod, container, kind), f"{pod.name}: a process exited\n{self.logs()}"

    def _a_process_exited(self, pod: Pod) -> bool:
        """Lets a wait end early when a container's process has died (the probe assert then shows why)."""
        return any(not p.alive for p in self.running(pod).values())

    def wait_ready(self, pod: Pod, timeout_s: float = 90.0) -> None:
        """Startup probe first (the kubelet holds the others back until it passes), then readiness."""
        self.wait_probe(pod, "startupProbe", timeout_s)
        self.wait_probe(pod, "readinessProbe", timeout_s)

    def alive(self, pod: Pod) -> bool:
        return all(self.probe(pod, c, "livenessProbe") for c in pod.spec["containers"] if "livenessProbe" in c)

    def running(self, pod: Pod) -> dict[str, Proc]:
        """The processes of the pod's containers (its init containers have exited)."""
        return {c["name"]: pod.procs[c["name"]] for c in pod.spec["containers"] if c["name"] in pod.procs}

    # --- teardown -------------------------------------------------------------------------------------

    def stop(self, pods: list[Pod]) -> dict[str, int | None]:
        """What the kubelet does to a deleted pod: one SIGTERM to each container, then SIGKILL if it is
        still running when the termination grace period is over. Returns each container's exit code."""
        procs = [
            (pod, name, proc) for pod in pods for name, proc in self.running(pod).items() if proc.popen is not None
        ]
        for _, _, proc in procs:
            if proc.alive:
                proc.popen.terminate()  # type: ignore[union-attr]
        codes: dict[str, int | None] = {}
        for pod, name, proc in procs:
            assert proc.popen is not None
            try:
                proc.popen.wait(timeout=float(pod.spec.get("terminationGracePeriodSeconds", 30)))
            except subprocess.TimeoutExpired:
                proc.kill9()
            codes[f"{pod.name}/{name}"] = proc.popen.returncode
        return codes

    def logs(self) -> str:
        return "\n".join(
            f"----- {pod.name}/{name} -----\n{proc.output()[-6000:]}"
            for pod in self.pods
            for name, proc in pod.procs.items()
        )

    def close(self) -> None:
        # The namespace goes away: whatever still runs has nobody left to hand over to.
        for pod in self.pods:
            for proc in pod.procs.values():
                if proc.alive:
                    proc.kill9()
        self.http.close()


def write_snapshot(root: Path) -> tuple[str, dict[str, int]]:
    """Version 1 of STORE under `root` in the keyroute snapshot format: its path, and each key's partition."""
    snapshot = version_dir(str(root), STORE, 1)
    rows: dict[int, list[tuple[str, Any]]] = {p: [] for p in range(PARTITIONS)}
    partition_of = {}
    for text, value in ROWS.items():
        key = parse_key(KeyFormat.STRING, text)
        partition_of[key.text] = partition_for(Partitioner.MURMUR2, key.data, PARTITIONS)
        rows[partition_of[key.text]].append((key.text, value))
    for p, items in rows.items():
        folder = partition_dir(snapshot, p)
        folder.mkdir(parents=True)
        with open(folder / "part-00000.json", "w", encoding="utf-8") as fh:
            for text, value in sorted(items):
                fh.write(json.dumps({"key": text, "value": value}, ensure_ascii=False) + "\n")
    counts = tuple(len(rows[p]) for p in range(PARTITIONS))
    manifest = Manifest(STORE, 1, PARTITIONS, Partitioner.MURMUR2, KeyFormat.STRING, ("customer", "fare"), counts)
    write_manifest(snapshot, manifest)
    return str(snapshot), partition_of


@contextmanager
def kubernetes_api() -> Iterator[str]:
    """The stand-in API server: GET /api/v1/nodes/{name} for KUBERNETES_NODES, to the projected token only."""

    async def get_node(request: Request) -> JSONResponse:
        name = request.path_params["name"]
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            return JSONResponse({"kind": "Status", "message": "Unauthorized", "code": 401}, status_code=401)
        if name not in KUBERNETES_NODES:
            return JSONResponse({"kind": "Status", "message": f'nodes "{name}" not found'}, status_code=404)
        labels = {"kubernetes.io/hostname": name, "topology.kubernetes.io/zone": KUBERNETES_NODES[name]}
        return JSONResponse({"kind": "Node", "metadata": {"name": name, "labels": labels}})

    with serve_in_thread(HttpServer(Starlette(routes=[Route("/api/v1/nodes/{name}", get_node)]))) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalCluster]:
    # Pods see only what the manifests give them: nothing KEYROUTE_* leaks in from this process.
    for name in [n for n in os.environ if n.startswith("KEYROUTE_")]:
        monkeypatch.delenv(name)
    with kubernetes_api() as api_url:
        c = LocalCluster(render(OVERLAY), tmp_path, api_url)
        try:
            yield c
        finally:
            c.close()
            print(c.logs())  # shown only when the test failed


def test_the_dev_overlay_serves_a_key_through_its_load_balancer(cluster: LocalCluster) -> None:
    # ZooKeeper: the StatefulSet's pod, its container stood in for by the embedded server at the pod's IP
    # and the container's client port, judged ready by the container's own exec probes.
    [zk_pod] = cluster.schedule("StatefulSet", "keyroute-zookeeper")
    [zk_container] = zk_pod.spec["containers"]
    data_mount = next(m for m in zk_container["volumeMounts"] if m["mountPath"] == "/data")
    server = EmbeddedZooKeeper(
        port=cluster.container_port(zk_pod, "client"),
        data_dir=zk_pod.volumes[data_mount["name"]],
        host=zk_pod.ip,
    )
    server.start()
    try:
        wait_for(lambda: cluster.probe(zk_pod, zk_container, "readinessProbe"), timeout_s=30, message="srvr")
        assert cluster.probe(zk_pod, zk_container, "livenessProbe")

        nodes = cluster.schedule("StatefulSet", "keyroute-node")
        routers = cluster.schedule("Deployment", "keyroute-router")
        assert [p.name for p in nodes] == ["keyroute-node-0", "keyroute-node-1"] and len(routers) == 1

        # Publish a store as the pipeline would: a snapshot on the shared claim, a record in ZooKeeper at
        # the chroot the manifests name (KEYROUTE_ZK=keyroute-zookeeper:2181/keyroute).
        node_env = cluster.container_env(nodes[0], nodes[0].spec["containers"][0])
        settings = ZkSettings.parse(node_env["KEYROUTE_ZK"])
        assert settings.hosts == f"{zk_pod.ip}:2181" and settings.chroot == "/keyroute"
        snapshot, partition_of = write_snapshot(cluster.claim("keyroute-shared") / "snapshots")
        record = StoreRecord(
            name=STORE,
            partitions=PARTITIONS,
            partitioner=Partitioner.MURMUR2,
            key_format=KeyFormat.STRING,
            version=1,
            snapshot=snapshot,
            value_columns=("customer", "fare"),
            replication_factor=2,
            published_at=1.0,
        )
        client = zk.connect(settings)
        try:
            client.create(zk_layout.store_path(STORE), record.to_json())
        finally:
            zk.close(client)

        # `kubectl apply`: every keyroute pod starts at once; the kubelet probes until they are ready.
        for pod in nodes + routers:
            cluster.start(pod)
        for pod in nodes + routers:
            cluster.wait_ready(pod)
        for pod in nodes + routers + [zk_pod]:
            assert cluster.alive(pod), f"liveness probe of {pod.name} fails"

        # Each node registered under its pod name (downward API) at its advertised, stable URL.
        router_pod = routers[0]
        lb = find(cluster.objs, "Service", "keyroute-router")
        assert lb["spec"]["type"] == "LoadBalancer"
        address = cluster.resolve("keyroute-router", lb["spec"]["ports"][0]["port"])
        assert address == (router_pod.ip, cluster.container_port(router_pod, "http"))
        base = f"http://{address[0]}:{address[1]}"
        view = cluster.http.get(f"{base}/admin/partition-map?detail=all").json()
        urls = {n: (v["url"] if isinstance(v, dict) else v) for n, v in view["nodes"].items()}
        assert urls == {p.name: f"http://{p.ip}:{cluster.container_port(p, 'http')}" for p in nodes}
        # ... in the zone of the Kubernetes Node it runs on, which its init container read from the API.
        zones = {n: v["zone"] for n, v in view["nodes"].items()}
        assert zones == {p.name: KUBERNETES_NODES[p.node_name] for p in nodes}
        assert len(set(zones.values())) == 2

        # Reads through the one client address, answered in one hop by a node that serves the partition.
        for key in ["C0000", "C0007", "C0042", "C0059", "東京/1"]:
            response = cluster.http.get(f"{base}/stores/{STORE}/keys/{quote(key, safe='')}")
            assert response.status_code == 200, response.text
            body = response.json()
            assert (body["key"], body["value"], body["version"]) == (key, ROWS[key], 1)
            assert body["partition"] == partition_of[key]
            assert response.headers["X-Keyroute-Node"] in {p.name for p in nodes}
            assert response.headers["X-Keyroute-Hops"] == "0"
        missing = cluster.http.get(f"{base}/stores/{STORE}/keys/nobody")
        assert (missing.status_code, missing.json()["error"]) == (404, "key_not_found")
        batch = cluster.http.post(f"{base}/stores/{STORE}/batch-get", json={"keys": ["C0001", "nobody"]})
        assert [r.get("value") for r in batch.json()["results"]] == [ROWS["C0001"], None]

        # Scale the nodes down by one (a StatefulSet removes its highest ordinal): one SIGTERM, the node
        # hands its partitions over, exits 0 within its grace period, and every key is still served.
        assert cluster.stop([nodes[1]]) == {"keyroute-node-1/node": 0}
        for key in ROWS:
            response = cluster.http.get(f"{base}/stores/{STORE}/keys/{quote(key, safe='')}")
            assert response.status_code == 200, (key, response.text)
            assert response.headers["X-Keyroute-Node"] == "keyroute-node-0"
        assert cluster.stop(routers) == {f"{p.name}/router": 0 for p in routers}
    finally:
        server.stop()
