"""A node's zone: read from its Kubernetes Node's labels (`keyroute zone-from-node`), or from a file at start.

Kubernetes copies the Node's `topology.kubernetes.io/zone` label onto pods only with PodTopologyLabelsAdmission
(beta, on by default, from 1.35; KEP-4742). On any version, an init container may read the label from the
Node itself, as Strimzi's rack awareness does: `zone_from_node` GETs /api/v1/nodes/{name} with the pod's
service-account token (a ClusterRole that may only `get` `nodes`) and `write_zone` leaves the value in a
file the node container reads with `--zone-file`.
"""

from __future__ import annotations

import json
import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

if TYPE_CHECKING:
    import httpx


# The label cloud providers set on every Node, and the one it replaced (still set by some providers).
ZONE_LABEL = "topology.kubernetes.io/zone"
LEGACY_ZONE_LABEL = "failure-domain.beta.kubernetes.io/zone"
ZONE_LABELS = (ZONE_LABEL, LEGACY_ZONE_LABEL)
# Where the kubelet (or a projected volume) puts a pod's service-account token and the cluster's CA.
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class ZoneError(Exception):
    """The zone could not be found or given: the message is one line for the operator."""


@dataclass(frozen=True, slots=True)
class NodeZone:
    node_name: str
    zone: str  # "" when the Node has neither label
    label: str | None  # the label the zone came from


def in_cluster_api_url(env: Mapping[str, str]) -> str:
    """The API server's URL from the variables the kubelet sets in every container ("" outside a cluster)."""
    host = env.get("KUBERNETES_SERVICE_HOST", "").strip()
    if not host:
        return ""
    port = env.get("KUBERNETES_SERVICE_PORT", "").strip() or "443"
    if ":" in host:  # IPv6
        host = f"[{host}]"
    return f"https://{host}:{port}"


def zone_from_node(
    node_name: str, api_url: str, service_account_dir: Path = SERVICE_ACCOUNT_DIR, timeout_s: float = 10.0
) -> NodeZone:
    """The zone label of the Kubernetes Node `node_name`, asked of the API server at `api_url` with the
    service account's token (and, over https, its CA). ZoneError on anything but an answer."""
    if not node_name.strip():
        raise ZoneError("no node name: give --node-name (KEYROUTE_NODE_NAME, from the downward API spec.nodeName)")
    if not api_url:
        raise ZoneError(
            "no API server: KUBERNETES_SERVICE_HOST is not set (not in a pod?); give --api-url (KEYROUTE_API_URL)"
        )
    token_file = service_account_dir / "token"
    try:
        token = token_file.read_text().strip()
    except OSError as exc:
        raise ZoneError(f"cannot read the service-account token {token_file}: {exc.strerror or exc}") from None
    verify: ssl.SSLContext | bool = True
    if api_url.startswith("https://"):
        ca_file = service_account_dir / "ca.crt"
        try:
            verify = ssl.create_default_context(cafile=str(ca_file))
        except (OSError, ssl.SSLError) as exc:
            raise ZoneError(f"cannot read the cluster CA {ca_file}: {exc}") from None
    import httpx  # here: `keyroute --help` and the other commands do not pay for it

    url = f"{api_url.rstrip('/')}/api/v1/nodes/{quote(node_name.strip(), safe='')}"
    try:
        # trust_env off: the API server is inside the cluster, never behind a proxy a pod's environment names.
        with httpx.Client(verify=verify, timeout=timeout_s, trust_env=False) as client:
            response = client.get(url, headers={"Authorization": f"Bearer {token}", "Accept": "application/json"})
    except httpx.HTTPError as exc:
        raise ZoneError(f"GET {url} failed: {type(exc).__name__}: {' '.join(str(exc).split())}") from None
    if response.status_code != 200:
        raise ZoneError(f"GET {url} answered {response.status_code}: {_why(response)}")
    try:
        labels = json.loads(response.content).get("metadata", {}).get("labels") or {}
    except (ValueError, AttributeError):
        labels = None
    if not isinstance(labels, dict):
        raise ZoneError(f"GET {url} answered 200 with no Node object")
    for label in ZONE_LABELS:
        value = labels.get(label)
        if isinstance(value, str) and value.strip():
            return NodeZone(node_name, value.strip(), label)
    return NodeZone(node_name, "", None)


def _why(response: httpx.Response) -> str:
    """The API server's own reason (its Status object's message), with a hint for the usual refusals."""
    try:
        message = str(json.loads(response.content).get("message", "")).strip()
    except (ValueError, AttributeError):
        message = ""
    message = message or response.reason_phrase or "no reason given"
    if response.status_code in (401, 403):
        message += " (the pod's service account needs `get` on `nodes`: ClusterRole keyroute-node-zone)"
    return " ".join(message.split())


def write_zone(path: Path, zone: str) -> None:
    """`zone` into `path`, atomically (a reader sees the old file or the whole new one); "" leaves it empty."""
    directory = path.parent
    try:
        fd, partial = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as f:
            f.write(f"{zone}\n" if zone else "")
        os.replace(partial, path)
    except OSError as exc:
        raise ZoneError(f"cannot write the zone to {path}: {exc.strerror or exc}") from None


def read_zone_file(path: Path) -> str:
    """The zone a file holds ("" when empty). ZoneError when it cannot be read or holds more than a name."""
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ZoneError(f"cannot read --zone-file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if len(text.split()) > 1:
        raise ZoneError(f"--zone-file {path} must hold one zone name, found {text[:80]!r}")
    return text


def node_zone(zone: str, zone_file: Path | None, required: bool) -> str:
    """The node's zone: `zone` (--zone) when given, else the content of `zone_file`; ZoneError when
    `required` and neither gives one."""
    zone = zone.strip()
    if not zone and zone_file is not None:
        zone = read_zone_file(zone_file)
    if required and not zone:
        where = f" ({zone_file} is empty)" if zone_file is not None else ""
        raise ZoneError(
            "--require-zone: this node has no zone; give one with --zone (KEYROUTE_ZONE) or --zone-file "
            f"(KEYROUTE_ZONE_FILE, written by `keyroute zone-from-node`){where}"
        )
    return zone
