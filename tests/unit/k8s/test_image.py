"""The Dockerfile's images, and which image each workload runs."""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import tomllib
from pathlib import Path

import yaml

from tests.k8s_render import (
    ROOT,
    Obj,
    pod_template,
    workloads,
)
from tests.unit.k8s.manifests import (
    IMAGE_PREFIX,
    KEYROUTE_IMAGES,
    OBJECT_STORAGE,
    PIPELINE_IMAGE,
    SERVING_IMAGE,
    container_env,
    dockerfile_copy_target,
    dockerfile_entrypoint,
    dockerfile_instructions,
    dockerfile_stages,
    dockerfile_target,
    dockerfile_user,
    image_name,
    pipeline_pods,
    spark_confs,
    with_object_store_secret,
)

CONSTRAINTS = "deploy/docker/constraints.txt"
TINI = "/usr/bin/tini"


def bind_mount_sources(run: str) -> list[str]:
    """The build-context files a RUN mounts (`--mount=type=bind,source=...` without `from=`)."""
    sources = []
    for mount in re.findall(r"--mount=(\S+)", run):
        options = dict(part.partition("=")[::2] for part in mount.split(","))
        if options.get("type") == "bind" and "from" not in options:
            sources.append(options["source"])
    return sources


def test_the_images_run_keyroute_under_tini_as_a_non_root_user() -> None:
    stages = dockerfile_stages()
    assert {IMAGE_PREFIX + target for target in ("serving", "pipeline")} == set(KEYROUTE_IMAGES)
    for target in ("serving", "pipeline"):
        instructions = dockerfile_target(target)
        assert instructions[-1] == ("CMD", '["--help"]')
        # tini as PID 1 forwards SIGTERM and reaps Spark's and uvloop's children; the manifests' `args` follow.
        assert dockerfile_entrypoint(target) == [TINI, "--", "keyroute"]
        words = [w for w, _ in instructions]
        assert dockerfile_user(IMAGE_PREFIX + target) >= 1000
        assert len(words) - 1 - words[::-1].index("USER") > max(i for i, w in enumerate(words) if w == "RUN"), (
            f"{target}: USER comes after every RUN (installing needs root, running does not)"
        )
        runs = " ".join(rest for word, rest in instructions if word == "RUN")
        assert re.search(r"apt-get install [^&]*\btini\b", runs), f"{target} does not install tini"
        assert TINI == "/usr/bin/tini"  # where Debian's package puts it
    # The stages a target is built from never reach it: the wheel stage's sources stay behind.
    assert not any(word == "COPY" for word, _ in stages["serving"])
    assert list(stages)[-1] == "serving", "a plain `docker build .` makes the lean image"


def test_the_base_image_is_pinned_by_digest() -> None:
    froms = [rest.partition(" AS ")[0].strip() for word, rest in dockerfile_instructions() if word == "FROM"]
    stages = dockerfile_stages()
    external = [image for image in froms if image not in stages]
    assert external, "no base image"
    for image in external:
        name, _, digest = image.partition("@")
        assert name == "python:3.11-slim-bookworm", image
        assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest), f"{image} is not pinned by digest"


def test_the_serving_image_has_no_jre_and_no_pyspark() -> None:
    serving = " ".join(rest for word, rest in dockerfile_target("serving") if word in ("RUN", "ENV"))
    pipeline = " ".join(rest for word, rest in dockerfile_target("pipeline") if word in ("RUN", "ENV"))
    assert "openjdk" not in serving and "[pipeline]" not in serving and "SPARK_HOME" not in serving
    assert "openjdk-17-jre-headless" in pipeline and "keyroute[pipeline]" in pipeline and "SPARK_HOME" in pipeline
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert not [d for d in pyproject["project"]["dependencies"] if d.lower().startswith(("pyspark", "pandas"))], (
        "pyspark or pandas in the default dependencies would land in the serving image"
    )
    for target, text in (("serving", serving), ("pipeline", pipeline)):
        installs = re.findall(r"pip install ([^&]*)", text)
        assert installs, target
        for install in installs:
            assert "--constraint /tmp/constraints.txt" in install, f"{target}: {install} is not constrained"
        assert CONSTRAINTS in [s for word, rest in dockerfile_target(target) for s in bind_mount_sources(rest)]


def _requirement_closure(roots: list[str]) -> dict[str, str]:
    """name -> installed version of every distribution `roots` need here (markers for this interpreter)."""
    import importlib.metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, str] = {}
    todo = [(Requirement(r), "") for r in roots]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        dist = importlib.metadata.distribution(req.name)
        if name not in found:
            found[name] = dist.version
            todo += [(Requirement(r), "") for r in dist.requires or []]
        for wanted in req.extras:
            todo += [(Requirement(r), wanted) for r in dist.requires or [] if "extra" in r]
    return found


