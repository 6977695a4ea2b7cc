"""TLS on every wire in production (components/tls): what each container is given, HTTPS probes, certificates
mounted read-only, ZooKeeper with TLS only on its client port and between members, Spark authenticated; and
the optional cert-manager component issuing exactly the Secrets the pods mount, with the names they need."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import kubernetes_validate
import pytest

from keyroute.cli import build_parser
from keyroute.core.settings import ZkSettings
from tests.k8s_render import K8S, Obj, find, of_kind, pod_template, render, resolve_argv
from tests.unit.k8s.manifests import (
    KUBERNETES_VERSIONS,
    PROD_OVERLAYS,
    container_env,
    container_port,
    executor_template_text,
    host_port_pairs,
    is_custom_resource,
    keyroute_containers,
    spark_confs,
    subcommand,
    zookeeper_cfg,
)
from tests.unit.k8s.test_isolation import render_with
from tests.unit.k8s.test_production import secret_references

MEMBER_OPTIONS = ("tls_cert", "tls_key", "member_ca", "zk_tls_ca", "zk_tls_cert", "zk_tls_key")


@pytest.fixture(scope="module", params=PROD_OVERLAYS)
def prod(request: pytest.FixtureRequest) -> list[Obj]:
    return render(str(request.param))


def parsed(objs: list[Obj], workload: Obj, container: Obj):  # type: ignore[no-untyped-def]
    env = container_env(objs, container, pod_name=f"{workload['metadata']['name']}-0")
    return build_parser(env).parse_args(resolve_argv(container, env)[1:]), env


def mounted_files(workload: Obj, container: Obj) -> dict[str, tuple[str, Obj]]:
    """mount path -> (Secret name, volume) for every Secret volume `container` mounts."""
    volumes = {v["name"]: v for v in pod_template(workload)["spec"].get("volumes", []) if "secret" in v}
    found = {}
    for mount in container.get("volumeMounts", []):
        if mount["name"] in volumes:
            assert mount.get("readOnly") is True, f"{container['name']}: {mount['mountPath']} is writable"
            volume = volumes[mount["name"]]
            assert volume["secret"]["defaultMode"] == 0o440, volume
            found[mount["mountPath"]] = (volume["secret"]["secretName"], volume)
    return found


def secret_of(path: str, mounts: dict[str, tuple[str, Obj]]) -> str:
    [name] = [secret for where, (secret, _) in mounts.items() if path.startswith(where.rstrip("/") + "/")]
    return name


def test_routers_and_nodes_serve_https_and_speak_tls_to_members_and_zookeeper(prod: list[Obj]) -> None:
    seen = set()
    for w, c in keyroute_containers(prod):
        command = subcommand(c)
        if command not in (["router"], ["node"]):
            continue
        args, env = parsed(prod, w, c)
        mounts = mounted_files(w, c)
        for option in MEMBER_OPTIONS:
            value = getattr(args, option)
            assert value, f"{c['name']}: --{option.replace('_', '-')} is not given"
            assert secret_of(str(value), mounts) == f"keyroute-{command[0]}-tls"
        # Every probe over HTTPS.
        probes = [c[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe") if kind in c]
        assert probes and all(p["scheme"] == "HTTPS" for p in probes), c["name"]
        if command == ["node"]:
            assert env["KEYROUTE_ADVERTISE_URL"].startswith("https://")
        seen.add(command[0])
    assert seen == {"router", "node"}


def test_the_pipeline_speaks_tls_to_zookeeper_and_authenticates_spark(prod: list[Obj]) -> None:
    [(w, c)] = [(w, c) for w, c in keyroute_containers(prod) if subcommand(c) == ["pipeline", "build"]]
    args, env = parsed(prod, w, c)
    mounts = mounted_files(w, c)
    for option in ("zk_tls_ca", "zk_tls_cert", "zk_tls_key"):
        assert secret_of(str(getattr(args, option)), mounts) == "keyroute-pipeline-tls"
    secret_file = str(args.spark_secret_file)
    assert secret_of(secret_file, mounts) == "keyroute-spark-auth"
    # Executors mount the same Secret at the same path (Spark reads the file on both sides on Kubernetes).
    confs = spark_confs(env["PYSPARK_SUBMIT_ARGS"])
    assert confs["spark.kubernetes.executor.secrets.keyroute-spark-auth"] == str(Path(secret_file).parent)
    assert "keyroute-spark-auth" not in executor_template_text(prod)  # mounted by Spark, not the template


def test_zookeeper_serves_tls_only_to_clients_and_between_members(prod: list[Obj]) -> None:
    sts = find(prod, "StatefulSet", "keyroute-zookeeper")
    [zk] = pod_template(sts)["spec"]["containers"]
    cfg = zookeeper_cfg(zk)
    client = container_port(zk, "client")
    assert int(cfg["secureClientPort"]) == client and cfg["secureClientPortAddress"] == "0.0.0.0"
    assert cfg["serverCnxnFactory"] == "org.apache.zookeeper.server.NettyServerCnxnFactory"
    assert cfg["ssl.clientAuth"] == "need"
    assert cfg["sslQuorum"] == "true" and cfg["sslQuorumReloadCertFiles"] == "true"
    assert cfg["client.certReload"] == "true"
    # Members check each other's host names too, not only the CA: a certificate of the cluster CA alone
    # (a router's, a node's) does not join the ensemble.
    assert cfg["ssl.hostnameVerification"] == cfg["ssl.quorum.hostnameVerification"] == "true"
    # No plaintext port anywhere but the pod's loopback: not in the servers' lines, not a container port.
    assert cfg["clientPortAddress"] == "127.0.0.1"
    assert int(cfg["clientPort"]) not in [p["containerPort"] for p in zk["ports"]]
    env = {e["name"]: e.get("value", "") for e in zk["env"]}
    assert all(";" not in server for server in env["ZOO_SERVERS"].split())
    mounts = mounted_files(sts, zk)
    for key in (
        "ssl.keyStore.location",
        "ssl.trustStore.location",
        "ssl.quorum.keyStore.location",
        "ssl.quorum.trustStore.location",
    ):
        assert secret_of(cfg[key], mounts) == "keyroute-zookeeper-tls"
        assert cfg[key.replace("location", "type")] == "PEM"
    # Every address keyroute connects to is that TLS port.
    for w, c in keyroute_containers(prod):
        _, env = parsed(prod, w, c)
        assert [port for _, port in host_port_pairs(ZkSettings.parse(env["KEYROUTE_ZK"]).hosts)] == [client]


def test_scrapes_of_routers_and_nodes_are_https_with_a_client_certificate(prod: list[Obj]) -> None:
    for name in ("keyroute-router", "keyroute-node"):
        [endpoint] = find(prod, "PodMonitor", name)["spec"]["podMetricsEndpoints"]
        assert endpoint["scheme"] == "https"
        assert endpoint["tlsConfig"]["keySecret"]["name"] == "keyroute-monitoring-tls"
        assert endpoint["tlsConfig"]["serverName"] == f"{name}.cluster"


def test_development_stays_plain() -> None:
    for w, c in keyroute_containers(render("dev")):
        assert not mounted_files(w, c)
        names = {e["name"] for e in c.get("env", [])}
        assert not {"KEYROUTE_TLS_CERT", "KEYROUTE_ZK_TLS_CA", "KEYROUTE_SPARK_SECRET_FILE"} & names


def test_cert_manager_issues_every_mounted_secret_with_the_names_clients_check(tmp_path: Path) -> None:
    objs = render_with(
        tmp_path, [K8S / "overlays" / "prod"], [K8S / "components" / "cert-manager"], "keyroute", unset_only=True
    )
    for obj in objs:
        if not is_custom_resource(obj) and not obj["apiVersion"].startswith("cert-manager.io/"):
            kubernetes_validate.validate(obj, KUBERNETES_VERSIONS[-1], strict=True)
    certificates = {(c["metadata"].get("namespace"), c["spec"]["secretName"]): c for c in of_kind(objs, "Certificate")}
    mounted = set()
    for w in [*of_kind(objs, "StatefulSet"), *of_kind(objs, "Deployment"), *of_kind(objs, "CronJob")]:
        for name, _ in secret_references(pod_template(w)["spec"]):
            if name.endswith("-tls"):
                mounted.add((w["metadata"]["namespace"], name))
    mounted |= {("keyroute", "keyroute-monitoring-tls")}
    assert mounted <= set(certificates), sorted(mounted - set(certificates))
    for (_, name), cert in certificates.items():
        if name == "keyroute-ca":
            continue
        spec = cert["spec"]
        assert spec["issuerRef"] == {"name": "keyroute-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
        assert spec["privateKey"]["encoding"] == "PKCS8" and spec["privateKey"]["rotationPolicy"] == "Always"
        assert "client auth" in spec["usages"]
    zk = certificates[("keyroute", "keyroute-zookeeper-tls")]["spec"]
    assert {"type": "CombinedPEM"} in zk["additionalOutputFormats"]

    def covered(cert: Obj, host: str) -> bool:
        return any(
            fnmatch.fnmatch(host, pattern) and pattern.count(".") == host.count(".")
            for pattern in cert["spec"]["dnsNames"]
        )

    # The host names keyroute's clients check: ZooKeeper's address, each node's advertised address, and
    # the role names of members.
    for w, c in keyroute_containers(objs):
        _, env = parsed(objs, w, c)
        for host, _ in host_port_pairs(ZkSettings.parse(env["KEYROUTE_ZK"]).hosts):
            assert covered(certificates[("keyroute", "keyroute-zookeeper-tls")], host), host
        if "KEYROUTE_ADVERTISE_URL" in env:
            [(host, _)] = host_port_pairs(env["KEYROUTE_ADVERTISE_URL"])
            assert covered(certificates[("keyroute", "keyroute-node-tls")], host), host
    assert covered(certificates[("keyroute", "keyroute-node-tls")], "keyroute-node.cluster")
    assert covered(certificates[("keyroute", "keyroute-router-tls")], "keyroute-router.cluster")
    ca = certificates[("cert-manager", "keyroute-ca")]["spec"]
    assert (
        ca["isCA"] is True and find(objs, "ClusterIssuer", "keyroute-ca")["spec"]["ca"]["secretName"] == "keyroute-ca"
    )
