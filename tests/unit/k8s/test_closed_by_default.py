"""prod is closed by default: every protection docs/security.md ("On Kubernetes") says the production overlay
turns on is checked here by its name, on the rendered overlay; the list is read from that file, so the
document and these checks cannot drift apart. Also: images by digest, placeholders that fail closed and are
all found by the README's grep, and the hourly ZooKeeper backup."""

from __future__ import annotations

import ipaddress
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from keyroute.cli import build_parser
from tests.k8s_render import ROOT, Obj, find, of_kind, pod_template, render, resolve_argv, workloads
from tests.unit.k8s import test_production
from tests.unit.k8s.manifests import (
    KEYROUTE_IMAGES,
    OPERATOR_CONFIG_MAPS,
    PIPELINE_NAMESPACE,
    SERVING_IMAGE,
    cli_has,
    cli_options,
    container_env,
    executor_template_text,
    image_name,
    node_pod,
    pipeline_pods,
    readme_section,
    subcommand,
    zookeeper_cfg,
)

SECURITY = ROOT / "docs" / "security.md"
# RFC 5737's documentation ranges: no real host has an address there, so a placeholder in them reaches nobody.
DOCUMENTATION_RANGES = [ipaddress.ip_network(n) for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24")]
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def documented_protections() -> list[str]:
    """The bold names of the bullets of docs/security.md's "On Kubernetes" section."""
    text = SECURITY.read_text()
    section = text.split("\n## On Kubernetes\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^- \*\*(.+?)\*\*", section, re.MULTILINE)


@pytest.fixture(scope="module")
def prod() -> list[Obj]:
    return render("prod")


def container(objs: list[Obj], kind: str, name: str) -> Obj:
    [c] = pod_template(find(objs, kind, name))["spec"]["containers"]
    return dict(c)


def env_values(c: Obj) -> dict[str, str]:
    return {e["name"]: str(e.get("value", "")) for e in c.get("env", [])}


def mounted_source(objs: list[Obj], kind: str, name: str, path: str) -> tuple[str, str, Obj]:
    """("secret", "configMap" or "csi", the key, the volume source) of the file at `path` in the workload's
    container."""
    spec = pod_template(find(objs, kind, name))["spec"]
    c = container(objs, kind, name)
    for m in c.get("volumeMounts", []):
        if path.startswith(m["mountPath"] + "/"):
            [volume] = [v for v in spec["volumes"] if v["name"] == m["name"]]
            assert m.get("readOnly") is True, f"{name}: {m['mountPath']} is writable"
            key = path[len(m["mountPath"]) + 1 :]
            for kind_of in ("secret", "configMap", "csi"):
                if kind_of in volume:
                    return kind_of, key, volume[kind_of]
    raise AssertionError(f"{name}: nothing mounted at {path}")


SERVING = (("StatefulSet", "keyroute-node"), ("Deployment", "keyroute-router"))


def tls_on_every_wire(objs: list[Obj]) -> None:
    for kind, name in SERVING:
        env = env_values(container(objs, kind, name))
        # Each pod's own certificate, from cert-manager's csi-driver (test_tls.py: naming the pod's own id).
        for option in ("KEYROUTE_TLS_CERT", "KEYROUTE_TLS_KEY", "KEYROUTE_MEMBER_CA", "KEYROUTE_ZK_TLS_CA"):
            kind_of, _, source = mounted_source(objs, kind, name, env[option])
            assert (kind_of, source.get("driver")) == ("csi", "csi.cert-manager.io"), (name, option)
    [pipeline] = pipeline_pods(objs)[0]["spec"]["containers"]
    env = env_values(pipeline)
    assert env["KEYROUTE_ZK_TLS_CA"] and env["KEYROUTE_SPARK_SECRET_FILE"]
    cfg = zookeeper_cfg(container(objs, "StatefulSet", "keyroute-zookeeper"))
    assert cfg["ssl.clientAuth"] == "need" and cfg["sslQuorum"] == "true"
    assert cfg["clientPortAddress"] == "127.0.0.1"


def zookeeper_members_check_host_names(objs: list[Obj]) -> None:
    cfg = zookeeper_cfg(container(objs, "StatefulSet", "keyroute-zookeeper"))
    assert cfg["ssl.quorum.hostnameVerification"] == cfg["ssl.hostnameVerification"] == "true"


def client_certificates(objs: list[Obj]) -> None:
    env = env_values(container(objs, "Deployment", "keyroute-router"))
    kind, key, source = mounted_source(objs, "Deployment", "keyroute-router", env["KEYROUTE_TLS_CLIENT_CA"])
    assert (kind, key, source["name"]) == ("configMap", "ca.crt", "keyroute-client-ca")
    assert source.get("optional") is False  # without the clients' CA, no router starts
    assert "ca.crt" in OPERATOR_CONFIG_MAPS[source["name"]]
    assert "create configmap keyroute-client-ca" in readme_section("Secrets")


def access_control(objs: list[Obj]) -> None:
    for kind, name in SERVING:
        c = container(objs, kind, name)
        env = env_values(c)
        kind_of, key, source = mounted_source(objs, kind, name, env["KEYROUTE_ACCESS_TOKENS"])
        assert (kind_of, key, source["secretName"]) == ("secret", "tokens.toml", "keyroute-access-tokens")
        assert source.get("optional") is False
        # JWTs of the identity provider, from the ConfigMap the overlay generates.
        refs = {e["name"]: e["valueFrom"]["configMapKeyRef"] for e in c["env"] if e["name"].startswith("KEYROUTE_JWT_")}
        assert set(refs) == {"KEYROUTE_JWT_ISSUER", "KEYROUTE_JWT_AUDIENCE", "KEYROUTE_JWT_JWKS_URL"}, name
        reads = cli_options(subcommand(c))
        assert set(refs) | {"KEYROUTE_ACCESS_TOKENS"} <= set(reads), name
        resolved = container_env(objs, c, pod_name=f"{name}-0")
        assert resolved["KEYROUTE_JWT_ISSUER"].startswith("https://")
        assert resolved["KEYROUTE_JWT_JWKS_URL"].startswith("https://") and resolved["KEYROUTE_JWT_AUDIENCE"]
    # The keys are fetched from the issuer's addresses only.
    jwks = find(objs, "NetworkPolicy", "keyroute-jwks")
    [rule] = jwks["spec"]["egress"]
    assert [p["port"] for p in rule["ports"]] == [443]


def read_quotas(objs: list[Obj]) -> None:
    from keyroute.http.quotas import quota_file_error

    # Routers and nodes (reads made straight to a node) hold callers to the same file.
    sources = set()
    for kind_of_workload, name in SERVING:
        c = container(objs, kind_of_workload, name)
        env = env_values(c)
        assert "KEYROUTE_QUOTA_FILE" in cli_options(subcommand(c)), name
        kind, key, source = mounted_source(objs, kind_of_workload, name, env["KEYROUTE_QUOTA_FILE"])
        assert kind == "configMap"
        sources.add((source["name"], key))
        if name == "keyroute-node":  # a node's quotas need members told apart from callers
            assert env.get("KEYROUTE_MEMBER_CA") or env.get("KEYROUTE_CLUSTER_SECRET_FILE"), name
    [(config_map_name, key)] = sources
    [config_map] = [o for o in of_kind(objs, "ConfigMap") if o["metadata"]["name"] == config_map_name]
    # The file parses as routers and nodes read it (a file that does not stops them at start).
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / key
        path.write_text(config_map["data"][key])
        assert quota_file_error(str(path)) is None
    assert 'identities."*"' in config_map["data"][key], "no default quota for callers not named"


def the_cluster_s_policy_in_zookeeper(objs: list[Obj]) -> None:
    [init] = [c for c in node_pod(objs)["spec"]["initContainers"] if c["name"] == "cluster-policy"]
    assert image_name(init["image"]) == SERVING_IMAGE and init.get("command") is None
    assert init["args"] == [
        "cluster",
        "policy",
        "set",
        "--require-access-control",
        "--member-auth",
        "mtls",
        "--require-tls",
        "client,member,zookeeper",
    ]
    env = env_values(init)
    # As the ZooKeeper writer, over TLS with the node's own certificate, the reader granted READ.
    assert env["KEYROUTE_ZK"] == env_values(node_pod(objs)["spec"]["containers"][0])["KEYROUTE_ZK"]
    assert env["KEYROUTE_ZK_AUTH_FILE"].endswith("/writer") and env["KEYROUTE_ZK_READER_FILE"].endswith("/reader")
    mounts = {m["mountPath"] for m in init["volumeMounts"]}
    for option in ("KEYROUTE_ZK_AUTH_FILE", "KEYROUTE_ZK_TLS_CA", "KEYROUTE_ZK_TLS_CERT", "KEYROUTE_ZK_TLS_KEY"):
        assert any(env[option].startswith(m + "/") for m in mounts), option
    # Once this checkout's CLI has the command, the init container must be one it accepts.
    if cli_has(["cluster", "policy", "set"]):
        reads = cli_options(["cluster", "policy", "set"])
        assert {name for name in env if name.startswith("KEYROUTE_")} <= set(reads), sorted(set(env) - set(reads))
        resolved = container_env(objs, init, pod_name="keyroute-node-0")
        build_parser(resolved).parse_args(resolve_argv(init, resolved)[1:])


def secrets_as_files_every_one_required(objs: list[Obj]) -> None:
    test_production.test_no_production_container_reads_a_secret_from_its_environment("prod")


def zookeeper_s_superuser_from_a_file(objs: list[Obj]) -> None:
    spec = pod_template(find(objs, "StatefulSet", "keyroute-zookeeper"))["spec"]
    [zk] = spec["containers"]
    assert zk["securityContext"]["readOnlyRootFilesystem"] is True
    assert "superDigest" not in yaml.safe_dump(zk.get("env", []))
    assert "/etc/zookeeper/super/digest" in zk["command"][2] and "superDigest" in zk["command"][2]
    [volume] = [v for v in spec["volumes"] if v.get("secret", {}).get("secretName") == "keyroute-zookeeper-super"]
    assert volume["secret"]["optional"] is False


def the_pipeline_apart(objs: list[Obj]) -> None:
    cron = find(objs, "CronJob", "keyroute-pipeline")
    assert cron["metadata"]["namespace"] == PIPELINE_NAMESPACE
    role = find(objs, "Role", "keyroute-spark")
    assert role["metadata"]["namespace"] == PIPELINE_NAMESPACE
    assert {r for rule in role["rules"] for r in rule["resources"]} == {"pods", "configmaps"}
    assert pod_template(cron)["spec"]["nodeSelector"] == {"keyroute.io/pool": "batch"}


def nodes_only_read_snapshots(objs: list[Obj]) -> None:
    spec = node_pod(objs)["spec"]
    secrets = {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    assert "keyroute-object-store-read" in secrets and "keyroute-object-store" not in secrets


def default_deny_network_policies(objs: list[Obj]) -> None:
    policies = of_kind(objs, "NetworkPolicy")
    denied = {
        p["metadata"]["namespace"]
        for p in policies
        if p["spec"]["podSelector"] == {} and not p["spec"].get("ingress") and not p["spec"].get("egress")
    }
    assert denied == {"keyroute", PIPELINE_NAMESPACE}
    # Whatever leaves the cluster goes to ranges the operator sets: never "anywhere".
    blocks = [
        peer["ipBlock"]["cidr"]
        for p in policies
        for rule in p["spec"].get("egress", [])
        for peer in rule.get("to", [])
        if "ipBlock" in peer
    ]
    assert blocks
    for cidr in blocks:
        assert any(ipaddress.ip_network(cidr).subnet_of(r) for r in DOCUMENTATION_RANGES), cidr


def the_restricted_pod_security_standard(objs: list[Obj]) -> None:
    for namespace in of_kind(objs, "Namespace"):
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert {n["metadata"]["name"] for n in of_kind(objs, "Namespace")} == {"keyroute", PIPELINE_NAMESPACE}


def images_by_digest(objs: list[Obj]) -> None:
    for image in every_image(objs):
        assert DIGEST.search(image), f"not pinned by digest: {image}"


def an_internal_client_load_balancer(objs: list[Obj]) -> None:
    svc = find(objs, "Service", "keyroute-router")
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["metadata"]["annotations"]["service.beta.kubernetes.io/aws-load-balancer-internal"] == "true"
    ranges = svc["spec"]["loadBalancerSourceRanges"]
    assert ranges == ["192.0.2.1/32"], "the placeholder admits nobody until the operator sets the clients' ranges"


def the_admin_port(objs: list[Obj]) -> None:
    for kind, name in SERVING:
        assert env_values(container(objs, kind, name))["KEYROUTE_ADMIN_PORT"] == "8081"
    policy = find(objs, "NetworkPolicy", "keyroute-admin")
    assert [p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]] == [8081]


CHECKS: dict[str, Callable[[list[Obj]], None]] = {
    "TLS on every wire": tls_on_every_wire,
    "ZooKeeper members check host names": zookeeper_members_check_host_names,
    "Client certificates": client_certificates,
    "Access control": access_control,
    "Read quotas": read_quotas,
    "The cluster's policy in ZooKeeper": the_cluster_s_policy_in_zookeeper,
    "Secrets as files, every one required": secrets_as_files_every_one_required,
    "ZooKeeper's superuser from a file": zookeeper_s_superuser_from_a_file,
    "The pipeline apart": the_pipeline_apart,
    "Nodes only read snapshots": nodes_only_read_snapshots,
    "Default-deny NetworkPolicies": default_deny_network_policies,
    "The restricted Pod Security Standard": the_restricted_pod_security_standard,
    "Images by digest": images_by_digest,
    "An internal client load balancer": an_internal_client_load_balancer,
    "The admin port": the_admin_port,
}


def test_every_protection_the_security_guide_lists_for_prod_has_its_check() -> None:
    listed = documented_protections()
    assert len(listed) == len(set(listed)) >= 10
    assert set(listed) == set(CHECKS), (
        f"listed without a check: {sorted(set(listed) - set(CHECKS))}; "
        f"checked but not listed: {sorted(set(CHECKS) - set(listed))}"
    )


@pytest.mark.parametrize("protection", documented_protections())
def test_production_turns_on_each_protection_the_security_guide_lists(prod: list[Obj], protection: str) -> None:
    CHECKS[protection](prod)


def test_the_checks_can_fail_development_is_open() -> None:
    """dev is the open configuration the guide warns about: most checks refuse it."""
    dev = render("dev")
    failed = []
    for name, check in CHECKS.items():
        try:
            check(dev)
        except (AssertionError, KeyError, ValueError):
            failed.append(name)
    assert len(failed) >= len(CHECKS) - 2, f"dev passes: {sorted(set(CHECKS) - set(failed))}"


def every_image(objs: list[Obj]) -> list[str]:
    """Every image a prod pod runs: containers and init containers, and the executors' (PIPELINE_EXECUTOR_IMAGE)."""
    images = []
    for w in workloads(objs):
        spec = pod_template(w)["spec"]
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            images.append(c["image"])
            images += [e["value"] for e in c.get("env", []) if e["name"] == "PIPELINE_EXECUTOR_IMAGE"]
    return images


def test_every_production_image_is_pinned_by_digest_and_documented(prod: list[Obj]) -> None:
    images = every_image(prod)
    assert {image_name(i) for i in images} == {*KEYROUTE_IMAGES, "zookeeper"}
    assert all(DIGEST.search(i) for i in images), [i for i in images if not DIGEST.search(i)]
    # ZooKeeper keeps its release visible beside the digest, from the mirror the README tells how to fill.
    [zk] = [i for i in images if image_name(i) == "zookeeper"]
    assert ":3.9.5@sha256:" in zk and "/mirror/" in zk
    section = readme_section("Build the images and apply an overlay")
    assert (
        "kustomize edit set image zookeeper=" in section and "crane copy docker.io/library/zookeeper:3.9.5" in section
    )
    # dev keeps tags: its images are built and loaded locally.
    assert not [i for i in every_image(render("dev")) if DIGEST.search(i)]


def placeholder_table() -> list[tuple[str, list[str]]]:
    """(what, its placeholders) of each row of the README's "Values to set" table."""
    rows = []
    for line in readme_section("Values to set").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1].startswith("`"):
            rows.append((cells[0], re.findall(r"`([^`]+)`", cells[1])))
    return rows


