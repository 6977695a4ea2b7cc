"""Priorities and resources: serving pods outrank batch pods, containers are bounded."""

from __future__ import annotations

import re
from pathlib import Path

from keyroute.cli import build_parser
from tests.k8s_render import (
    ROOT,
    Obj,
    find,
    of_kind,
    pod_template,
    resolve_argv,
)
from tests.unit.k8s.manifests import (
    NODE_SHUTDOWN_S,
    README,
    container_env,
    pipeline_pods,
    pod_specs,
    spark_confs,
    with_object_store_secret,
)


def quantity(text: str | int) -> float:
    """A Kubernetes quantity (or a JVM size such as 6g, 512m) in bytes."""
    text = str(text)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9,
             "g": 2**30, "m": 2**20}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def test_serving_pods_outrank_batch_pods(any_overlay: tuple[str, list[Obj]]) -> None:
    overlay_name, objs = any_overlay
    classes = {pc["metadata"]["name"]: pc for pc in of_kind(objs, "PriorityClass")}
    assert set(classes) == {"keyroute-serving", "keyroute-batch"}
    assert classes["keyroute-serving"]["value"] > classes["keyroute-batch"]["value"]
    assert classes["keyroute-batch"].get("preemptionPolicy") == "Never"
    assert not any(pc.get("globalDefault") for pc in classes.values())
    for where, spec in pod_specs(objs):
        batch = where.startswith(("CronJob", "Job", "spark executor"))
        assert spec.get("priorityClassName") == ("keyroute-batch" if batch else "keyroute-serving"), where


def test_every_container_bounds_memory_and_ephemeral_storage(any_overlay: tuple[str, list[Obj]]) -> None:
    _, objs = any_overlay
    for where, spec in pod_specs(objs):
        for c in spec["containers"]:
            resources = c.get("resources", {})
            for kind in ("requests", "limits"):
                assert "ephemeral-storage" in resources.get(kind, {}), f"{where}/{c['name']}: {kind}"
    nodes = pod_template(find(objs, "StatefulSet", "keyroute-node"))["spec"]["containers"][0]["resources"]
    assert quantity(nodes["requests"]["memory"]) == quantity(nodes["limits"]["memory"])


# The driver's JVM beyond its heap (Spark's rule for the pods it sizes) and the Python process driving it.
def jvm_overhead(heap: float) -> float:
    return max(384 * 2**20, 0.1 * heap)

DRIVER_PYTHON_BYTES = 512 * 2**20


def test_the_spark_driver_heap_fits_its_container(any_overlay: tuple[str, list[Obj]]) -> None:
    _, objs = any_overlay
    for pod in pipeline_pods(objs):
        [c] = pod["spec"]["containers"]
        confs = spark_confs(container_env(with_object_store_secret(objs), c)["PYSPARK_SUBMIT_ARGS"])
        heap = quantity(confs["spark.driver.memory"])
        limit = quantity(c["resources"]["limits"]["memory"])
        assert heap + jvm_overhead(heap) + DRIVER_PYTHON_BYTES <= limit, (confs["spark.driver.memory"], limit)
        assert heap >= limit / 3, "most of the container should be the heap"
        # Executors: memory from Spark's settings, the Python workers' share on top.
        assert quantity(confs["spark.executor.memory"]) > 0
        assert float(confs["spark.executor.memoryOverheadFactor"]) >= 0.4


RESULTS = ROOT / "benchmarks" / "RESULTS.md"


def measured_partition_move_s() -> float:
    """The slowest measured move of a 1,000,000-row partition to another node (benchmarks/RESULTS.md,
    "Rebalance": assignment -> the new owner's serving record, median)."""
    section = RESULTS.read_text().split("### Rebalance", 1)[1].split("\n## ", 1)[0]
    medians = [float(m) for m in re.findall(r"^\| [^|]+\| 1,000,000 \| [^|]+\| \*\*([0-9.]+) s\*\*", section, re.M)]
    assert medians, "no 1,000,000-row rebalance figure in benchmarks/RESULTS.md"
    return max(medians)


def test_node_grace_period_is_sized_from_the_measured_hand_over(objs: list[Obj], tmp_path: Path) -> None:
    move_s = measured_partition_move_s()
    sts = find(objs, "StatefulSet", "keyroute-node")
    spec = pod_template(sts)["spec"]
    [c] = spec["containers"]
    env = container_env(objs, c, pod_name="keyroute-node-0")
    drain_s = build_parser(env).parse_args(resolve_argv(c, env)[1:]).drain_timeout_s
    # What a leaving node holds, and must see served by its new assignees before it goes.
    from keyroute.pipeline.spec import load_spec

    spec_text = find(objs, "ConfigMap", next(
        v["configMap"]["name"] for v in pipeline_pods(objs)[0]["spec"]["volumes"] if v["name"] == "stores"
    ))["data"]["stores.toml"]
    path = tmp_path / "stores.toml"
    path.write_text(spec_text)
    stores = load_spec(path).stores
    nodes = sts["spec"]["replicas"]
    replicas = sum(s.partitions * s.replication_factor for s in stores)
    held = -(-replicas // nodes)
    # With fewer other nodes than replicas, the others already hold every partition: nothing moves.
    moves = held if nodes - 1 >= max(s.replication_factor for s in stores) else 0
    assert drain_s >= 2 * moves * move_s, f"{moves} moves of {move_s} s need a drain of {2 * moves * move_s:.0f} s"
    assert spec["terminationGracePeriodSeconds"] >= drain_s + NODE_SHUTDOWN_S + 2
    # The arithmetic is written where operators look, with the figure it starts from.
    figure = f"{move_s:.2f} s"
    node_yaml = (ROOT / "deploy" / "k8s" / "base" / "node.yaml").read_text()
    assert figure in node_yaml and figure in README.read_text()
