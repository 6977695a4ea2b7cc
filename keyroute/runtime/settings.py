"""Typed settings for every keyroute service, built once at the edge (the CLI) and passed inward.

No module reads the environment on its own; units are part of every timing name.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keyroute.api import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_KEY_BYTES,
)

# The JWKS is fetched again this often (--jwt-jwks-refresh-s): a key the issuer removed stops authenticating
# within one period.
JWKS_REFRESH_S = 300.0

# A read none of whose requests has replied after this long goes to the next replica (RouterSettings).
DEFAULT_STALL_AFTER_MS = 250.0

@dataclass(frozen=True, slots=True)
class ZkIdentity:
    """A ZooKeeper digest identity, written `user:password`; the password never appears in a repr or log."""

    user: str
    password: str = field(repr=False)

    def __post_init__(self) -> None:
        if not self.user or ":" in self.user or self.user != self.user.strip():
            raise ValueError("a ZooKeeper digest user must be non-empty, without ':' or surrounding spaces")
        if not self.password:
            raise ValueError(f"the ZooKeeper digest identity {self.user!r} has an empty password")

    @classmethod
    def parse(cls, text: str) -> ZkIdentity:
        """`user:password` (the password may itself contain ':'). Messages never repeat the password."""
        user, colon, password = text.partition(":")
        if not colon:
            raise ValueError("expected USER:PASSWORD (a ZooKeeper digest identity), found no ':'")
        return cls(user, password)

    @property
    def credential(self) -> str:
        """What the digest scheme authenticates with (`add_auth("digest", ...)`)."""
        return f"{self.user}:{self.password}"


@dataclass(frozen=True, slots=True)
class ZkTls:
    """TLS to ZooKeeper (its secure client port): the CA its server certificates chain to and, when the
    server asks for one or identities come from certificates, this process's certificate and key (PEM)."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a ZooKeeper TLS client certificate needs its key, and a key its certificate")


@dataclass(frozen=True, slots=True)
class ZkSettings:
    """Where the ZooKeeper ensemble is, how long a session may go silent, and who this process is there.

    `auth` is the digest identity this process authenticates as. Without it, a client certificate
    (`tls.cert`) makes the certificate's subject DN this process's identity (scheme `x509`); with neither,
    everything keyroute creates keeps ZooKeeper's world-open ACL. `reader` (digest) and `reader_dn`
    (x509), for processes that write (nodes, pipeline, rollback), are the identities granted READ on what
    they create; they need an identity of this process's own (granted everything).
    """

    hosts: str = "127.0.0.1:2181"
    chroot: str = ""
    session_timeout_s: float = 10.0
    connect_timeout_s: float = 15.0
    auth: ZkIdentity | None = None
    reader: ZkIdentity | None = None
    tls: ZkTls | None = None
    reader_dn: str = ""

    def __post_init__(self) -> None:
        if (self.reader is not None or self.reader_dn) and not self.has_identity:
            raise ValueError(
                "a ZooKeeper reader identity needs an identity to authenticate as (auth or a TLS client certificate)"
            )

    @property
    def has_identity(self) -> bool:
        return self.auth is not None or (self.tls is not None and self.tls.cert is not None)

    @classmethod
    def parse(cls, connect: str, **kwargs: Any) -> ZkSettings:
        """Split `host:port[,host:port...][/chroot]` into hosts and chroot."""
        connect = connect.strip()
        if not connect:
            raise ValueError("ZooKeeper address is empty (expected HOST:PORT[/chroot])")
        hosts, slash, chroot = connect.partition("/")
        if not hosts:
            raise ValueError(f"ZooKeeper address {connect!r} names no host")
        chroot = ("/" + chroot.strip("/")) if slash and chroot.strip("/") else ""
        return cls(hosts=hosts, chroot=chroot, **kwargs)

    @property
    def connect_string(self) -> str:
        return self.hosts + self.chroot


@dataclass(frozen=True, slots=True)
class TlsSettings:
    """PEM files for HTTPS and mutual TLS between members (paths; "" = not given). `cert` and `key`: what this
    process serves and, with `member_ca`, presents to the nodes it connects to (naming this member's role and
    id: keyroute.auth.security.member_identity). `client_ca`: clients must present a certificate chaining to
    it (routers: a certificate naming a member identity is refused; nodes: direct clients' CA, beside
    `member_ca`, never the same CA). `member_ca`: the members' CA; nodes then require every client to present a
    certificate chaining to it or to `client_ca` (member headers honoured only from a member certificate of
    `member_ca`, within its role and id), and routers and nodes verify nodes against it."""

    cert: str = ""
    key: str = ""
    client_ca: str = ""
    member_ca: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        if (self.client_ca or self.member_ca) and not self.cert:
            raise ValueError("--tls-client-ca and --member-ca need --tls-cert and --tls-key")

    @property
    def enabled(self) -> bool:
        """Whether the service listens over HTTPS."""
        return bool(self.cert)


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """Where a service listens and the address other members use to reach it."""

    host: str = "127.0.0.1"
    port: int = 8080
    advertise_url: str = ""
    # A second port for /admin/*, /metrics (and probes, the API document); the data port then answers those
    # two with 404. None: everything on `port`; 0: any free port (tests).
    admin_port: int | None = None
    tls: TlsSettings = field(default_factory=TlsSettings)

    @property
    def url(self) -> str:
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        scheme = "https" if self.tls.enabled else "http"
        return f"{scheme}://{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one request may cost a router or node; each answered with a JSON error. 0 switches one off."""

    max_key_bytes: int = DEFAULT_MAX_KEY_BYTES  # 414 key_too_long (a batch-get entry: 400)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # 413 body_too_large
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES  # request line + header fields: 431 headers_too_large
    # Beyond it: 503 overloaded with Retry-After at once, never queued.
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    # Requests in progress of one named caller at once (0: only its fair share once the process is saturated).
    max_concurrent_per_caller: int = 0
    # The whole request body must arrive within this long (408 body_timeout), so a client that never
    # finishes one cannot hold a request slot.
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S


