"""Snapshots on object storage, end to end against an S3-API server process (moto's server mode: a mock of
the S3 API, not a real S3; see tests/integration/s3.py).

Every keyroute process here is a real subprocess that gets only the standard environment variables
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION) and `s3://` URIs: the pipeline
writes a version to `--output s3://bucket/prefix`, the nodes load it from there, and every key answers
exactly through the router. The secret key never shows up in any process's output.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from keyroute.cluster import zk, zk_layout
from keyroute.cluster.partition_map import StoreRecord
from keyroute.dev import sample_data
from keyroute.keys.key_format import KeyFormat
from keyroute.keys.partitioner import Partitioner, partition_for
from keyroute.runtime.settings import ZkSettings
from keyroute.storage import snapshot as snapshot_format
from tests.integration.s3 import S3Bucket
from tests.integration.test_end_to_end import expected_latest, expected_positions
from tests.integration.test_node import write_snapshot
from tests.util import Proc, free_port

pytestmark = pytest.mark.integration

FORMAT_2 = "keyroute-snapshot/2"


def format_2_present() -> bool:
    """Snapshot format 2 (ready-to-serve LMDB files) is in the core: keyroute/storage/snapshot.py names it."""
    return any(value == FORMAT_2 for value in vars(snapshot_format).values() if isinstance(value, str))


# --- the harness: pyarrow against the server ------------------------------------------------------------


def test_pyarrow_writes_lists_and_reads_objects(s3_bucket: S3Bucket) -> None:
    fs = s3_bucket.filesystem()
    with fs.open_output_stream(s3_bucket.path("a", "hello.txt")) as out:
        out.write(b"hello, object storage")
    with fs.open_output_stream(s3_bucket.path("a", "b", "big.bin")) as out:
        out.write(bytes(range(256)) * 50_000)  # 12.8 MB: a multipart upload (pyarrow's parts are 10 MiB)
    assert s3_bucket.objects() == ["a/b/big.bin", "a/hello.txt"]
    with fs.open_input_stream(s3_bucket.path("a", "hello.txt")) as stream:
        assert stream.read() == b"hello, object storage"
    with fs.open_input_file(s3_bucket.path("a", "b", "big.bin")) as f:  # ranged reads
        assert f.size() == 256 * 50_000
        f.seek(256 * 40_000 + 7)
        assert f.read(3) == bytes([7, 8, 9])
    fs.delete_dir(s3_bucket.path("a", "b"))
    assert s3_bucket.objects() == ["a/hello.txt"]


def test_buckets_and_prefixes_are_fresh_per_test(s3_bucket: S3Bucket) -> None:
    assert s3_bucket.objects() == []
    assert s3_bucket.uri().startswith(f"s3://{s3_bucket.name}/{s3_bucket.prefix}")


PROBE = """
import sys
from pyarrow import fs
filesystem, path = fs.FileSystem.from_uri(sys.argv[1])
with filesystem.open_output_stream(path) as out:
    out.write(b"written by a subprocess")
with filesystem.open_input_stream(path) as stream:
    print(stream.read().decode())
