"""The environment and arguments of each container are what the programs read."""

from __future__ import annotations

import pytest

from keyroute.cli import build_parser
from keyroute.runtime.settings import ZkSettings
from tests.k8s_render import (
    Obj,
    expand,
    find,
    pod_template,
    resolve_argv,
    unresolved,
)
from tests.unit.k8s.manifests import (
    NODE_SHUTDOWN_S,
    OTHER_READERS,
    cli_options,
    container_env,
    container_port,
    host_port_pairs,
    keyroute_containers,
    objs_namespace,
    pods_selected,
    service_dns,
    subcommand,
    zookeeper_cfg,
)


def test_keyroute_env_is_exactly_what_the_cli_reads(objs: list[Obj]) -> None:
    checked = 0
    for w, c in keyroute_containers(objs):
        command = subcommand(c)
        reads = cli_options(command)
        names = [e["name"] for e in c.get("env", [])]
        assert len(names) == len(set(names)), f"{c['name']}: an env var is set twice"
        raw = " ".join(str(e.get("value", "")) for e in c.get("env", []))
        for name in names:
            if name.startswith("KEYROUTE_"):
                where = f"{w['metadata']['name']}/{c['name']}"
                assert name in reads, f"{where}: `keyroute {' '.join(command)}` does not read {name}"
            else:
                used = f"$({name})" in raw or name in OTHER_READERS
                assert used, f"{c['name']}: {name} is read by nothing (not a CLI option, not referenced)"
        # Service links would add KEYROUTE_<SERVICE>_PORT=tcp://... variables to the environment.
        assert pod_template(w)["spec"].get("enableServiceLinks") is False, w["metadata"]["name"]
        checked += 1
    assert checked >= 3


def test_every_reference_resolves_in_kubernetes_order(objs: list[Obj]) -> None:
    """$(VAR) in env sees only earlier entries: a patch that reorders env would leave a literal $(VAR)."""
    for _, c in keyroute_containers(objs):
        env = container_env(objs, c)
        for name, value in env.items():
            assert not unresolved(value), f"{c['name']}: {name}={value!r} keeps {unresolved(value)}"
        for part in resolve_argv(c, env):
            assert not unresolved(part), f"{c['name']}: argument {part!r}"


def test_the_cli_accepts_each_container_as_written(objs: list[Obj]) -> None:
    for w, c in keyroute_containers(objs):
        command = subcommand(c)
        assert c.get("command") in (None, ["keyroute"]), "the image's ENTRYPOINT is `keyroute`"
        env = container_env(objs, c, pod_name=f"{w['metadata']['name']}-0")
        for action in cli_options(command).values():
            if action.required:
                assert any(f"[env {k}]" in (action.help or "") for k in env), (
                    f"{c['name']}: required {action.option_strings[0]} is not set"
                )
        try:
            args = build_parser(env).parse_args(resolve_argv(c, env)[1:])
        except SystemExit:
            pytest.fail(f"`keyroute {' '.join(command)}` rejects the environment of {c['name']}: {env}")
        if command in (["node"], ["router"]):
            assert args.host == "0.0.0.0"
            assert args.port == container_port(c, "http")
        ZkSettings.parse(args.zk)


def test_addresses_in_the_environment_name_existing_services(objs: list[Obj]) -> None:
    ns = objs_namespace(objs)
    for w, c in keyroute_containers(objs):
        # A short name resolves in the pod's own namespace only (prod's pipeline runs in another one).
        dns = service_dns(objs, from_namespace=w["metadata"]["namespace"])
        env = container_env(objs, c, pod_name=f"{w['metadata']['name']}-0")
        hosts = ZkSettings.parse(env["KEYROUTE_ZK"]).hosts
        for host, port in host_port_pairs(hosts):
            svc = dns[host]
            assert port in [p["port"] for p in svc["spec"]["ports"]]
            assert pods_selected(objs, svc["spec"]["selector"]) == [
                find(objs, "StatefulSet", "keyroute-zookeeper")
            ]
        if "KEYROUTE_ADVERTISE_URL" in env:
            sts = find(objs, "StatefulSet", w["metadata"]["name"])
            [(host, port)] = host_port_pairs(env["KEYROUTE_ADVERTISE_URL"])
            pod, _, domain = host.partition(".")
            assert pod == f"{sts['metadata']['name']}-0" == env["KEYROUTE_NODE_ID"]
            assert domain == f"{sts['spec']['serviceName']}.{ns}.svc"
            svc = find(objs, "Service", sts["spec"]["serviceName"])
            assert port == container_port(c, "http") == svc["spec"]["ports"][0]["port"]


def test_zookeeper_servers_are_exactly_the_stateful_set_members(objs: list[Obj]) -> None:
    sts = find(objs, "StatefulSet", "keyroute-zookeeper")
    [zk] = pod_template(sts)["spec"]["containers"]
    env = {e["name"]: e.get("value", "") for e in zk["env"]}
    ports = {p["name"]: p["containerPort"] for p in zk["ports"]}
    headless = sts["spec"]["serviceName"]
    cfg = zookeeper_cfg(zk)
    # With TLS (components/tls) the client ports are in zoo.cfg: TLS on the container's client port, and
    # plaintext on the loopback only.
    client = "" if "secureClientPort" in cfg else f";{ports['client']}"
    expected = [
        f"server.{i + 1}={sts['metadata']['name']}-{i}.{headless}:{ports['follower']}:{ports['election']}{client}"
        for i in range(sts["spec"]["replicas"])
    ]
    assert env["ZOO_SERVERS"].split() == expected
    if not client:
        assert int(cfg["secureClientPort"]) == ports["client"]
        assert cfg["clientPortAddress"] == "127.0.0.1"
    # The ordinal-to-myid script leaves nothing for Kubernetes' own $(VAR) expansion to touch.
    assert all(expand(part, lambda _: "X") == part for part in zk["command"])


def test_nodes_get_the_time_their_graceful_leave_takes(objs: list[Obj]) -> None:
    sts = find(objs, "StatefulSet", "keyroute-node")
    spec = pod_template(sts)["spec"]
    [c] = spec["containers"]
    env = container_env(objs, c, pod_name="keyroute-node-0")
    args = build_parser(env).parse_args(resolve_argv(c, env)[1:])
    drain_s = getattr(args, "drain_timeout_s", 60.0)  # the CLI's value for the drain, as configured
    assert spec["terminationGracePeriodSeconds"] >= 120
    assert spec["terminationGracePeriodSeconds"] >= drain_s + NODE_SHUTDOWN_S + 10, (
        "the kubelet would SIGKILL a node still handing its partitions over"
    )
