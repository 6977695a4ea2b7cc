"""TLS on every wire in production (components/tls): what each container is given, HTTPS probes, certificates
mounted read-only, ZooKeeper with TLS only on its client port and between members, Spark authenticated; and
its certificates from cert-manager (components/cert-manager, which prod lists): a namespaced Issuer per CA
(members' and clients'), the Secrets the pods mount issued with the names they need, and each router's and
node's certificate, one per pod, naming its own id."""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from keyroute.auth.security import MemberIdentity, member_identity
from keyroute.cli import build_parser
from keyroute.runtime.settings import ZkSettings
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
        # All from the pod's own certificate (csi-driver), never a Secret shared by the workload's pods.
        csi_volume(w, c)
        for option in MEMBER_OPTIONS:
            value = getattr(args, option)
            assert value, f"{c['name']}: --{option.replace('_', '-')} is not given"
            assert str(value).startswith("/etc/keyroute/tls/"), (c["name"], option, value)
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


@pytest.fixture(scope="module", params=PROD_OVERLAYS)
def with_cert_manager(request: pytest.FixtureRequest) -> list[Obj]:
    return render(str(request.param))


def test_components_tls_alone_gives_routers_and_nodes_no_shared_certificate(tmp_path: Path) -> None:
    """Without components/cert-manager, routers and nodes mount a volume no pod has: refused at apply, rather
    than started with one certificate for all, which names no pod's own id."""
    objs = render_with(tmp_path, [K8S / "base"], [K8S / "components" / "tls"], "keyroute")
    for kind, name in (("Deployment", "keyroute-router"), ("StatefulSet", "keyroute-node")):
        spec = pod_template(find(objs, kind, name))["spec"]
        [c] = spec["containers"]
        assert "/etc/keyroute/tls" in {m["mountPath"] for m in c["volumeMounts"]}
        assert "tls" not in {v["name"] for v in spec.get("volumes", [])}, name


def csi_volume(workload: Obj, container: Obj) -> Obj:
    """The csi-driver volume `container` mounts its certificate from (at /etc/keyroute/tls), read-only."""
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == "/etc/keyroute/tls"]
    assert mount.get("readOnly") is True
    [volume] = [v for v in pod_template(workload)["spec"]["volumes"] if v["name"] == mount["name"]]
    assert set(volume) == {"name", "csi"}, volume  # no Secret left beside it
    assert volume["csi"]["driver"] == "csi.cert-manager.io" and volume["csi"]["readOnly"] is True
    return dict(volume["csi"]["volumeAttributes"])


def certificate_of_pod(attributes: Obj, pod_name: str, namespace: str) -> dict[str, Any]:
    """The subject alternative names csi-driver requests for the pod `pod_name`, as `getpeercert()` lists
    them (csi-driver fills in ${POD_NAME} and ${POD_NAMESPACE})."""

    def names(key: str) -> list[str]:
        text = attributes.get(key, "").replace("${POD_NAME}", pod_name).replace("${POD_NAMESPACE}", namespace)
        return [n.strip() for n in text.split(",") if n.strip()]

    dns = [("DNS", n) for n in names("csi.cert-manager.io/dns-names")]
    return {"subjectAltName": (*dns, *[("URI", n) for n in names("csi.cert-manager.io/uri-sans")])}


def covers(names: list[str], host: str) -> bool:
    return any(fnmatch.fnmatch(host, n) and n.count(".") == host.count(".") for n in names)


