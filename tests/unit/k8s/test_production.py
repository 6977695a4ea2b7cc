"""Production is secure by default: required secrets, the recovery superuser, the client address."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.k8s_render import (
    Obj,
    find,
    of_kind,
    pod_template,
    render,
    workloads,
)
from tests.unit.k8s.manifests import (
    OPERATOR_CONFIG_MAPS,
    PROD_OVERLAYS,
    README,
    operator_secrets,
    pod_specs,
    readme_section,
)


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


# The object store's static keys, optional where the pod's ServiceAccount carries a cloud identity (IRSA,
# GKE Workload Identity): without the Secret the AWS SDK takes the identity.
STATIC_KEY_SECRETS = {"keyroute-object-store", "keyroute-object-store-read", "keyroute-zk-backup-store"}
CLOUD_IDENTITY_ANNOTATIONS = ("eks.amazonaws.com/role-arn", "iam.gke.io/gcp-service-account")
# No Secret is read into an environment: even the Kafka secrets a live store's spec names as "${NAME}" are
# files of the mounted Secret keyroute-kafka, in the folder KEYROUTE_SECRETS_DIR names.
ENVIRONMENT_SECRETS: set[str] = set()


def pods_with_accounts(objs: list[Obj]) -> list[tuple[str, Obj, Obj | None]]:
    """(where, pod spec, its ServiceAccount) of every pod prod makes, Spark's executors included."""
    out = []
    for where, spec in pod_specs(objs):
        name = spec.get("serviceAccountName")
        namespace = None
        if where == "spark executor template":
            namespace = find(objs, "CronJob", "keyroute-pipeline")["metadata"]["namespace"]
        accounts = [
            o
            for o in objs
            if o["kind"] == "ServiceAccount"
            and o["metadata"]["name"] == name
            and (namespace is None or o["metadata"]["namespace"] == namespace)
        ]
        out.append((where, spec, accounts[0] if accounts else None))
    return out


def missing_sources(spec: Obj, objs: list[Obj]) -> list[str]:
    """The required Secrets and ConfigMaps a pod names (env, envFrom, volumes) that are not in `objs`: the
    kubelet does not start a pod while any is missing."""
    have = {(o["kind"], o["metadata"]["name"]) for o in objs}
    missing = []
    for name, ref in secret_references(spec):
        if ref.get("optional") is not True and ("Secret", name) not in have:
            missing.append(name)
    for v in spec.get("volumes", []):
        ref = v.get("configMap")
        if ref and ref.get("optional") is not True and ("ConfigMap", ref["name"]) not in have:
            missing.append(ref["name"])
    return missing


@pytest.mark.parametrize("overlay_name", PROD_OVERLAYS)
def test_production_requires_every_secret_it_names_and_documents_them(overlay_name: str) -> None:
    objs = render(overlay_name)
    named = set()
    for where, spec, account in pods_with_accounts(objs):
        for name, ref in secret_references(spec):
            named.add(name)
            if ref.get("optional") is True:
                # Only the static object-store keys, and only where a cloud identity stands in for them.
                assert name in STATIC_KEY_SECRETS, f"{where}: Secret {name} is optional in {overlay_name}"
                annotations = (account or {}).get("metadata", {}).get("annotations", {})
                assert set(CLOUD_IDENTITY_ANNOTATIONS) <= set(annotations), f"{where}: {name} optional, no identity"
    assert {
        "keyroute-zookeeper-auth",
        "keyroute-cluster",
        "keyroute-zookeeper-super",
        "keyroute-kafka",
        "keyroute-access-tokens",
    } <= named
    # Each one is created in the README (the object store's in its own section), or issued by cert-manager.
    documented = set(re.findall(r"create secret generic ([a-z0-9-]+)", README.read_text()))
    documented |= {c["spec"]["secretName"] for c in of_kind(objs, "Certificate")}
    assert named <= documented, f"not documented: {sorted(named - documented)}"
    assert "rotat" in readme_section("Secrets").lower()
    # Without them no pod that reads one starts: the kubelet refuses it.
    for w in workloads(objs):
        spec = pod_template(w)["spec"]
        if any(ref.get("optional") is not True for _, ref in secret_references(spec)):
            assert missing_sources(spec, objs), w["metadata"]["name"]
    # With them (and the operator's ConfigMaps), every pod starts.
    namespaces = {o["metadata"]["namespace"] for o in workloads(objs)}
    given = [
        *objs,
        *[s for ns in namespaces for s in operator_secrets(ns)],
        *[{"kind": "Secret", "metadata": {"name": name}} for name in documented],
        *[
            {"kind": "ConfigMap", "metadata": {"name": name}, "data": data}
            for name, data in OPERATOR_CONFIG_MAPS.items()
        ],
    ]
    for where, spec in pod_specs(objs):
        assert missing_sources(spec, given) == [], where