@dataclass(frozen=True, slots=True)
class AccessSettings:
    """Secrets (never shown in a repr): the cluster secret members prove themselves with, the admin token;
    and where callers' identities come from (a token file, a JWT issuer)."""

    cluster_secret: str = field(default="", repr=False)
    admin_token: str = field(default="", repr=False)
    metrics_require_token: bool = False
    # With access control on, /metrics needs an admin caller (its labels name every store and caller) unless
    # this reopens it for scrapers without credentials.
    metrics_open: bool = False
    # Who callers are (keyroute.auth.authn); none given: every caller may read every store.
    access_tokens: str = ""  # a TOML or JSON token file, re-read when it changes
    jwt_issuer: str = ""
    jwt_audience: str = ""
    jwt_jwks_url: str = ""
    jwt_jwks_file: str = ""
    # The JWKS is fetched again this often, in the background: a key removed from it stops authenticating
    # within one period.
    jwt_jwks_refresh_s: float = JWKS_REFRESH_S
    # An http:// --jwt-jwks-url is refused unless this is set (tests, local issuers).
    jwt_jwks_allow_http: bool = False
    jwt_stores_claim: str = "keyroute_stores"
    jwt_groups_claim: str = ""
    jwt_groups_file: str = ""


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """A state node: identity, storage and how it reaches its peers."""

    node_id: str
    data_dir: Path
    zk: ZkSettings = field(default_factory=ZkSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    forward_timeout_s: float = 5.0
    # The failure domain (availability zone, rack) this node runs in; "" = none. Replicas of a partition go
    # to different zones when the cluster has enough of them.
    zone: str = ""
    max_batch_keys: int = 1000
    lmdb_map_size_bytes: int = 1 << 34
    # On SIGTERM: how long to wait for other nodes to serve this node's partitions before leaving anyway.
    drain_timeout_s: float = 60.0
    # On SIGTERM (no drain request): how long the controller keeps this node's partitions assigned to it while it
    # restarts (0: hand them over as on a departure).
    restart_grace_s: float = 120.0
    # How long a superseded version's files stay on disk (a rollback within it reuses them at once).
    version_grace_s: float = 300.0
    # How long a read bounded by `min_offset` waits for a live partition to apply it before 503 not_up_to_bound.
    min_offset_wait_ms: float = 500.0
    # Live stores: records asked of the Kafka client per consume call (each partition's share of them is
    # applied in one LMDB write transaction, its offset with it).
    live_batch_records: int = 2000
    # Live stores: how often each partition's commits are flushed to disk (0: after every commit).
    live_sync_ms: float = 1000.0
    limits: RequestLimits = field(default_factory=RequestLimits)
    access: AccessSettings = field(default_factory=AccessSettings)
    # Reads/s per identity and store for direct reads (keyroute.http.quotas), re-read when it changes; "": none.
    quota_file: str = ""


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """A router: where it listens and how patiently it talks to nodes."""

    zk: ZkSettings = field(default_factory=ZkSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    upstream_timeout_s: float = 5.0
    upstream_connect_timeout_s: float = 1.0
    max_batch_keys: int = 1000
    unavailable_retry_after_s: int = 1
    # A single-key read not answered after this long is also sent to another serving replica.
    # None: automatic (p95 of recent upstream latencies, within 2 ms..1 s); 0: never.
    hedge_after_ms: float | None = None
    # Hedges allowed, as a percentage of primary requests (plus a small burst).
    retry_budget_percent: float = 10.0
    # A read none of whose requests has replied after this long goes to the next replica whatever the budget
    # (a frozen node answers nothing); 0: never.
    stall_after_ms: float = DEFAULT_STALL_AFTER_MS
    # Processes sharing the listening port, each a whole router (map watcher, pools, metrics).
    workers: int = 1
    limits: RequestLimits = field(default_factory=RequestLimits)
    access: AccessSettings = field(default_factory=AccessSettings)
    # Reads/s per identity and store (keyroute.http.quotas), re-read when it changes; "": no quotas.
    quota_file: str = ""
    # The id its member certificate names (keyroute-router.<id>.<domain>); "": the host name (a pod's name).
    router_id: str = ""

    @property
    def member_id(self) -> str:
        """This router's id as a member: `router_id`, else the host name."""
        return self.router_id or socket.gethostname()
