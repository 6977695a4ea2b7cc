"""Serving pods spread over zones, and nodes know their zone on any Kubernetes version."""

from __future__ import annotations

from pathlib import Path

import pytest

from keyroute.cli import build_parser
from keyroute.zone import SERVICE_ACCOUNT_DIR, ZoneError, node_zone, write_zone
from tests.k8s_render import (
    Obj,
    find,
    of_kind,
    pod_template,
    resolve_argv,
)
from tests.unit.k8s.manifests import (
    OBJECT_STORAGE,
    SERVING_IMAGE,
    ZONE_LABEL,
    cli_options,
    container_env,
    image_name,
    node_pod,
    objs_namespace,
    readme_section,
    subcommand,
    with_object_store_secret,
)


def zone_init_container(objs: list[Obj]) -> Obj:
    [init] = [c for c in node_pod(objs)["spec"]["initContainers"] if c["name"] == "zone"]
    return dict(init)


def test_nodes_read_their_zone_from_the_kubernetes_node(any_overlay: tuple[str, list[Obj]], tmp_path: Path) -> None:
    """The init container asks the API server for its Node's zone label and leaves it in a file of a volume
    the node container reads (KEYROUTE_ZONE_FILE): any Kubernetes version, no pod label needed."""
    overlay_name, objs = any_overlay
    if overlay_name == OBJECT_STORAGE:
        objs = with_object_store_secret(objs)
    spec = node_pod(objs)["spec"]
    init = zone_init_container(objs)
    [node] = spec["containers"]
    assert image_name(init["image"]) == SERVING_IMAGE and init["image"] == node["image"]
    assert init.get("command") is None and subcommand(init)[0] == "zone-from-node"
    [name_entry] = [e for e in init["env"] if e["name"] == "KEYROUTE_NODE_NAME"]
    assert name_entry["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    reads = cli_options(["zone-from-node"])
    assert all(e["name"] in reads for e in init["env"] if e["name"].startswith("KEYROUTE_")), init["env"]
    init_env = container_env(objs, init, pod_name="keyroute-node-0")
    written = build_parser(init_env).parse_args(resolve_argv(init, init_env)[1:])
    assert written.node_name == "worker-1" and written.service_account_dir == SERVICE_ACCOUNT_DIR

    node_env = container_env(objs, node, pod_name="keyroute-node-0")
    assert "KEYROUTE_ZONE" not in node_env, "the pod's own zone label exists only from Kubernetes 1.35 on"
    assert Path(node_env["KEYROUTE_ZONE_FILE"]) == written.output
    # One volume, written by the init container, read by the node.
    volumes = {v["name"]: v for v in spec["volumes"]}
    [(shared, init_mount)] = [
        (m["name"], m) for m in init["volumeMounts"] if written.output.is_relative_to(m["mountPath"])
    ]
    [node_mount] = [m for m in node["volumeMounts"] if m["name"] == shared]
    assert "emptyDir" in volumes[shared] and not init_mount.get("readOnly") and node_mount["readOnly"] is True
    assert node_mount["mountPath"] == init_mount["mountPath"]

    # What the node makes of the file the init container writes, with the overlay's own options.
    zone_file = tmp_path / "zone"
    write_zone(zone_file, "eu-west-1a")
    args = build_parser({**node_env, "KEYROUTE_ZONE_FILE": str(zone_file)}).parse_args(resolve_argv(node, node_env)[1:])
    assert node_zone(args.zone, args.zone_file, args.require_zone) == "eu-west-1a"
    # A Node without the label: an empty file; production refuses to start, development runs without a zone.
    write_zone(zone_file, "")
    assert args.require_zone is (overlay_name != "dev")
    if args.require_zone:
        with pytest.raises(ZoneError, match="--zone-file"):
            node_zone(args.zone, args.zone_file, args.require_zone)
    else:
        assert node_zone(args.zone, args.zone_file, args.require_zone) == ""


def test_only_the_init_container_holds_a_token_that_may_only_get_nodes(any_overlay: tuple[str, list[Obj]]) -> None:
    _, objs = any_overlay
    spec = node_pod(objs)["spec"]
    init = zone_init_container(objs)
    [node] = spec["containers"]
    assert spec["automountServiceAccountToken"] is False
    account = find(objs, "ServiceAccount", spec["serviceAccountName"])
    assert account["automountServiceAccountToken"] is False
    # The token and the CA, where `keyroute zone-from-node` reads them, in the init container only.
    [token_mount] = [m for m in init["volumeMounts"] if m["mountPath"] == str(SERVICE_ACCOUNT_DIR)]
    assert token_mount["readOnly"] is True
    assert token_mount["name"] not in {m["name"] for m in node.get("volumeMounts", [])}
    [volume] = [v for v in spec["volumes"] if v["name"] == token_mount["name"]]
    sources = volume["projected"]["sources"]
    [token] = [s["serviceAccountToken"] for s in sources if "serviceAccountToken" in s]
    assert token["path"] == "token" and token["expirationSeconds"] <= 3600
    [ca] = [s["configMap"] for s in sources if "configMap" in s]
    assert ca["name"] == "kube-root-ca.crt" and ca["items"] == [{"key": "ca.crt", "path": "ca.crt"}]
    # The account's only grant: get nodes, cluster-wide (Nodes are not namespaced).
    subject = {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": objs_namespace(objs)}
    bindings = [b for b in (*of_kind(objs, "ClusterRoleBinding"), *of_kind(objs, "RoleBinding"))
                if subject in b["subjects"]]
    [binding] = bindings
    assert binding["kind"] == "ClusterRoleBinding" and binding["subjects"] == [subject]
    assert binding["roleRef"]["kind"] == "ClusterRole"
    role = find(objs, "ClusterRole", binding["roleRef"]["name"])
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    assert "aggregationRule" not in role


def test_the_init_container_is_restricted_and_bounded(any_overlay: tuple[str, list[Obj]]) -> None:
    _, objs = any_overlay
    init = zone_init_container(objs)
    sc = init["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    for kind in ("requests", "limits"):
        assert {"memory", "ephemeral-storage"} <= set(init["resources"][kind]), kind
    assert init["resources"]["requests"]["memory"] == init["resources"]["limits"]["memory"]


def test_the_readme_names_the_version_that_copies_the_zone_label() -> None:
    section = readme_section("Zones")
    assert "1.35" in section and "1.34" not in section
    assert "zone-from-node" in section and "KEYROUTE_REQUIRE_ZONE" in section


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
