"""The cluster's security policy: /policy in ZooKeeper, what every router and node must have configured to serve.

    require_access_control   callers identified and checked (--access-tokens, which also maps client
                             certificates to callers, or --jwt-issuer)
    member_auth              how members prove themselves to each other: "none", "secret" (the cluster
                             secret; mutual TLS also satisfies it) or "mtls" (certificates from --member-ca)
    require_tls              the wires that must be encrypted: "client" (HTTPS to callers), "member" (TLS
                             between members, --member-ca), "zookeeper" (--zk-tls-ca)

`keyroute cluster policy set` writes the record with the writers' ACL (keyroute.cluster.zk); a chroot without one
asks nothing, as before the policy existed. Every router and node reads it when it connects, before it
writes anything to ZooKeeper, and refuses to start when its own settings fall short (`PolicyWatch.require`:
one line naming what is missing); while it runs it watches the record, and withholds reads while a tightened
policy is not met. A record this version cannot read, or that names a requirement it does not know (written
by a newer keyroute), is never met: closed rather than open.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import KazooException, NoAuthError, NodeExistsError, NoNodeError
from kazoo.handlers.threading import KazooTimeoutError

from keyroute.cluster import zk_layout
from keyroute.cluster.zk import ZkUnavailableError, data_of
from keyroute.runtime.settings import NodeSettings, RouterSettings

log = logging.getLogger(__name__)

# Weakest first: a member satisfies a requirement with it or anything after it (mutual TLS proves more
# than the shared secret does).
MEMBER_AUTH = ("none", "secret", "mtls")
WIRES = ("client", "member", "zookeeper")
_FIELDS = frozenset({"require_access_control", "member_auth", "require_tls", "updated_at"})


class PolicyError(ValueError):
    """A policy that cannot be written or read: bad options, or a record that is not a policy."""


class UnmetPolicyError(RuntimeError):
    """This process's settings do not satisfy the cluster policy (the message is the one line saying why)."""


