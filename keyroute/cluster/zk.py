"""Connecting to ZooKeeper: one kazoo client per process, the chroot and layout created when missing, ACLs.

Access control uses ZooKeeper's digest scheme or, over TLS, its x509 scheme. Every process authenticates
as one identity: `ZkSettings.auth` (digest, `USER:PASSWORD`) or, without it, the subject DN of its TLS
client certificate (`ZkSettings.tls`, keyroute.cluster.zk_tls). Processes that write (nodes, the pipeline,
rollback) create every znode (the chroot, the layout roots and every record below them, ephemeral or not)
with one ACL, set once here as the client's default: their own identity ALL, the reader identity
(`ZkSettings.reader`, or an x509 reader's DN `ZkSettings.reader_dn`) READ, nobody else anything. Routers
only read: they authenticate as the reader and create nothing
(`ensure_layout=False`). Writers are given the reader as `USER:PASSWORD`, not as a pre-hashed digest: one
Secret then serves both sides, the digest is computed here, and a writer learns nothing it could misuse
(it already holds ALL). Without credentials every znode gets ZooKeeper's world-open ACL, as before: anyone
who can reach ZooKeeper can rewrite the routing.

A writer also checks the ACL of the persistent layout (chroot, roots, assignment, store records) when it
connects: world access is removed and its own identity (ALL) and reader (READ) are added, so a layout
created before credentials were configured is locked on first use and a new reader identity takes
effect. Other identities' entries are kept: a writer configured without the reader never locks the
routers out. Ephemeral records get the ACL when their owner creates them again.

    ZkUnavailableError     ZooKeeper cannot be used by this process
     +-- ZkAccessError     reachable, but this identity may not read or administer keyroute's layout
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import NoAuthError, NodeExistsError, NoNodeError
from kazoo.retry import KazooRetry
from kazoo.security import ACL, OPEN_ACL_UNSAFE, Id, Permissions, make_digest_acl

from keyroute.cluster import zk_layout, zk_tls
from keyroute.runtime.logs import describe
from keyroute.runtime.settings import ZkSettings

log = logging.getLogger(__name__)


class ZkUnavailableError(RuntimeError):
    """ZooKeeper could not be used: not reached within the connect timeout, or (ZkAccessError) refused."""


class ZkAccessError(ZkUnavailableError):
    """ZooKeeper answered, but this process's identity may not read or administer keyroute's layout."""


def _retry() -> KazooRetry:
    return KazooRetry(max_tries=-1, delay=0.1, backoff=2, max_delay=2.0, ignore_expire=False)


def _layout_retry() -> KazooRetry:
    """For the layout written at start: a connection that drops (a missed heartbeat on a loaded host) and comes
    back within the session is retried, a few times, instead of ending the process's start; an expired session
    or a refusal is not retried."""
    return KazooRetry(max_tries=8, delay=0.1, backoff=2, max_delay=2.0, ignore_expire=False)


def layout_acl(settings: ZkSettings) -> list[ACL]:
    """The ACL of every znode a process with `settings` creates: writer ALL, reader READ (world-open
    without credentials)."""
    if settings.auth is not None:
        acl = [make_digest_acl(settings.auth.user, settings.auth.password, all=True)]
    elif (dn := x509_identity(settings)) is not None:
        acl = [ACL(Permissions.ALL, Id("x509", dn))]
    else:
        return list(OPEN_ACL_UNSAFE)
    reader = settings.reader
    if reader is not None and reader != settings.auth:
        acl.append(make_digest_acl(reader.user, reader.password, read=True))
    if settings.reader_dn and all(entry.id != Id("x509", settings.reader_dn) for entry in acl):
        acl.append(ACL(Permissions.READ, Id("x509", settings.reader_dn)))
    return acl


def routers_acl(settings: ZkSettings) -> list[ACL]:
    """The ACL of /routers: the layout's, the reader identity also creating and deleting children there
    (routers register themselves: keyroute.router.registry)."""
    return [ACL(_REGISTERING, e.id) if e.perms == Permissions.READ else e for e in layout_acl(settings)]


def x509_identity(settings: ZkSettings) -> str | None:
    """The subject DN this process is known by on a TLS ZooKeeper when no digest identity is configured
    (None: it has none, or authenticates by digest)."""
    if settings.auth is not None or settings.tls is None or settings.tls.cert is None:
        return None
    return _subject_dn(settings.tls.cert)


@functools.lru_cache(maxsize=8)
def _subject_dn(cert: Path) -> str:
    try:
        return zk_tls.subject_dn(cert)
    except zk_tls.ZkTlsError as exc:
        raise ZkUnavailableError(str(exc)) from None


def _client(settings: ZkSettings, hosts: str, **kwargs: object) -> KazooClient:
    try:
        kwargs |= zk_tls.kazoo_options(settings.tls)
    except zk_tls.ZkTlsError as exc:
        raise ZkUnavailableError(str(exc)) from None
    if settings.has_identity:
        kwargs["default_acl"] = layout_acl(settings)
    if settings.auth is not None:
        kwargs["auth_data"] = [("digest", settings.auth.credential)]
    return KazooClient(hosts=hosts, timeout=settings.session_timeout_s, **kwargs)


def raw_client(settings: ZkSettings) -> KazooClient:
    """A client of `settings`' identity and TLS on the ensemble's root (no chroot), not started, with kazoo's
    default retries: for one-off looks at the ensemble itself (keyroute.cluster.zk_session's probe)."""
    return _client(settings, settings.hosts)


def lock_root(settings: ZkSettings) -> list[str]:
    """Let only this process's identity create (or delete, or change the ACL) at the ensemble's root, everyone
    else read it: a client of another identity, or of none, can then create no top-level znode (another
    chroot, litter), while keyroute's writers still create chroots. Returns the root's ACL as ZooKeeper now
    holds it. ZkAccessError without an identity (the root would be locked against everyone) or when the root
    is already locked against this one."""
    acl = layout_acl(settings)
    if not settings.has_identity:
        raise ZkAccessError(
            "locking ZooKeeper's root needs the writer identity (--zk-auth, or --zk-tls-cert's subject): "
            "without one it would lock everyone out"
        )
    writer = [entry for entry in acl if entry.perms == Permissions.ALL]
    wanted = [*writer, ACL(Permissions.READ, Id("world", "anyone"))]
    client = _client(settings, settings.hosts)
    _start(client, settings)
    try:
        try:
            client.set_acls("/", wanted)
        except NoAuthError as exc:
            raise ZkAccessError(
                f"{_who(settings)} may not change the ACL of ZooKeeper's root at {settings.hosts}"
            ) from exc
        now, _ = client.get_acls("/")
        return sorted(_describe(entry) for entry in now)
    finally:
        close(client)


def connect(
    settings: ZkSettings, *, ensure_layout: bool = True, check: Callable[[KazooClient], None] | None = None
) -> KazooClient:
    """Start a kazoo client on `settings`. With `ensure_layout` (processes that write), also create the
    chroot and keyroute's top-level paths and bring their ACL in line; without it (routers) nothing is
    created and READ suffices, even before the chroot exists. `check` (a member's cluster policy check) is
    called with the session before anything is created or changed: what it raises ends the connect, the
    session closed."""
    client = _client(settings, settings.connect_string, connection_retry=_retry())
    _start(client, settings)
    if check is not None:
        try:
            check(client)
        except BaseException:
            close(client)
            raise
    if not ensure_layout:
        return client
    try:
        if settings.chroot:
            _ensure_chroot(settings)
        for path in zk_layout.PERSISTENT_ROOTS:
            with contextlib.suppress(NodeExistsError):
                _layout_retry()(client.ensure_path, path)
        _check_layout_acl(client, settings)
    except NoAuthError as exc:
        close(client)
        raise ZkAccessError(
            f"{_who(settings)} may not write keyroute's layout at {settings.connect_string} "
            f"(it is protected by another identity's ACL)"
        ) from exc
    except ZkUnavailableError:
        close(client)
        raise
    return client


def _ensure_chroot(settings: ZkSettings) -> None:
    """Create the chroot (and its parents) unless it exists, from a client without the chroot."""
    root = _client(settings, settings.hosts)
    _start(root, settings)
    try:
        _layout_retry()(root.ensure_path, settings.chroot)
    except NoAuthError as exc:
        raise ZkAccessError(
            f"{_who(settings)} may not create the chroot {settings.chroot} on ZooKeeper {settings.hosts}"
        ) from exc
    finally:
        close(root)


def _who(settings: ZkSettings) -> str:
    if settings.auth is not None:
        return f"ZooKeeper identity {settings.auth.user!r}"
    if (dn := x509_identity(settings)) is not None:
        return f"ZooKeeper x509 identity {dn!r}"
    return "an unauthenticated client (no ZooKeeper identity configured)"


def _acl_key(acl: list[ACL]) -> set[tuple[int, str, str]]:
    return {(entry.perms, entry.id.scheme, entry.id.id) for entry in acl}


def _layout_paths(client: KazooClient, settings: ZkSettings) -> list[str]:
    paths = ["/"] if settings.chroot else []  # "/" of a chrooted client is the chroot itself
    paths += zk_layout.PERSISTENT_ROOTS
    if client.exists(zk_layout.ASSIGNMENT) is not None:
        paths.append(zk_layout.ASSIGNMENT)
    if client.exists(zk_layout.POLICY) is not None:
        paths.append(zk_layout.POLICY)  # readable by the routers, writable by the writers alone
    paths += [zk_layout.store_path(name) for name in sorted(client.get_children(zk_layout.STORES))]
    if client.exists(zk_layout.PLACEMENT) is not None:
        paths += [zk_layout.placement_path(name) for name in sorted(client.get_children(zk_layout.PLACEMENT))]
    return paths


def _check_layout_acl(client: KazooClient, settings: ZkSettings) -> None:
    if not settings.has_identity:
        # No identity: the layout must still be world-writable, or every write would fail later on.
        for path in zk_layout.PERSISTENT_ROOTS:
            acl, _ = client.get_acls(path)
            if not any(e.id.scheme == "world" and e.perms == Permissions.ALL for e in acl):
                raise ZkAccessError(
                    f"keyroute's layout at {settings.connect_string} is protected by an ACL: configure this "
                    f"process's ZooKeeper identity (keyroute --zk-auth USER:PASSWORD, KEYROUTE_ZK_AUTH; or a TLS "
                    f"client certificate, --zk-tls-cert)"
                )
        return
    layout, routers = layout_acl(settings), routers_acl(settings)
    for path in _layout_paths(client, settings):
        try:
            current, _ = client.get_acls(path)
            merged = merged_acl(current, routers if path == zk_layout.ROUTERS else layout)
            if _acl_key(merged) == _acl_key(current):
                continue
            client.set_acls(path, merged)
        except NoNodeError:  # a store deleted meanwhile
            continue
        where = (settings.chroot + path).rstrip("/") or "/"
        log.warning("ZooKeeper ACL of %s changed to: %s", where, ", ".join(_describe(e) for e in merged))


def merged_acl(current: list[ACL], wanted: list[ACL]) -> list[ACL]:
    """`wanted`, plus the entries of `current` for other identities; world access goes."""
    ours = {entry.id for entry in wanted}
    kept = [entry for entry in current if entry.id.scheme != "world" and entry.id not in ours]
    return [*wanted, *kept]


_REGISTERING = Permissions.READ | Permissions.CREATE | Permissions.DELETE


def _describe(entry: ACL) -> str:
    user = str(entry.id.id)
    if entry.id.scheme == "digest":
        user = user.split(":", 1)[0]  # a digest's hash is not for logs
    perms = {Permissions.ALL: "ALL", Permissions.READ: "READ", _REGISTERING: "READ,CREATE,DELETE"}.get(
        entry.perms, str(entry.perms)
    )
    return f"{entry.id.scheme}:{user} {perms}"


_SSL_SOURCE = re.compile(r" \(_ssl\.c:\d+\)$")


class _Quiet(logging.Filter):
    """While a session is first being established, kazoo's warning per refused connection (several a second)
    says nothing the final error will not: it is held back, its reason kept for that error."""

    def __init__(self) -> None:
        super().__init__()
        self.reason = ""
        self.tls_refused = False
        # Host names that did not resolve, with the resolver's reason (kazoo skips them and tries again).
        self.unresolved: dict[str, str] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.WARNING:
            return True
        message = record.getMessage()
        if message.startswith("Cannot resolve ") and isinstance(record.args, tuple) and len(record.args) == 2:
            host, error = record.args
            self.unresolved[str(host)] = str(getattr(error, "strerror", None) or error)
        elif message.startswith("Connection dropped: "):
            reason = message.removeprefix("Connection dropped: ").removeprefix("socket connection error: ")
            self.reason = _SSL_SOURCE.sub("", reason)  # OpenSSL's " (_ssl.c:1006)" says nothing to a user
            # A refused certificate (ours or the server's): trying again will not change it.
            self.tls_refused = self.reason.startswith("[SSL") or "certificate" in self.reason
        return False


def _start(client: KazooClient, settings: ZkSettings) -> None:
    quiet = _Quiet()
    kazoo_log = logging.getLogger("kazoo.client")
    kazoo_log.addFilter(quiet)
    try:
        _start_quietly(client, settings, quiet)
    finally:
        kazoo_log.removeFilter(quiet)


def _start_quietly(client: KazooClient, settings: ZkSettings, quiet: _Quiet) -> None:
    try:
        _started(client, settings, quiet)
    except NoAuthError as exc:  # kazoo checks that the chroot exists, which needs READ on it
        close(client)
        raise ZkAccessError(f"{_who(settings)} may not read {settings.connect_string}") from exc
    except Exception as exc:  # kazoo raises its own timeout type; the caller needs one meaning
        client.close()
        why = f" ({quiet.reason[:1].lower()}{quiet.reason[1:]})" if quiet.reason else ""
        if quiet.tls_refused:
            raise ZkUnavailableError(f"TLS with ZooKeeper at {settings.hosts} failed{why}") from exc
        if quiet.unresolved and not quiet.reason:
            # No host could even be looked up: a typo or a name the DNS does not know (yet), not a network fault.
            names = " and ".join(sorted(quiet.unresolved))
            reason = next(iter(quiet.unresolved.values()))
            raise ZkUnavailableError(
                f"ZooKeeper host {names} does not resolve ({reason}); tried for {settings.connect_timeout_s:g} s: "
                "check the host names in --zk"
            ) from exc
        raise ZkUnavailableError(
            f"cannot reach ZooKeeper at {settings.hosts} within {settings.connect_timeout_s:g} s{why}"
        ) from exc


def _started(client: KazooClient, settings: ZkSettings, quiet: _Quiet) -> None:
    """kazoo's `start`, except that a refused TLS handshake ends the wait at once. A missing chroot is no
    warning here: a reader waits for it (watches), a writer has just created it."""
    connected = client.start_async()
    deadline = time.monotonic() + settings.connect_timeout_s
    while not connected.wait(0.05) and not quiet.tls_refused and time.monotonic() < deadline:
        pass
    if not client.connected:
        client.stop()
        raise TimeoutError("no ZooKeeper session")
    if client.chroot:
        client.exists("/")  # as kazoo's `start` does: NoAuthError without READ on the chroot


def data_of(client: KazooClient, path: str) -> bytes | None:
    """The data of znode `path`, None when there is no such znode (a record not written yet)."""
    try:
        data, _ = client.get(path)
    except NoNodeError:
        return None
    return bytes(data)


def is_connected(client: KazooClient) -> bool:
    """Whether the client's session is connected now (not suspended, lost or closed)."""
    return bool(client.state == KazooState.CONNECTED)


def close(client: KazooClient) -> None:
    """End the client's session and free it; once more does nothing. Bounded whatever ZooKeeper's state: with
    ZooKeeper unreachable, kazoo stops retrying and fails every call still waiting for it (ConnectionLoss),
    waiting at most max(10 s, the session timeout) for its connection thread to notice; a call after this fails
    at once (ConnectionClosedError)."""
    try:
        client.stop()
    except Exception as exc:  # kazoo's WriterNotClosedException: its connection thread did not end in time
        log.warning("closing the ZooKeeper client did not finish cleanly: %s", describe(exc))
    finally:
        with contextlib.suppress(Exception):  # closed before
            client.close()