@pytest.mark.parametrize("overlay_name", PROD_OVERLAYS)
def test_no_production_container_reads_a_secret_from_its_environment(overlay_name: str) -> None:
    """Secrets are files (components/secret-files): nothing secret in /proc/PID/environ, crash reports or a
    debugging shell's inherited environment. The Kafka variables of live stores are the documented exception."""
    objs = render(overlay_name)
    checked = 0
    for where, spec in pod_specs(objs):
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            for e in c.get("env", []):
                assert "secretKeyRef" not in e.get("valueFrom", {}), f"{where}/{c['name']}: {e['name']} from a Secret"
            for source in c.get("envFrom", []):
                if "secretRef" in source:
                    assert source["secretRef"]["name"] in ENVIRONMENT_SECRETS, f"{where}/{c['name']}: {source}"
            checked += 1
    assert checked >= 8
    # Every secret a keyroute process reads is a `--X-file` option pointing into a mounted Secret volume.
    file_options = {"KEYROUTE_ZK_AUTH_FILE", "KEYROUTE_CLUSTER_SECRET_FILE", "KEYROUTE_ADMIN_TOKEN_FILE"}
    for name, kind in (("keyroute-node", "StatefulSet"), ("keyroute-router", "Deployment")):
        spec = pod_template(find(objs, kind, name))["spec"]
        [c] = spec["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert file_options <= set(env), name
        secret_mounts = {
            m["mountPath"]
            for m in c["volumeMounts"]
            for v in spec["volumes"]
            if v["name"] == m["name"] and "secret" in v
        }
        for option in file_options:
            assert any(str(env[option]).startswith(mount + "/") for mount in secret_mounts), (name, option)
    # The Kafka secrets of live stores: a folder of files, where nodes and the pipeline resolve "${NAME}".
    for kind, name in (("StatefulSet", "keyroute-node"), ("CronJob", "keyroute-pipeline")):
        spec = pod_template(find(objs, kind, name))["spec"]
        [c] = spec["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        kafka = [v for v in spec["volumes"] if v.get("secret", {}).get("secretName") == "keyroute-kafka"]
        assert len(kafka) == 1 and kafka[0]["secret"].get("optional") is False, name
        [mount] = [m for m in c["volumeMounts"] if m["name"] == kafka[0]["name"]]
        assert env.get("KEYROUTE_SECRETS_DIR") == mount["mountPath"] and mount.get("readOnly") is True, name
    assert "KEYROUTE_SECRETS_DIR" in readme_section("Live stores")


SUPER_DIGEST_KEY = "DigestAuthenticationProvider.superDigest"


def test_production_zookeeper_reads_its_superuser_from_a_file_into_its_config(tmp_path: Path) -> None:
    """The recovery superuser's digest goes from the mounted Secret into zoo.cfg (ZooKeeper turns an unknown
    zoo.cfg key into the `zookeeper.`-prefixed system property), never onto the JVM's command line or into
    the environment. The container's script runs here against stand-ins for the image's entrypoint (which
    writes zoo.cfg only when there is none) and for zkServer.sh (which shows what the server would get)."""
    from kazoo.security import make_digest_acl_credential

    objs = render("prod")
    spec = pod_template(find(objs, "StatefulSet", "keyroute-zookeeper"))["spec"]
    [zk] = spec["containers"]
    assert "superDigest" not in yaml.safe_dump(zk.get("env", [])), "the digest must not be in the environment"
    mounts = {m["mountPath"]: m for m in zk["volumeMounts"]}
    [super_volume] = [v for v in spec["volumes"] if v.get("secret", {}).get("secretName") == "keyroute-zookeeper-super"]
    [super_mount] = [m for m in zk["volumeMounts"] if m["name"] == super_volume["name"]]
    assert super_mount["readOnly"] is True and super_volume["secret"].get("optional") is False
    # A read-only root: everything ZooKeeper writes is a volume (zoo.cfg's in memory: it holds the digest).
    assert zk["securityContext"]["readOnlyRootFilesystem"] is True
    [conf_volume] = [v for v in spec["volumes"] if v["name"] == mounts["/run/zookeeper"]["name"]]
    assert conf_volume["emptyDir"]["medium"] == "Memory"
    assert {"/data", "/logs", "/tmp", "/run/zookeeper"} <= set(mounts)

    digest = make_digest_acl_credential("super", "recovery-password")
    root = tmp_path
    (root / "conf").mkdir()
    (root / "conf" / "logback.xml").write_text("<configuration/>\n")
    (root / "super").mkdir()
    (root / "super" / "digest").write_text(digest)  # as `kubectl create secret --from-literal` stores it
    (root / "bin").mkdir()
    entrypoint = root / "docker-entrypoint.sh"
    entrypoint.write_text(
        "#!/bin/bash\nset -e\n"
        'if [[ ! -f "$ZOO_CONF_DIR/zoo.cfg" ]]; then\n'
        '  echo "dataDir=$ZOO_DATA_DIR" >> "$ZOO_CONF_DIR/zoo.cfg"\n'
        '  for e in $ZOO_CFG_EXTRA; do echo "$e" >> "$ZOO_CONF_DIR/zoo.cfg"; done\n'
        "fi\n"
        'echo "$ZOO_MY_ID" > "$ZOO_DATA_DIR/myid"\n'
        'exec "$@"\n'
    )
    server = root / "bin" / "zkServer.sh"
    server.write_text('#!/bin/bash\necho "ARGS $*"\nenv | sed "s/^/ENV /"\ncat "$ZOOCFGDIR/zoo.cfg"\n')
    for script in (entrypoint, server):
        script.chmod(0o755)
    (root / "data").mkdir()
    script = zk["command"][2]
    for path, stand_in in (
        ("/run/zookeeper/conf", root / "run" / "conf"),
        ("/conf/", f"{root / 'conf'}/"),
        ("/etc/zookeeper/super/digest", root / "super" / "digest"),
        ("/docker-entrypoint.sh", entrypoint),
    ):
        assert path in script, path
        script = script.replace(path, str(stand_in))
    (root / "run").mkdir()
    env = {
        "PATH": f"{root / 'bin'}:/usr/bin:/bin",
        "HOSTNAME": "keyroute-zookeeper-2",
        "ZOO_DATA_DIR": str(root / "data"),
        "ZOO_CFG_EXTRA": "sslQuorum=true ssl.quorum.hostnameVerification=true",
    }
    done = subprocess.run([zk["command"][0], zk["command"][1], script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    config = [line for line in lines if not line.startswith(("ARGS ", "ENV "))]
    assert f"{SUPER_DIGEST_KEY}={digest}" in config and "sslQuorum=true" in config, config
    assert [line for line in config if SUPER_DIGEST_KEY in line] == [f"{SUPER_DIGEST_KEY}={digest}"]
    assert (root / "data" / "myid").read_text() == "3\n"
    assert (root / "run" / "conf" / "logback.xml").exists()  # the image's logging configuration, copied
    assert "ARGS start-foreground" in lines
    assert not [line for line in lines if line.startswith("ENV ") and digest in line], (
        "the digest is in the environment"
    )
    assert oct((root / "run" / "conf" / "zoo.cfg").stat().st_mode & 0o777) == "0o600"
    # A second start (the emptyDir survives a container restart) writes the digest once, not twice.
    again = subprocess.run([zk["command"][0], zk["command"][1], script], env=env, capture_output=True, text=True)
    assert [line for line in again.stdout.splitlines() if SUPER_DIGEST_KEY in line] == [f"{SUPER_DIGEST_KEY}={digest}"]
    # An empty digest file is refused: ZooKeeper does not start without its recovery superuser.
    (root / "super" / "digest").write_text("")
    empty = subprocess.run([zk["command"][0], zk["command"][1], script], env=env, capture_output=True, text=True)
    assert empty.returncode != 0 and "ARGS" not in empty.stdout
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