@dataclass(frozen=True, slots=True)
class ClusterPolicy:
    """What the cluster asks of its members; the default asks nothing."""

    require_access_control: bool = False
    member_auth: str = "none"
    require_tls: frozenset[str] = frozenset()
    updated_at: float | None = None
    # Requirements a newer keyroute wrote that this one does not know, described: never met.
    unknown: tuple[str, ...] = ()

    @classmethod
    def of_options(
        cls, require_access_control: bool, member_auth: str, require_tls: str, now: float | None = None
    ) -> ClusterPolicy:
        """The policy `keyroute cluster policy set` writes; PolicyError (one line) for a value it does not take."""
        auth = member_auth.strip().lower() or "none"  # an empty variable in a manifest: none
        if auth not in MEMBER_AUTH:
            raise PolicyError(f"--member-auth takes {', '.join(MEMBER_AUTH)}, not {member_auth!r}")
        wires = [wire.strip().lower() for wire in require_tls.split(",") if wire.strip()]
        bad = [wire for wire in wires if wire not in WIRES]
        if bad:
            raise PolicyError(f"--require-tls takes a comma-separated list of {', '.join(WIRES)}, not {bad[0]!r}")
        return cls(require_access_control, auth, frozenset(wires), time.time() if now is None else now)

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "require_access_control": self.require_access_control,
                "member_auth": self.member_auth,
                "require_tls": sorted(self.require_tls),
                "updated_at": self.updated_at,
            },
            sort_keys=True,
        ).encode("utf-8")

    @classmethod
    def from_json(cls, raw: bytes) -> ClusterPolicy:
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise PolicyError(f"{zk_layout.POLICY} is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise PolicyError(f"{zk_layout.POLICY} is not a JSON object")
        access = doc.get("require_access_control", False)
        auth = doc.get("member_auth", "none")
        wires = doc.get("require_tls", [])
        updated = doc.get("updated_at")
        if not isinstance(access, bool) or not isinstance(auth, str) or not isinstance(wires, list):
            raise PolicyError(
                f"{zk_layout.POLICY} is not a cluster policy (require_access_control: a boolean, member_auth: "
                "a string, require_tls: a list)"
            )
        if not all(isinstance(wire, str) for wire in wires) or not isinstance(updated, (int, float, type(None))):
            raise PolicyError(
                f"{zk_layout.POLICY} is not a cluster policy (require_tls: strings, updated_at: a number)"
            )
        unknown = [f"the requirement {name!r}" for name in sorted(set(doc) - _FIELDS)]
        if auth not in MEMBER_AUTH:
            unknown.append(f"member authentication {auth!r}")
        unknown += [f"TLS on the {wire!r} wire" for wire in sorted(set(wires) - set(WIRES))]
        return cls(
            access,
            auth if auth in MEMBER_AUTH else "none",
            frozenset(wire for wire in wires if wire in WIRES),
            None if updated is None else float(updated),
            tuple(unknown),
        )

    def describe(self) -> dict[str, Any]:
        """The policy as `keyroute cluster policy show` prints it and the admin partition map shows it."""
        described: dict[str, Any] = {
            "require_access_control": self.require_access_control,
            "member_auth": self.member_auth,
            "require_tls": sorted(self.require_tls),
            "updated_at": self.updated_at,
        }
        if self.unknown:
            described["unknown"] = list(self.unknown)
        return described


@dataclass(frozen=True, slots=True)
class MemberSecurity:
    """What one router or node has configured, as far as the policy asks."""

    access_control: bool = False
    cluster_secret: bool = False
    member_tls: bool = False  # --member-ca: TLS between members, each told by its certificate
    client_tls: bool = False  # --tls-cert: HTTPS to callers
    zookeeper_tls: bool = False

    @classmethod
    def of(cls, settings: NodeSettings | RouterSettings) -> MemberSecurity:
        access, tls = settings.access, settings.http.tls
        return cls(
            access_control=bool(access.access_tokens or access.jwt_issuer),
            cluster_secret=bool(access.cluster_secret.strip()),
            member_tls=bool(tls.member_ca),
            client_tls=tls.enabled,
            zookeeper_tls=settings.zk.tls is not None,
        )


class Requirement(NamedTuple):
    """One thing a member lacks: what the policy asks, and how the member's operator provides it."""

    what: str
    how: str

    def __str__(self) -> str:
        return f"{self.what}: {self.how}"


_MTLS_HOW = "set --member-ca (with --tls-cert and --tls-key)"


def unmet(policy: ClusterPolicy, member: MemberSecurity) -> list[Requirement]:
    """What `member` lacks to satisfy `policy`, in the policy's order; empty when it satisfies it."""
    missing: list[Requirement] = []
    if policy.require_access_control and not member.access_control:
        missing.append(Requirement("caller access control", "set --access-tokens or --jwt-issuer"))
    if policy.member_auth == "secret" and not (member.cluster_secret or member.member_tls):
        missing.append(Requirement("authentication between members", "set --cluster-secret (or --member-ca)"))
    if policy.member_auth == "mtls" and not member.member_tls:
        missing.append(Requirement("mutual TLS between members", _MTLS_HOW))
    if "client" in policy.require_tls and not member.client_tls:
        missing.append(Requirement("TLS to clients", "set --tls-cert and --tls-key"))
    # Mutual TLS between members is TLS between members: said once.
    if "member" in policy.require_tls and not member.member_tls and policy.member_auth != "mtls":
        missing.append(Requirement("TLS between members", _MTLS_HOW))
    if "zookeeper" in policy.require_tls and not member.zookeeper_tls:
        missing.append(Requirement("TLS to ZooKeeper", "set --zk-tls-ca"))
    missing += [Requirement(what, "this keyroute version does not know it: upgrade") for what in policy.unknown]
    return missing


@dataclass(frozen=True, slots=True)
class PolicyCheck:
    """A member's settings against the policy as last read: `recorded` False when the chroot has none (nothing
    asked), `unmet` what the member lacks (a record that could not be read: that)."""

    policy: ClusterPolicy = field(default_factory=ClusterPolicy)
    recorded: bool = False
    unmet: tuple[Requirement, ...] = ()

    @classmethod
    def of(cls, raw: bytes | None, member: MemberSecurity) -> PolicyCheck:
        """The check of `member` against a policy record's bytes (None: no record)."""
        if raw is None:
            return cls()
        try:
            policy = ClusterPolicy.from_json(raw)
        except PolicyError as exc:
            return cls(recorded=True, unmet=(Requirement("a readable cluster policy", f"{exc}: set it again"),))
        return cls(policy, True, tuple(unmet(policy, member)))

    @property
    def satisfied(self) -> bool:
        return not self.unmet

    @property
    def message(self) -> str:
        """One line: what the policy requires that this member lacks ("" when satisfied)."""
        if not self.unmet:
            return ""
        return "the cluster policy requires " + "; ".join(str(requirement) for requirement in self.unmet)

    def describe(self) -> dict[str, Any]:
        """The policy, whether it is recorded, and whether this member satisfies it (what it lacks)."""
        return {
            **self.policy.describe(),
            "recorded": self.recorded,
            "satisfied": self.satisfied,
            "unmet": [str(requirement) for requirement in self.unmet],
        }


def read_policy(client: KazooClient) -> ClusterPolicy | None:
    """The chroot's policy, None when it has none. PolicyError for a record that is not one."""
    raw = data_of(client, zk_layout.POLICY)
    return None if raw is None else ClusterPolicy.from_json(raw)


def write_policy(client: KazooClient, policy: ClusterPolicy) -> None:
    """Record `policy`, replacing the one there (with the client's default ACL: the writers')."""
    try:
        client.create(zk_layout.POLICY, policy.to_json())
    except NodeExistsError:
        client.set(zk_layout.POLICY, policy.to_json())


class PolicyWatch:
    """A member's check against the policy, kept current: read when its session starts (`start`, or `require`
    for `keyroute.cluster.zk.connect`'s `check`), re-read on every change of /policy and on every new session.
    Each new check goes to `on_change` on ZooKeeper's thread; while ZooKeeper is away the last one holds.
    A record this identity may not read is an unmet check too."""

    def __init__(self, member: MemberSecurity, on_change: Callable[[PolicyCheck], None] | None = None) -> None:
        self.member = member
        self.on_change = on_change
        # `require` refuses an unmet first check (a start); False: it is watched like any later one.
        self.strict = True
        self.check = PolicyCheck()
        self.version = 0  # counts the changes of `check`
        self._told: PolicyCheck | None = None  # the last check `on_change` was given, this session
        self._client: KazooClient | None = None
        self._lock = threading.Lock()

    def start(self, client: KazooClient, *, quiet: bool = False) -> PolicyCheck:
        """Read the policy now and watch it on `client`; the first check (`quiet`: not given to `on_change`).
        ZkUnavailableError when it cannot be read: a member never starts unchecked."""
        self._client = client
        client.add_listener(self._on_state)
        first = self._read(quiet)
        if first is None:
            self.stop()
            raise ZkUnavailableError(f"reading the cluster policy ({zk_layout.POLICY}) from ZooKeeper failed")
        return first

    def require(self, client: KazooClient) -> None:
        """`start`, then (while `strict`) UnmetPolicyError when this member does not satisfy the policy: a
        start refused is said by the error alone, never to `on_change`."""
        first = self.start(client, quiet=self.strict)
        if self.strict and not first.satisfied:
            self.stop()
            raise UnmetPolicyError(first.message)

    def stop(self) -> None:
        self._told = None  # a later `start` tells its first check, whatever it is
        client, self._client = self._client, None
        if client is not None:
            client.remove_listener(self._on_state)

    def _on_state(self, state: str) -> None:
        # A session (re)established: the watch may have been lost with the old one, the record changed meanwhile.
        client = self._client
        if state == KazooState.CONNECTED and client is not None:
            client.handler.spawn(self._read)

    def _watched(self, event: Any) -> None:
        client = self._client
        if client is not None:
            client.handler.spawn(self._read)

    def _read(self, quiet: bool = False) -> PolicyCheck | None:
        """Read and watch the record; the new check (also given to `on_change` unless `quiet`), or None when
        ZooKeeper could not be asked (the last check holds; the next session reads again)."""
        # One read at a time (a watch and a new session may both ask): a slower, older read never lands last.
        with self._lock:
            client = self._client
            if client is None:
                return None
            try:
                check = self._fetch(client)
            except (KazooException, KazooTimeoutError) as exc:
                log.debug("reading the cluster policy failed (%s): the last one read holds", exc)
                return None
            if check != self.check:
                self.check = check
                self.version += 1
            if self.on_change is not None and check != self._told and not quiet:
                self._told = check
                self.on_change(check)
            return check

    def _fetch(self, client: KazooClient) -> PolicyCheck:
        while True:
            try:
                raw = client.get(zk_layout.POLICY, watch=self._watched)[0]
            except NoNodeError:
                if client.exists(zk_layout.POLICY, watch=self._watched) is not None:
                    continue  # created in between: read it
                return PolicyCheck()
            except NoAuthError:
                how = "give this process's ZooKeeper identity READ on it (a node's connect adds the reader's)"
                return PolicyCheck(recorded=True, unmet=(Requirement("a cluster policy it may read", how),))
            return PolicyCheck.of(raw, self.member)
