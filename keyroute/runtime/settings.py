"""Typed settings for every keyroute service, built once at the edge (the CLI) and passed inward.

No module reads the environment on its own; units are part of every timing name. A field that the command
line sets is declared with `option`: its default and its help are written here once, and the CLI makes the
option (`--` + the field's name, and its KEYROUTE_* variable) from them; docs/configuration.md's tables are
checked against the options.
"""

from __future__ import annotations

import dataclasses
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

ENV_PREFIX = "KEYROUTE_"


def env_name(flag: str) -> str:
    """The environment variable of a command-line option: `--zk-auth` -> KEYROUTE_ZK_AUTH."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


@dataclass(frozen=True, slots=True)
class Option:
    """A settings field as the command line takes it."""

    name: str  # the field's
    flag: str
    default: Any  # the field's
    help: str
    # What the command line shows and takes as the default, where the value has no spelling of its own
    # (None for "auto"); else the default itself.
    spelled: Any

    @property
    def env(self) -> str:
        return env_name(self.flag)


def option(default: Any, help: str, *, flag: str = "", spelled: Any = None, repr: bool = True) -> Any:
    """A field the command line sets: its default and --help text. The flag is `--` + the field's name with
    `-` for `_`, unless given; `spelled`: the default as the command line writes it, when not the value."""
    metadata = {"option": (flag, help, spelled)}
    return field(default=default, repr=repr, metadata=metadata)


def options(settings: type) -> dict[str, Option]:
    """The fields of a settings class declared with `option`, by field name."""
    found = {}
    for f in dataclasses.fields(settings):
        if "option" in f.metadata:
            flag, help, spelled = f.metadata["option"]
            flag = flag or "--" + f.name.replace("_", "-")
            found[f.name] = Option(f.name, flag, f.default, help, f.default if spelled is None else spelled)
    return found


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
    session_timeout_s: float = option(10.0, "ZooKeeper session timeout", flag="--zk-session-timeout-s")
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

    cert: str = option(
        "",
        "PEM certificate (chain) to serve HTTPS with on every port; reloaded when the file changes",
        flag="--tls-cert",
    )
    key: str = option("", "PEM private key of --tls-cert", flag="--tls-key")
    # Routers' clients; a node's help says what it is for a node (keyroute.cli.serving).
    client_ca: str = option(
        "",
        "PEM CA file: clients must present a certificate chaining to it (mutual TLS with clients); a client "
        "certificate naming a member role is refused",
        flag="--tls-client-ca",
    )
    member_ca: str = option(
        "",
        "PEM CA file of the cluster's members: connect to nodes over TLS presenting --tls-cert, and (nodes) "
        "require every client's certificate to chain to it, honouring member headers from routers and nodes only",
    )

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

    host: str = option("127.0.0.1", "address to listen on")
    port: int = 8080
    advertise_url: str = option("", "URL other members use to reach this node")
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

    max_key_bytes: int = option(
        DEFAULT_MAX_KEY_BYTES,
        "longest key in bytes, UTF-8 after percent-decoding (414, or 400 for a batch entry); 0: no limit",
    )
    max_body_bytes: int = option(DEFAULT_MAX_BODY_BYTES, "largest request body (413 body_too_large); 0: no limit")
    max_header_bytes: int = option(
        DEFAULT_MAX_HEADER_BYTES, "largest request line plus headers (431 headers_too_large); 0: no limit"
    )
    # Beyond it: 503 overloaded with Retry-After at once, never queued.
    max_concurrent_requests: int = option(
        DEFAULT_MAX_CONCURRENT_REQUESTS,
        "requests in progress at once; beyond it 503 overloaded with Retry-After at once, never queued; 0: no limit",
    )
    # Requests in progress of one named caller at once (0: only its fair share once the process is saturated).
    max_concurrent_per_caller: int = option(
        0,
        "requests in progress at once of one authenticated caller (503 overloaded beyond it); 0: only its "
        "fair share once the process is saturated",
    )
    # The whole request body must arrive within this long (408 body_timeout), so a client that never
    # finishes one cannot hold a request slot.
    body_timeout_s: float = option(
        DEFAULT_BODY_TIMEOUT_S,
        "a request body must arrive whole within this many seconds (408 body_timeout); 0: no limit",
    )


@dataclass(frozen=True, slots=True)
class AccessSettings:
    """Secrets (never shown in a repr): the cluster secret members prove themselves with, the admin token;
    and where callers' identities come from (a token file, a JWT issuer)."""

    cluster_secret: str = option(
        "",
        "shared by every router and node (a Kubernetes Secret); with it, forwarding headers count only "
        "from members proving they hold it. Empty: anyone may send them (local use only). NEW,OLD during a "
        "rotation: members send with the first and accept any",
        repr=False,
    )
    admin_token: str = option(
        "",
        "token /admin/* requires (Authorization: Bearer TOKEN, or the cookie of a login at /admin/login); "
        "NEW,OLD during a rotation (either is accepted); empty: admin endpoints are open",
        repr=False,
    )
    metrics_require_token: bool = option(False, "/metrics also requires the admin token")
    # With access control on, /metrics needs an admin caller (its labels name every store and caller) unless
    # this reopens it for scrapers without credentials.
    metrics_open: bool = option(
        False,
        "with access control on, /metrics answers scrapers without credentials (otherwise it needs an "
        "admin caller or the admin token: its labels name every store and caller)",
    )
    # Who callers are (keyroute.auth.authn); none given: every caller may read every store.
    access_tokens: str = option(  # a TOML or JSON token file, re-read when it changes
        "",
        "TOML or JSON file of callers' tokens and certificates, each with its stores (re-read when it "
        "changes); with it (or --jwt-issuer) every read needs a caller allowed its store. Empty: open",
    )
    jwt_issuer: str = option("", "accept JWTs from this issuer (`iss`) as bearer tokens")
    jwt_audience: str = option("", "the `aud` JWTs must name (empty: not checked)")
    jwt_jwks_url: str = option("", "where the issuer's signing keys (JWKS) are fetched")
    jwt_jwks_file: str = option("", "the issuer's signing keys (JWKS), from a file")
    # The JWKS is fetched again this often, in the background: a key removed from it stops authenticating
    # within one period.
    jwt_jwks_refresh_s: float = option(
        JWKS_REFRESH_S,
        "fetch the JWKS again this often, in the background: a key removed from it stops authenticating "
        "within one period",
    )
    # An http:// --jwt-jwks-url is refused unless this is set (tests, local issuers).
    jwt_jwks_allow_http: bool = option(False, "accept an http:// --jwt-jwks-url (tests and local issuers only)")
    jwt_stores_claim: str = option("keyroute_stores", "the JWT claim listing its stores")
    jwt_groups_claim: str = option("", "the JWT claim listing its groups (instead of stores)")
    jwt_groups_file: str = option("", "TOML or JSON file: the stores each group may read")


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """A state node: identity, storage and how it reaches its peers."""

    node_id: str
    data_dir: Path
    zk: ZkSettings = field(default_factory=ZkSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    forward_timeout_s: float = option(5.0, "timeout for one request to another node")
    # The failure domain (availability zone, rack) this node runs in; "" = none. Replicas of a partition go
    # to different zones when the cluster has enough of them.
    zone: str = option(
        "",
        "failure domain this node runs in (availability zone, rack): a partition's replicas go to different "
        "zones when there are enough (in Kubernetes: the Node's topology.kubernetes.io/zone label, see --zone-file)",
    )
    max_batch_keys: int = option(1000, "keys in one batch-get (413 beyond)")
    lmdb_map_size_bytes: int = 1 << 34
    # On SIGTERM: how long to wait for other nodes to serve this node's partitions before leaving anyway.
    drain_timeout_s: float = option(
        60.0, "on SIGTERM, how long to wait for other nodes to serve this node's partitions"
    )
    # On SIGTERM (no drain request): how long the controller keeps this node's partitions assigned to it while it
    # restarts (0: hand them over as on a departure).
    restart_grace_s: float = option(
        120.0,
        "on SIGTERM, how long this node's partitions stay assigned to it while it restarts (0: hand them over; "
        "`keyroute node-drain` makes the next stop a departure)",
    )
    # How long a superseded version's files stay on disk (a rollback within it reuses them at once).
    version_grace_s: float = option(
        300.0, "how long a replaced version's files stay on disk (a rollback meanwhile reuses them)"
    )
    # How often the values of a store's ttl has expired are deleted from this node's live partitions
    # (keyroute.replica.expiry; 0: never). Batch partitions lose theirs at the next build.
    expiry_sweep_s: float = option(
        60.0, "how often expired values (a store's ttl) are deleted from this node's live partitions (0: never)"
    )
    # How long a read bounded by `min_offset` waits for a live partition to apply it before 503 not_up_to_bound.
    min_offset_wait_ms: float = option(
        500.0, "how long a read with min_offset waits for a live partition to apply it (then 503 not_up_to_bound)"
    )
    # Live stores: records asked of the Kafka client per consume call (each partition's share of them is
    # applied in one LMDB write transaction, its offset with it).
    live_batch_records: int = option(
        2000,
        "records a live store's consumer takes per call; each partition's share goes in one LMDB transaction",
    )
    # Live stores: how often each partition's commits are flushed to disk (0: after every commit).
    live_sync_ms: float = option(
        1000.0,
        "how often a live partition's commits are flushed to disk (0: after every commit); a process crash "
        "loses nothing either way",
    )
    limits: RequestLimits = field(default_factory=RequestLimits)
    access: AccessSettings = field(default_factory=AccessSettings)
    # Reads/s per identity and store for direct reads (keyroute.http.quotas), re-read when it changes; "": none.
    quota_file: str = option(
        "",
        "TOML file of read quotas per identity and store (reads/s, split among the nodes serving the store) "
        "for reads made straight to this node (direct mode), re-read when it changes; needs --cluster-secret or "
        "--member-ca; none: no quotas",
    )


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """A router: where it listens and how patiently it talks to nodes."""

    zk: ZkSettings = field(default_factory=ZkSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    upstream_timeout_s: float = option(5.0, "timeout for one request to a node")
    upstream_connect_timeout_s: float = option(1.0, "timeout for connecting to a node")
    max_batch_keys: int = option(1000, "keys in one batch-get (413 beyond)")
    unavailable_retry_after_s: int = 1
    # A single-key read not answered after this long is also sent to another serving replica.
    # None: automatic (p95 of recent upstream latencies, within 2 ms..1 s); 0: never.
    hedge_after_ms: float | None = option(
        None,
        "send a single-key read not answered within this many ms to a second replica too; "
        "auto: the p95 of recent node latencies (2 ms to 1 s); 0: never",
        spelled="auto",
    )
    # Hedges allowed, as a percentage of primary requests (plus a small burst).
    retry_budget_percent: float = option(
        10.0, "hedges allowed as a percentage of reads (plus a burst of 10); failovers after errors always go"
    )
    # A read none of whose requests has replied after this long goes to the next replica whatever the budget
    # (a frozen node answers nothing); 0: never.
    stall_after_ms: float = option(
        DEFAULT_STALL_AFTER_MS,
        "a read none of whose requests has replied within this many ms goes to the next replica, "
        "whatever the retry budget (a frozen node); 0: never",
    )
    # Processes sharing the listening port, each a whole router (map watcher, pools, metrics).
    workers: int = option(
        1, "router processes sharing the port, each with its own map watcher (about one per spare core)"
    )
    limits: RequestLimits = field(default_factory=RequestLimits)
    access: AccessSettings = field(default_factory=AccessSettings)
    # Reads/s per identity and store (keyroute.http.quotas), re-read when it changes; "": no quotas.
    quota_file: str = option(
        "",
        "TOML file of read quotas per identity and store (reads/s, split among the routers up), "
        "re-read when it changes; none: no quotas",
    )
    # The id its member certificate names (keyroute-router.<id>.<domain>); "": the host name (a pod's name).
    router_id: str = option(
        "",
        "this router's id, which its member certificate names (keyroute-router.ID.DOMAIN); default: the host "
        "name (on Kubernetes, the pod name)",
    )

    @property
    def member_id(self) -> str:
        """This router's id as a member: `router_id`, else the host name."""
        return self.router_id or socket.gethostname()
