"""Every pod passes the restricted Pod Security Standard."""

from __future__ import annotations

from tests.k8s_render import (
    Obj,
    of_kind,
)
from tests.unit.k8s.manifests import (
    pod_specs,
)

PSS_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                    "projected", "secret"}


def restricted_violations(spec: Obj) -> list[str]:
    """What the Pod Security Standards' `restricted` profile (latest) refuses in a pod spec."""
    out = []
    pod_sc = spec.get("securityContext", {})
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(host):
            out.append(host)
    for v in spec.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= PSS_VOLUME_TYPES:
            out.append(f"volume {v['name']}: {sorted(kinds)}")
    if not isinstance(pod_sc.get("runAsUser", 1), int) or pod_sc.get("runAsUser") == 0:
        out.append("pod runAsUser")
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities not dropped")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: capabilities added")
        if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True:
            out.append(f"{name}: runAsNonRoot")
        user = sc.get("runAsUser", pod_sc.get("runAsUser"))
        if not isinstance(user, int) or user == 0:
            out.append(f"{name}: no numeric non-root runAsUser")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile {seccomp}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{name}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{name}: procMount")
    return out


def test_the_restricted_check_refuses_what_restricted_refuses() -> None:
    good = {"securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False,
                                                             "capabilities": {"drop": ["ALL"]}}}]}
    assert restricted_violations(good) == []
    for breaking in (
        {"hostNetwork": True},
        {"volumes": [{"name": "h", "hostPath": {"path": "/"}}]},
        {"securityContext": {**good["securityContext"], "seccompProfile": {"type": "Unconfined"}}},
        {"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}},
        {"containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False}}]},
    ):
        assert restricted_violations({**good, **breaking}), breaking


def test_every_pod_passes_the_restricted_pod_security_standard(any_overlay: tuple[str, list[Obj]]) -> None:
    overlay_name, objs = any_overlay
    # Each namespace the overlay makes (prod's pipeline has its own), the executors' included.
    for namespace in of_kind(objs, "Namespace"):
        labels = namespace["metadata"]["labels"]
        for mode in ("enforce", "audit", "warn"):
            assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted", (namespace["metadata"]["name"], mode)
    for where, spec in pod_specs(objs):
        assert restricted_violations(spec) == [], f"{overlay_name}: {where}"
