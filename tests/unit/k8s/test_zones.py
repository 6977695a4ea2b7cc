"""Serving pods spread over zones, and nodes know their zone."""

from __future__ import annotations

from keyroute.cli import build_parser
from tests.k8s_render import (
    Obj,
    find,
    pod_template,
    resolve_argv,
    resolve_env,
)
from tests.unit.k8s.manifests import (
    ZONE_FIELD,
    ZONE_LABEL,
    container_env,
    node_pod,
    objs_namespace,
    operator_secrets,
    readme_section,
    sample_field,
)


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