def test_the_constraints_pin_exactly_the_runtime_dependencies_as_tested() -> None:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins: dict[str, str] = {}
    for line in (ROOT / CONSTRAINTS).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version and not any(c in version for c in "<>=!~*, ;"), f"not an exact pin: {line}"
            pins[canonicalize_name(name)] = version
    assert pins, CONSTRAINTS
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    roots = [*project["dependencies"], *project["optional-dependencies"]["pipeline"]]
    closure = _requirement_closure(roots)
    # Every runtime dependency and everything it pulls in, at the version the tests run, and nothing else
    # (no test or development tool).
    assert set(pins) == set(closure), (
        f"missing: {sorted(set(closure) - set(pins))}, not needed: {sorted(set(pins) - set(closure))}"
    )
    assert {name: pins[name] for name in closure} == closure
    for root in roots:
        req = Requirement(root)
        if req.marker is None or req.marker.evaluate():
            assert req.specifier.contains(pins[canonicalize_name(req.name)], prereleases=True), root


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if pattern.startswith("**/"):
            hit = any(fnmatch.fnmatch(c.rsplit("/", 1)[-1], pattern[3:]) for c in candidates)
        else:
            hit = any(fnmatch.fnmatch(c, pattern) and c.count("/") == pattern.count("/") for c in candidates)
        if hit:
            excluded = not negate
    return excluded


def test_every_copy_source_exists_and_reaches_the_build_context() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = []
    for word, rest in dockerfile_instructions():
        if word == "COPY":
            args = [a for a in rest.split() if not a.startswith("--")]
            sources += args[:-1]
        if word == "RUN":
            sources += bind_mount_sources(rest)
    assert CONSTRAINTS in sources
    assert "pyproject.toml" in sources and "README.md" in sources
    for source in sources:
        path = ROOT / source
        assert path.exists(), f"COPY {source}: no such file"
        files = [p for p in path.rglob("*.py")] if path.is_dir() else [path]
        assert files, source
        for f in files:
            relative = f.relative_to(ROOT).as_posix()
            if "__pycache__" not in relative:
                assert not dockerignored(relative, patterns), f"{relative} is excluded by .dockerignore"
    # Every package pyproject installs is copied.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert folders <= set(sources)
    assert dockerignored(".venv/bin/python", patterns) and dockerignored("tests/conftest.py", patterns)


def test_the_executor_launcher_starts_spark_s_executor_backend(tmp_path: Path) -> None:
    """The image's `keyroute-spark-executor` (named in the executor pod template) with a stand-in `java`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    java = bin_dir / "java"
    java.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    java.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SPARK_HOME": "/opt/pyspark",
        "SPARK_EXECUTOR_MEMORY": "4g",
        "SPARK_DRIVER_URL": "spark://CoarseGrainedScheduler@10.0.0.7:7078",
        "SPARK_EXECUTOR_ID": "3",
        "SPARK_EXECUTOR_CORES": "2",
        "SPARK_APPLICATION_ID": "spark-app-1",
        "SPARK_EXECUTOR_POD_IP": "10.0.0.9",
        "SPARK_RESOURCE_PROFILE_ID": "0",
        "SPARK_EXECUTOR_POD_NAME": "keyroute-pipeline-exec-3",
        "SPARK_JAVA_OPT_10": "-Dten",
        "SPARK_JAVA_OPT_2": "-Dspark.driver.port=7078",
        "SPARK_JAVA_OPT_0": "--add-opens=java.base/java.lang=ALL-UNNAMED",
    }
    script = ROOT / "deploy" / "docker" / "spark-executor.sh"
    assert dockerfile_copy_target() == "/usr/local/bin/keyroute-spark-executor"  # on PATH in the image
    done = subprocess.run(
        ["bash", str(script), "executor"], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.splitlines() == [
        "--add-opens=java.base/java.lang=ALL-UNNAMED",
        "-Dspark.driver.port=7078",
        "-Dten",
        "-Xms4g",
        "-Xmx4g",
        "-cp",
        "/opt/pyspark/jars/*",
        "org.apache.spark.scheduler.cluster.k8s.KubernetesExecutorBackend",
        "--driver-url",
        "spark://CoarseGrainedScheduler@10.0.0.7:7078",
        "--executor-id",
        "3",
        "--cores",
        "2",
        "--app-id",
        "spark-app-1",
        "--hostname",
        "10.0.0.9",
        "--resourceProfileId",
        "0",
        "--podName",
        "keyroute-pipeline-exec-3",
    ]
    refused = subprocess.run(["bash", str(script), "driver"], env=env, capture_output=True, text=True)
    assert refused.returncode == 2


def test_routers_and_nodes_run_the_serving_image_the_pipeline_its_own(any_overlay: tuple[str, list[Obj]]) -> None:
    overlay_name, objs = any_overlay
    images = {}
    for w in workloads(objs):
        for c in pod_template(w)["spec"]["containers"]:
            images[w["metadata"]["name"]] = c["image"]
    assert image_name(images["keyroute-router"]) == image_name(images["keyroute-node"]) == SERVING_IMAGE
    assert image_name(images["keyroute-pipeline"]) == PIPELINE_IMAGE
    assert image_name(images["keyroute-zookeeper"]) == "zookeeper"
    for pod in pipeline_pods(objs):
        env = container_env(with_object_store_secret(objs), pod["spec"]["containers"][0])
        confs = spark_confs(env["PYSPARK_SUBMIT_ARGS"])
        assert confs["spark.kubernetes.container.image"] == images["keyroute-pipeline"]
    kustomization_file = ROOT / "deploy" / "k8s" / "overlays" / overlay_name / "kustomization.yaml"
    kustomization = yaml.safe_load(kustomization_file.read_text())
    if overlay_name != OBJECT_STORAGE:  # it takes prod's
        # prod names ZooKeeper's too: every image by digest, ZooKeeper's from the operator's mirror.
        zookeeper = {"zookeeper"} if overlay_name == "prod" else set()
        assert {i["name"] for i in kustomization["images"]} == set(KEYROUTE_IMAGES) | zookeeper
