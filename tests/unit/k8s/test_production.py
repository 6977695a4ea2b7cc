"""Production is secure by default: required secrets, the recovery superuser, the client address."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.k8s_render import (
    Obj,
    find,
    pod_template,
    render,
    resolve_env,
)
from tests.unit.k8s.manifests import (
    PROD_OVERLAYS,
    README,
    keyroute_containers,
    pod_specs,
    readme_section,
    sample_field,
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