def test_every_placeholder_fails_closed_and_the_readme_s_grep_finds_it(prod: list[Obj]) -> None:
    from tests.k8s_render import _render_text

    rendered = _render_text("prod")
    rows = placeholder_table()
    assert len(rows) >= 8
    [command] = re.findall(r"grep -nE '([^']+)'", readme_section("Values to set"))
    pattern = re.compile(command)
    for what, placeholders in rows:
        for placeholder in placeholders:
            literal = placeholder.replace("…", "")
            assert literal in rendered, f"{what}: {placeholder} is not in the rendered prod"
            assert pattern.search(placeholder.replace("…", "0" * 60)), f"the README's grep misses {placeholder}"
    # The grep finds nothing else: every line it matches holds a placeholder of the table.
    listed = [p.replace("…", "") for _, ps in rows for p in ps]
    stray = [line for line in rendered.splitlines() if pattern.search(line) and not any(p in line for p in listed)]
    assert stray == []
    # Each address placeholder is in a documentation range: it reaches or admits nobody.
    for _, placeholders in rows:
        for placeholder in placeholders:
            if re.fullmatch(r"\d+\.\d+\.\d+\.\d+/\d+", placeholder):
                net = ipaddress.ip_network(placeholder)
                assert any(net.subnet_of(r) for r in DOCUMENTATION_RANGES), placeholder