"""


def run_probe(uri: str, env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    # Only the environment given: nothing AWS_* leaks in from the test's own environment.
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return subprocess.run(
        [sys.executable, "-c", PROBE, uri], env={**base, **env}, capture_output=True, text=True, timeout=120
    )


def test_the_standard_environment_is_all_a_process_needs(s3_bucket: S3Bucket) -> None:
    """What keyroute's processes rely on: `FileSystem.from_uri("s3://...")` picks the endpoint up from
    AWS_ENDPOINT_URL (path-style requests, the URL's http scheme) and the credentials from AWS_*."""
    done = run_probe(s3_bucket.uri("probe", "env.txt"), s3_bucket.env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "written by a subprocess"
    assert "probe/env.txt" in s3_bucket.objects()


def test_an_endpoint_override_in_the_uri_also_reaches_the_server(s3_bucket: S3Bucket) -> None:
    """The alternative pyarrow offers: the endpoint in the URI's query (no AWS_ENDPOINT_URL)."""
    server = s3_bucket.server
    env = {k: v for k, v in s3_bucket.env.items() if k != "AWS_ENDPOINT_URL"}
    uri = s3_bucket.uri("probe", "query.txt") + f"?endpoint_override={server.host}:{server.port}&scheme=http"
    done = run_probe(uri, env)
    assert done.returncode == 0, done.stderr
    assert "probe/query.txt" in s3_bucket.objects()


# --- a cluster whose snapshots are on object storage -----------------------------------------------------


@dataclass
class Cluster:
    router_url: str
    procs: list[Proc] = field(default_factory=list)

    def logs(self) -> str:
        return "\n".join(f"----- {' '.join(p.args[:2])} -----\n{p.output()[-4000:]}" for p in self.procs)


def settled(pmap: dict[str, Any], stores: Mapping[str, int], nodes: int, replication_factor: int) -> bool:
    """Every store published, and every partition served at the published version exactly by its replicas,
    on every node."""
    if set(pmap["stores"]) != set(stores) or len(pmap["nodes"]) != nodes:
        return False
    placed: set[str] = set()
    for name, store in pmap["stores"].items():
        entries = store["partition_map"]
        if len(entries) != stores[name]:
            return False
        for entry in entries:
            serving = {s["node"] for s in entry["serving"] if s["version"] == store["version"]}
            if len(entry["assigned"]) != replication_factor or serving != set(entry["assigned"]):
                return False
            placed.update(entry["assigned"])
    return placed == set(pmap["nodes"])


@contextmanager
def cluster_on(
    tmp_path: Path,
    zk_settings: ZkSettings,
    env: Mapping[str, str],
    stores: Mapping[str, int],
    *,
    nodes: int = 2,
    replication_factor: int = 1,
) -> Iterator[Cluster]:
    """`nodes` node processes and a router, all with `env`; yields once the published stores are served as
    assigned. Logs are printed on the way out (pytest shows them when the test failed)."""
    connect = zk_settings.connect_string
    cluster = Cluster(router_url="")
    try:
        for i in range(nodes):
            port = free_port()
            args = ["node", "--zk", connect, "--node-id", f"node-{i}", "--port", str(port)]
            args += ["--data-dir", str(tmp_path / f"data-node-{i}"), "--zk-session-timeout-s", "4"]
            # DEBUG: the secret-in-logs check then covers everything a node can say about its loading.
            node_env = {**env, "KEYROUTE_LOG_LEVEL": "DEBUG"}
            cluster.procs.append(Proc(args, tmp_path / f"node-{i}.log", env=node_env).start())
        port = free_port()
        router = Proc(["router", "--zk", connect, "--port", str(port)], tmp_path / "router.log", env=dict(env))
        cluster.procs.append(router.start())
        cluster.router_url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            with httpx.Client(timeout=5, trust_env=False) as http:
                if http.get(cluster.router_url + "/readyz").json().get("complete") is not True:
                    return False
                pmap = http.get(cluster.router_url + "/admin/partition-map?detail=all").json()
            return settled(pmap, stores, nodes, min(replication_factor, nodes))

        deadline = time.monotonic() + 180
        while True:
            dead = [p for p in cluster.procs if not p.alive]
            assert not dead, f"{dead[0].args[:2]} exited:\n{dead[0].output()[-3000:]}"
            if _quietly(ready):
                break
            assert time.monotonic() < deadline, "timed out after 180s waiting for every partition to be served"
            time.sleep(0.25)
        yield cluster
    finally:
        for proc in reversed(cluster.procs):
            proc.stop()
        print(cluster.logs())


def _quietly(predicate: Any) -> bool:
    """The predicate's answer; False while the cluster is still coming up (connection refused, ...)."""
    try:
        return bool(predicate())
    except (httpx.HTTPError, ValueError, KeyError):
        return False


def key_url(base: str, store: str, key: Any) -> str:
    text = str(key)
    segment = text.replace(".", "%2E") if text in (".", "..") else quote(text, safe="")
    return f"{base}/stores/{store}/keys/{segment}"


def check_every_key(
    router_url: str, expected: Mapping[str, Mapping[Any, Any]], partitions: Mapping[str, int], version: int
) -> int:
    checked = 0
    with httpx.Client(timeout=10, trust_env=False) as http:
        for store, values in expected.items():
            for key, value in values.items():
                resp = http.get(key_url(router_url, store, key))
                assert resp.status_code == 200, (store, key, resp.text)
                body = resp.json()
                partition = partition_for(Partitioner.MURMUR2, str(key).encode("utf-8"), partitions[store])
                assert body == {
                    "store": store,
                    "key": str(key),
                    "partition": partition,
                    "version": version,
                    "value": value,
                }, (store, key)
                checked += 1
        missing = http.get(key_url(router_url, next(iter(expected)), "no-such-key-anywhere"))
        assert missing.status_code == 404 and missing.json()["error"] == "key_not_found"
    return checked


def assert_secret_never_logged(secret: str, procs: Sequence[Proc], *also: str) -> None:
    assert len(secret) >= 16
    for proc in procs:
        text = proc.output()
        assert text, f"{proc.args[:2]} wrote no output at all (nothing to check)"
        assert secret not in text, f"the secret access key appears in the output of {' '.join(proc.args[:2])}"
    for text in also:
        assert secret not in text


def store_record(zk_settings: ZkSettings, store: str) -> StoreRecord:
    client = zk.connect(zk_settings, ensure_layout=False)
    try:
        raw, _ = client.get(zk_layout.store_path(store))
    finally:
        zk.close(client)
    return StoreRecord.from_json(raw)


ROWS: dict[str, dict[str, Any]] = {
    **{f"C{i:04d}": {"customer": i, "fare": round(10 + i * 1.25, 2)} for i in range(300)},
    "a/b": {"slash": True},
    "東京": {"city": "Tokyo"},
    "x y?#%": {"odd": "chars"},
    "..": {"dots": 2},
}


def test_nodes_load_a_published_snapshot_from_object_storage(
    tmp_path: Path, zk_settings: ZkSettings, s3_bucket: S3Bucket
) -> None:
    """Nodes given only the standard AWS_* variables load a version whose snapshot location is an s3://
    URI (uploaded here by hand, published in ZooKeeper as the pipeline would) and serve every key. The
    snapshot is format 1 (JSON lines, streamed and put row by row); the pipeline test below covers format 2
    (data.mdb files downloaded and verified)."""
    from pyarrow import fs as arrow_fs

    store, partitions = "bookings", 6
    local = write_snapshot(tmp_path / "local", store, ROWS, KeyFormat.STRING, partitions)
    arrow_fs.copy_files(
        local,
        s3_bucket.path(store, "v000001"),
        source_filesystem=arrow_fs.LocalFileSystem(),
        destination_filesystem=s3_bucket.filesystem(),
    )
    snapshot_uri = s3_bucket.uri(store, "v000001")
    # Nodes read it from the bucket only: the local copy is gone.
    shutil.rmtree(tmp_path / "local")
    record = StoreRecord(store, partitions, Partitioner.MURMUR2, KeyFormat.STRING, 1, snapshot_uri, ("v",), 2, 1.0)
    client = zk.connect(zk_settings)
    try:
        client.create(zk_layout.store_path(store), record.to_json(), makepath=True)
    finally:
        zk.close(client)

    expected = {store: ROWS}
    with cluster_on(tmp_path, zk_settings, s3_bucket.env, {store: partitions}, replication_factor=2) as cluster:
        assert check_every_key(cluster.router_url, expected, {store: partitions}, 1) == len(ROWS)
        procs = cluster.procs
    assert_secret_never_logged(s3_bucket.secret_key, procs, store_record(zk_settings, store).to_json().decode())


EVENTS = 3_000
PIPELINE_PARTITIONS = {"bookings": 8, "positions": 4}


@pytest.mark.skipif(
    not format_2_present(),
    reason="snapshot format 2 (keyroute-snapshot/2: executors build LMDB files and upload them with "
    "pyarrow.fs) is not in keyroute/storage/snapshot.py yet",
)
def test_pipeline_builds_into_object_storage_and_nodes_serve_it(
    tmp_path: Path, zk_settings: ZkSettings, s3_bucket: S3Bucket
) -> None:
    """`keyroute pipeline build --output s3://bucket/prefix` -> format-2 files and manifest in the bucket ->
    nodes fetch and verify them -> every key exact through the router; the secret is in nobody's output."""
    files = sample_data.generate(tmp_path / "events", events=EVENTS)
    spec = tmp_path / "stores.toml"
    spec.write_text(sample_data.spec_toml(files, partitions=PIPELINE_PARTITIONS["bookings"], replication_factor=2))
    output = s3_bucket.uri()
    pipeline = Proc(
        [
            "pipeline",
            "build",
            "--spec",
            str(spec),
            "--zk",
            zk_settings.connect_string,
            "--output",
            output,
            "--master",
            "local[2]",
        ],
        tmp_path / "pipeline.log",
        env=s3_bucket.env,
    ).start()
    assert pipeline.popen is not None
    try:
        code = pipeline.popen.wait(timeout=280)
    finally:
        pipeline.stop()
    assert code == 0, pipeline.output()[-6000:]

    # The bucket holds exactly one complete format-2 version per store: a data.mdb per partition (empty
    # partitions included), no lock files, and the manifest.
    keys = s3_bucket.objects()
    fs = s3_bucket.filesystem()
    for store, partitions in PIPELINE_PARTITIONS.items():
        folder = f"{store}/v000001"
        with fs.open_input_stream(s3_bucket.path(folder, "manifest.json")) as stream:
            manifest = json.loads(stream.read())
        assert manifest["format"] == FORMAT_2 and manifest["partitions"] == partitions
        expected_files = {f"{folder}/partition={p}/data.mdb" for p in range(partitions)}
        assert {k for k in keys if k.startswith(folder + "/partition=")} == expected_files, keys
        assert not [k for k in keys if k.endswith("lock.mdb")]
        sizes = {int(p): n for p, n in _by_partition(manifest["bytes"]).items()}
        for p in range(partitions):
            info = fs.get_file_info(s3_bucket.path(folder, f"partition={p}", "data.mdb"))
            assert info.size == sizes[p], (store, p)
        record = store_record(zk_settings, store)
        assert record.version == 1
        assert record.snapshot.startswith(output.rstrip("/") + "/"), record.snapshot  # nodes read it there

    expected = {
        "bookings": expected_latest(files.bookings, "customer_id", "ts", ["ts", "route", "fare", "seats"]),
        "positions": expected_positions(files.trades),
    }
    with cluster_on(tmp_path, zk_settings, s3_bucket.env, PIPELINE_PARTITIONS, replication_factor=2) as cluster:
        total = check_every_key(cluster.router_url, expected, PIPELINE_PARTITIONS, 1)
        assert total == sum(len(v) for v in expected.values())
        for special in sample_data.SPECIAL_CUSTOMERS:
            assert special in expected["bookings"]
        procs = cluster.procs
    records = [store_record(zk_settings, s).to_json().decode() for s in PIPELINE_PARTITIONS]
    assert_secret_never_logged(s3_bucket.secret_key, [pipeline, *procs], *records)


def _by_partition(value: Any) -> dict[Any, Any]:
    """A manifest's per-partition field, whether written as a list or as an object keyed by partition."""
    return dict(enumerate(value)) if isinstance(value, list) else dict(value)


# --- the Kubernetes object-storage variant, as rendered, run on this machine ----------------------------


def render_dev_with_object_storage(folder: Path, output: str) -> list[dict[str, Any]]:
    """dev + deploy/k8s/components/object-storage, snapshot root `output`, rendered by real kustomize."""
    import yaml

    from tests.k8s_render import K8S, kubectl

    folder.mkdir(parents=True)
    (folder / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": "keyroute-dev",
                "resources": [os.path.relpath(K8S / "overlays" / "dev", folder)],
                "components": [os.path.relpath(K8S / "components" / "object-storage", folder)],
                "configMapGenerator": [
                    {
                        "name": "keyroute-snapshot-store",
                        "options": {"disableNameSuffixHash": True},
                        "literals": [f"output={output}"],
                    }
                ],
            }
        )
    )
    done = subprocess.run(
        [str(kubectl()), "kustomize", str(folder)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def test_the_object_storage_manifests_run_nodes_that_load_from_the_bucket(
    tmp_path: Path, s3_bucket: S3Bucket, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """The dev overlay with the object-storage component, launched here from the rendered manifests as
    tests/integration/test_k8s_local.py launches dev: the nodes get nothing but what the manifests give
    them (the credentials as the files of the Secrets keyroute-object-store and keyroute-object-store-read,
    created here as an operator would, and AWS_ENDPOINT_URL for an S3-compatible server from the ConfigMap
    keyroute-object-store-settings), load a version published at an s3:// location under the pipeline's configured
    output, and serve it through the LoadBalancer Service."""
    from pyarrow import fs as arrow_fs

    from keyroute.dev.zookeeper_server import EmbeddedZooKeeper
    from tests.integration.test_k8s_local import LocalCluster, kubernetes_api
    from tests.k8s_render import find, pod_template, resolve_env

    for name in [n for n in os.environ if n.startswith(("KEYROUTE_", "AWS_"))]:
        monkeypatch.delenv(name)
    output = s3_bucket.uri()
    objs = render_dev_with_object_storage(tmp_path / "kustomize", output)
    namespace = next(o for o in objs if o["kind"] == "Namespace")["metadata"]["name"]
    # The pipeline's read/write/delete credentials and the nodes' read-only ones: one key pair here (the
    # stand-in S3 server enforces no policy), two Secrets as the manifests name them, each an AWS shared
    # credentials file; the endpoint and region (not secrets) in the ConfigMap beside them.
    credentials = (
        f"[default]\naws_access_key_id = {s3_bucket.server.access_key}\n"
        f"aws_secret_access_key = {s3_bucket.secret_key}\n"
    )
    for secret in ("keyroute-object-store", "keyroute-object-store-read"):
        objs.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": secret, "namespace": namespace},
                # (the kubelet's view of the Secret: values as the container receives them)
                "data": {"credentials": credentials},
            }
        )
    settings = {k: s3_bucket.env[k] for k in ("AWS_ENDPOINT_URL", "AWS_REGION")}
    objs.append(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "keyroute-object-store-settings", "namespace": namespace},
            "data": settings,
        }
    )
    # The pipeline would write under exactly that root, the keys never in its environment.
    cron = pod_template(find(objs, "CronJob", "keyroute-pipeline"))["spec"]["containers"][0]
    pipeline_env = resolve_env(cron, lambda path: {"status.podIP": "10.0.0.7"}.get(path, "x"), objs)
    assert pipeline_env["KEYROUTE_OUTPUT"] == output
    assert s3_bucket.secret_key not in "".join(pipeline_env.values())

    # The nodes' init containers read their zone from the Kubernetes API: the same stand-in as dev's launch.
    api = kubernetes_api()
    cluster = LocalCluster(objs, tmp_path / "cluster", api.__enter__())
    request.addfinalizer(lambda: api.__exit__(None, None, None))
    [zk_pod] = cluster.schedule("StatefulSet", "keyroute-zookeeper")
    [zk_container] = zk_pod.spec["containers"]
    data_mount = next(m for m in zk_container["volumeMounts"] if m["mountPath"] == "/data")
    server = EmbeddedZooKeeper(
        port=cluster.container_port(zk_pod, "client"), data_dir=zk_pod.volumes[data_mount["name"]], host=zk_pod.ip
    )
    server.start()
    try:
        nodes = cluster.schedule("StatefulSet", "keyroute-node")
        routers = cluster.schedule("Deployment", "keyroute-router")
        assert all("shared" not in pod.volumes for pod in nodes)  # no shared claim on nodes
        node_env = cluster.container_env(nodes[0], nodes[0].spec["containers"][0])
        assert node_env["AWS_ENDPOINT_URL"] == s3_bucket.server.endpoint
        # The keys reach the node as the mounted file the AWS SDK reads, not as environment variables.
        assert s3_bucket.secret_key not in "".join(node_env.values())
        assert Path(node_env["AWS_SHARED_CREDENTIALS_FILE"]).read_text() == credentials

        # Publish as the pipeline would: version 1 under the configured output, a record in ZooKeeper.
        store, partitions = "bookings", 6
        local = write_snapshot(tmp_path / "local", store, ROWS, KeyFormat.STRING, partitions)
        arrow_fs.copy_files(
            local,
            s3_bucket.path(store, "v000001"),
            source_filesystem=arrow_fs.LocalFileSystem(),
            destination_filesystem=s3_bucket.filesystem(),
        )
        shutil.rmtree(tmp_path / "local")
        record = StoreRecord(
            store, partitions, Partitioner.MURMUR2, KeyFormat.STRING, 1, f"{output}/{store}/v000001", ("v",), 2, 1.0
        )
        settings = ZkSettings.parse(node_env["KEYROUTE_ZK"])
        client = zk.connect(settings)
        try:
            client.create(zk_layout.store_path(store), record.to_json(), makepath=True)
        finally:
            zk.close(client)

        for pod in nodes + routers:
            cluster.start(pod)
        for pod in nodes + routers:
            cluster.wait_ready(pod, timeout_s=120)

        lb = find(objs, "Service", "keyroute-router")
        address = cluster.resolve("keyroute-router", lb["spec"]["ports"][0]["port"])
        assert address is not None
        base = f"http://{address[0]}:{address[1]}"
        with httpx.Client(timeout=10, trust_env=False) as http:
            for key in ROWS:
                resp = http.get(key_url(base, store, key))
                assert resp.status_code == 200, (key, resp.text)
                assert (resp.json()["value"], resp.json()["version"]) == (ROWS[key], 1)
        procs = [proc for pod in nodes + routers for proc in pod.procs.values()]
        cluster.stop(nodes + routers)
        assert_secret_never_logged(s3_bucket.secret_key, procs)
    finally:
        cluster.close()
        server.stop()
        print(cluster.logs())
