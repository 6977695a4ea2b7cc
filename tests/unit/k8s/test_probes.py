"""Probes ask what the apps answer."""

from __future__ import annotations

import re

from tests.k8s_render import (
    Obj,
    find,
    pod_template,
)
from tests.unit.k8s.manifests import (
    app_for,
    container_port,
    keyroute_containers,
    serves_get,
    subcommand,
    zookeeper_cfg,
)


def test_http_probes_hit_paths_the_apps_serve(objs: list[Obj]) -> None:
    probed = set()
    for w, c in keyroute_containers(objs):
        app = app_for(subcommand(c))
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = c.get(kind)
            if probe is None:
                continue
            assert app is not None, f"{c['name']} is probed but serves no HTTP"
            get = probe["httpGet"]
            container_port(c, get["port"])
            assert serves_get(app, get["path"]), f"{c['name']} {kind}: nothing serves GET {get['path']}"
            probed.add((c["name"], kind, get["path"]))
        annotations = pod_template(w)["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") == "true":
            assert serves_get(app, annotations["prometheus.io/path"])
            assert container_port(c, int(annotations["prometheus.io/port"]))
    assert {("node", "readinessProbe", "/readyz"), ("node", "livenessProbe", "/healthz")} <= probed
    assert {("router", "readinessProbe", "/readyz"), ("router", "livenessProbe", "/healthz")} <= probed


def test_zookeeper_probes_speak_whitelisted_four_letter_words(objs: list[Obj]) -> None:
    [zk] = pod_template(find(objs, "StatefulSet", "keyroute-zookeeper"))["spec"]["containers"]
    env = {e["name"]: e.get("value", "") for e in zk["env"]}
    whitelist = set(env["ZOO_4LW_COMMANDS_WHITELIST"].split(","))
    assert {"ruok", "srvr"} <= whitelist
    # The plaintext port: the container's client port, or with TLS (components/tls) the loopback's.
    cfg = zookeeper_cfg(zk)
    client = int(cfg["clientPort"]) if "secureClientPort" in cfg else container_port(zk, "client")
    for kind in ("readinessProbe", "livenessProbe"):
        script = zk[kind]["exec"]["command"][-1]
        words = set(re.findall(r"printf (\w{4})", script))
        assert words and words <= whitelist, kind
        assert f"/dev/tcp/127.0.0.1/{client}" in script