def test_the_zookeeper_backup_dumps_with_the_cli_and_uploads_one_object_per_run(
    prod: list[Obj], tmp_path: Path
) -> None:
    cron = find(prod, "CronJob", "keyroute-zk-backup")
    spec = pod_template(cron)["spec"]
    [dump] = spec["initContainers"]
    [upload] = spec["containers"]
    # The dump: `keyroute zk dump` as the reader, over TLS, into a memory volume the upload reads.
    assert image_name(dump["image"]) == image_name(upload["image"]) == SERVING_IMAGE
    assert dump.get("command") is None and subcommand(dump) == ["zk", "dump"]
    env = container_env(prod, dump, pod_name="keyroute-zk-backup-1")
    reads = cli_options(["zk", "dump"])
    assert {name for name in env if name.startswith("KEYROUTE_")} <= set(reads)
    args = build_parser(env).parse_args(resolve_argv(dump, env)[1:])
    assert str(args.zk_auth_file).endswith("/reader") and args.zk_tls_ca is not None
    [backup] = [v for v in spec["volumes"] if v["name"] == "backup"]
    assert backup["emptyDir"]["medium"] == "Memory"
    [out_mount] = [m for m in dump["volumeMounts"] if args.out.startswith(m["mountPath"] + "/")]
    assert out_mount["name"] == "backup"
    assert [m for m in upload["volumeMounts"] if m["name"] == "backup"][0]["readOnly"] is True
    # The upload: ROOT/<the Job's name>.json, a new object per scheduled run.
    upload_env = container_env(prod, upload, pod_name="keyroute-zk-backup-29412345-abcde")
    [config_map] = [o for o in of_kind(prod, "ConfigMap") if o["metadata"]["name"].startswith("keyroute-zk-backup")]
    root = config_map["data"]["root"]
    assert root.startswith("s3://")
    assert upload_env["ZK_BACKUP_URI"] == f"{root}/keyroute-zk-backup-29412345.json"
    # Run the upload's script as written, with a local file:// target standing for the bucket.
    script = upload["command"][-1]
    assert upload["command"][:4] == ["/usr/bin/tini", "--", "python", "-c"]
    dumped = tmp_path / "keyroute-zk.json"
    dumped.write_text('{"format": "keyroute-zk-dump"}')
    script = script.replace(args.out, str(dumped))
    target = tmp_path / "bucket" / "keyroute-zk-backup-29412345.json"
    target.parent.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", script], env={"ZK_BACKUP_URI": target.as_uri()}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert target.read_text() == dumped.read_text()
    # A target it cannot write is one line and a failed Job, never a traceback.
    bad = subprocess.run(
        [sys.executable, "-c", script],
        env={"ZK_BACKUP_URI": (tmp_path / "missing-dir" / "x" / "y.json").as_uri().replace("file://", "nope://")},
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "cannot write" in bad.stderr, bad.stderr
    # Only to ZooKeeper and the object store (tests/unit/k8s/test_network_policies.py models the traffic).
    policy = find(prod, "NetworkPolicy", "keyroute-zk-backup")
    labels = pod_template(cron)["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in policy["spec"]["podSelector"]["matchLabels"].items())
    assert "keyroute-zk-backup" in readme_section("ZooKeeper backups")


def test_the_executors_run_the_driver_s_pinned_image(prod: list[Obj]) -> None:
    template = yaml.safe_load(executor_template_text(prod))
    assert "image" not in template["spec"]["containers"][0]  # Spark sets it from PIPELINE_EXECUTOR_IMAGE
    [driver] = pipeline_pods(prod)[0]["spec"]["containers"]
    [executor_image] = [e["value"] for e in driver["env"] if e["name"] == "PIPELINE_EXECUTOR_IMAGE"]
    assert executor_image == driver["image"] and DIGEST.search(executor_image)