def test_cert_manager_has_a_namespaced_issuer_per_ca_and_issues_every_mounted_secret(
    with_cert_manager: list[Obj],
) -> None:
    objs = with_cert_manager
    for obj in objs:
        if not is_custom_resource(obj) and not obj["apiVersion"].startswith("cert-manager.io/"):
            kubernetes_validate.validate(obj, KUBERNETES_VERSIONS[-1], strict=True)
    assert not of_kind(objs, "ClusterIssuer")
    issuers = {(i["metadata"]["namespace"], i["metadata"]["name"]): i["spec"] for i in of_kind(objs, "Issuer")}
    assert issuers == {
        ("keyroute", "keyroute-selfsigned"): {"selfSigned": {}},
        ("keyroute", "keyroute-member-ca"): {"ca": {"secretName": "keyroute-member-ca"}},
        ("keyroute", "keyroute-client-ca"): {"ca": {"secretName": "keyroute-client-ca"}},
    }
    certificates = {(c["metadata"]["namespace"], c["spec"]["secretName"]): c for c in of_kind(objs, "Certificate")}
    # Two CAs: each a root of its own, its key in the serving namespace only.
    for ca in ("keyroute-member-ca", "keyroute-client-ca"):
        spec = certificates[("keyroute", ca)]["spec"]
        assert spec["isCA"] is True
        assert spec["issuerRef"] == {"name": "keyroute-selfsigned", "kind": "Issuer", "group": "cert-manager.io"}
    for (namespace, name), cert in certificates.items():
        assert namespace == "keyroute", name  # a namespaced Issuer signs only in its own namespace
        spec = cert["spec"]
        assert spec["issuerRef"]["kind"] == "Issuer" and (namespace, spec["issuerRef"]["name"]) in issuers
        if not spec.get("isCA"):
            assert spec["privateKey"]["encoding"] == "PKCS8" and spec["privateKey"]["rotationPolicy"] == "Always"
            assert "client auth" in spec["usages"]
    issuer = {name: c["spec"]["issuerRef"]["name"] for (_, name), c in certificates.items()}
    assert issuer["keyroute-zookeeper-tls"] == issuer["keyroute-monitoring-tls"] == "keyroute-member-ca"
    assert issuer["keyroute-client-tls"] == "keyroute-client-ca"
    zk = certificates[("keyroute", "keyroute-zookeeper-tls")]["spec"]
    assert {"type": "CombinedPEM"} in zk["additionalOutputFormats"]
    # Every Secret of a certificate mounted is issued here, but the pipeline's: an Issuer in its namespace
    # would need a CA key where its Spark driver creates pods (components/cert-manager/kustomization.yaml).
    mounted = set()
    for w in [*of_kind(objs, "StatefulSet"), *of_kind(objs, "Deployment"), *of_kind(objs, "CronJob")]:
        for name, _ in secret_references(pod_template(w)["spec"]):
            if name.endswith("-tls"):
                mounted.add((w["metadata"]["namespace"], name))
    mounted |= {("keyroute", "keyroute-monitoring-tls")}
    assert mounted - set(certificates) == {("keyroute-pipeline", "keyroute-pipeline-tls")}
    # The routers' and nodes' certificates are one per pod: no Secret of theirs is named any more.
    assert not {("keyroute", "keyroute-router-tls"), ("keyroute", "keyroute-node-tls")} & mounted
    # The ZooKeeper backup has a client certificate of its own, of the members' CA (ZooKeeper requires one),
    # naming no member role; it reads as the reader by password.
    [backup] = [w for w in of_kind(objs, "CronJob") if w["metadata"]["name"] == "keyroute-zk-backup"]
    assert ("keyroute", "keyroute-zk-backup-tls") in {
        (backup["metadata"]["namespace"], name) for name, _ in secret_references(pod_template(backup)["spec"])
    }
    spec = certificates[("keyroute", "keyroute-zk-backup-tls")]["spec"]
    assert spec["issuerRef"]["name"] == "keyroute-member-ca" and spec["usages"] == ["client auth", "digital signature"]
    alt_names = (*[("DNS", n) for n in spec.get("dnsNames", [])], *[("URI", u) for u in spec.get("uris", [])])
    assert member_identity({"subjectAltName": alt_names}) is None


def test_cert_manager_gives_each_router_and_node_a_certificate_naming_its_own_id(
    with_cert_manager: list[Obj],
) -> None:
    objs = with_cert_manager
    zookeeper = certificates_names(objs, "keyroute-zookeeper-tls")
    seen = set()
    for w, c in keyroute_containers(objs):
        command = subcommand(c)
        if command not in (["router"], ["node"]):
            continue
        role = command[0]
        attributes = csi_volume(w, c)
        assert attributes["csi.cert-manager.io/issuer-name"] == "keyroute-member-ca"
        assert attributes["csi.cert-manager.io/issuer-kind"] == "Issuer"
        assert attributes["csi.cert-manager.io/key-encoding"] == "PKCS8"
        assert "client auth" in attributes["csi.cert-manager.io/key-usages"]
        # The pod's files are readable by its group (the pod's fsGroup) alone.
        assert attributes["csi.cert-manager.io/fs-group"] == str(pod_template(w)["spec"]["securityContext"]["fsGroup"])
        for n in range(w["spec"].get("replicas", 2)):
            pod = f"{w['metadata']['name']}-{n}"
            args, env = parsed_for(objs, w, c, pod)
            certificate = certificate_of_pod(attributes, pod, "keyroute")
            # The id a node or router is started with is its pod name, which its certificate names.
            own = args.node_id if role == "node" else args.router_id
            assert member_identity(certificate) == MemberIdentity(role, own), (pod, certificate)
            assert own == pod
            names = [value for kind, value in certificate["subjectAltName"] if kind == "DNS"]
            if role == "node":
                [(host, _)] = host_port_pairs(env["KEYROUTE_ADVERTISE_URL"])
                assert covers(names, host), (host, names)
            for host, _ in host_port_pairs(ZkSettings.parse(env["KEYROUTE_ZK"]).hosts):
                assert covers(zookeeper, host), host
            # What Prometheus checks when it scrapes.
            [endpoint] = find(objs, "PodMonitor", f"keyroute-{role}")["spec"]["podMetricsEndpoints"]
            assert covers(names, endpoint["tlsConfig"]["serverName"]), names
            # Another pod's certificate is another member.
            other = certificate_of_pod(attributes, f"{w['metadata']['name']}-{n + 1}", "keyroute")
            assert member_identity(other) != MemberIdentity(role, own)
        seen.add(role)
    assert seen == {"router", "node"}


def certificates_names(objs: list[Obj], secret: str) -> list[str]:
    [cert] = [c for c in of_kind(objs, "Certificate") if c["spec"]["secretName"] == secret]
    return list(cert["spec"]["dnsNames"])


def parsed_for(objs: list[Obj], workload: Obj, container: Obj, pod_name: str):  # type: ignore[no-untyped-def]
    env = container_env(objs, container, pod_name=pod_name)
    return build_parser(env).parse_args(resolve_argv(container, env)[1:]), env
