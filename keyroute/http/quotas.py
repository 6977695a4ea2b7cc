"""How much callers may read: quotas per identity and per store, in reads per second, enforced with token
buckets by every process that admits callers' reads: routers, and nodes read directly (direct mode).

A quota file (TOML, `--quota-file`) names, per identity (`keyroute.auth.access.Identity.name`; `*` for
any identity not named), a default rate and per-store rates:

    [identities.anonymous]
    rate = 200                  # reads/s of each store not listed below (absent: unlimited)
    burst_s = 1.0               # the bucket holds this many seconds of rate (default 1)
    [identities.anonymous.stores]
    bookings = 50

    [identities."*"]
    rate = 20

Every rate is cluster-wide, and each process enforces its share of it: rate / the processes a caller's
reads of the store spread over (`Quotas.shared_by`). A router's divisor is the routers up (`set_routers`,
fed by the routers' registrations in ZooKeeper, keyroute.router.registry); a node's is the nodes serving
a partition of the store in its partition map (`ServingShares`), since a direct-mode client sends each read
to a node serving the key's partition. The routers' pool and the nodes' pool each hold the whole rate: a
read a member passes on (a router's, or another node's forward) was admitted where it came in and is not
counted again. A read costs: a key, history or windows read 1; a batch-get its number of keys; a range read
the page size it asks (`limit`). A read is admitted while its bucket holds at least min(cost, burst) tokens,
and then takes its whole cost (the bucket may go below zero: a big batch is let through when the bucket is
full, and the next reads wait for it to be paid for), so over time no caller reads more than its rate. A
read refused is `QuotaExceeded`: 429 quota_exceeded naming the identity and the store, with Retry-After (the
seconds until enough tokens are due, rounded up).

The buckets live in one dict keyed by (identity, store): a read costs one lookup and a few float
operations. Each bucket counts its reads and refusals under bounded labels (identities named in the
configuration, others as "other"; stores the partition map knows, others as `_unknown`), for the metrics
(`quota_families`) and the router's admin page's table (`table()`, served at /admin/quotas).

`QuotaFile` re-reads the file when it changes (inode, size or modification time, polled as TLS
certificates are); a file that does not parse keeps the previous quotas and says so in one line.
"""

from __future__ import annotations

import logging
import math
import tomllib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from time import monotonic
from typing import Any

from prometheus_client.core import Metric

from keyroute.api import ApiError
from keyroute.cluster.partition_map import PartitionMap
from keyroute.http.lifespan import StartupError
from keyroute.http.tls import POLL_S, FilePoller
from keyroute.runtime.metrics import UNKNOWN_STORE, labelled_counter
from keyroute.storage.ranges import DEFAULT_LIMIT as DEFAULT_PAGE
from keyroute.storage.ranges import MAX_LIMIT as MAX_PAGE

log = logging.getLogger(__name__)

ANY = "*"
OTHER = "other"  # the metrics' label of an identity the configuration does not name
DEFAULT_BURST_S = 1.0
# Buckets kept at most (one per identity and store read): beyond it they are all dropped and made afresh,
# so that reads of made-up store names cannot grow the dict without bound.
MAX_BUCKETS = 10_000


class QuotaError(ValueError):
    """A quota configuration that cannot be used: one line saying why."""


class QuotaExceeded(ApiError, status=429, code="quota_exceeded"):
    """A read past its caller's quota: when to ask again (Retry-After, whole seconds)."""

    def __init__(self, identity: str, store: str, rate: float, retry_after_s: int, process: str = "router") -> None:
        super().__init__(
            f"identity {identity!r} is over its quota of {rate:g} reads/s on store {store!r} on this {process}",
            {"Retry-After": str(retry_after_s)},
        )


@dataclass(frozen=True, slots=True)
class IdentityQuota:
    """One identity's quotas: `rate` for a store not in `stores` (None: unlimited), reads/s cluster-wide."""

    rate: float | None = None
    stores: Mapping[str, float] = field(default_factory=dict)
    burst_s: float = DEFAULT_BURST_S

    def rate_of(self, store: str) -> float | None:
        return self.stores.get(store, self.rate)


@dataclass(frozen=True, slots=True)
class QuotaConfig:
    """Quotas by identity name (`*`: any identity not named)."""

    identities: Mapping[str, IdentityQuota] = field(default_factory=dict)

    def of(self, identity: str) -> IdentityQuota | None:
        identities = self.identities
        return identities.get(identity) or identities.get(ANY)

    @classmethod
    def parse(cls, text: str, source: str = "the quota file") -> QuotaConfig:
        """The quotas `text` (TOML) names; QuotaError (one line) when it is not a valid quota file."""
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise QuotaError(f"{source} is not valid TOML: {exc}") from None
        return cls.of_table(doc, source)

    @classmethod
    def of_table(cls, doc: Mapping[str, Any], source: str = "the quotas") -> QuotaConfig:
        unknown = set(doc) - {"identities"}
        if unknown:
            raise QuotaError(f"{source}: unknown table(s) {', '.join(sorted(unknown))} (expected [identities.NAME])")
        identities = doc.get("identities", {})
        if not isinstance(identities, dict):
            raise QuotaError(f"{source}: 'identities' must be a table of identities")
        return cls({name: _identity(name, table, source) for name, table in identities.items()})


def _rate(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise QuotaError(f"{where} must be a positive number of reads/s, not {value!r}")
    return float(value)


def _identity(name: str, table: Any, source: str) -> IdentityQuota:
    where = f"{source}: identities.{name}"
    if not isinstance(table, dict):
        raise QuotaError(f"{where} must be a table")
    unknown = set(table) - {"rate", "stores", "burst_s"}
    if unknown:
        raise QuotaError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (expected rate, burst_s, stores)")
    stores = table.get("stores", {})
    if not isinstance(stores, dict):
        raise QuotaError(f"{where}.stores must be a table of store = rate")
    rate = _rate(table["rate"], f"{where}.rate") if "rate" in table else None
    burst_s = _rate(table["burst_s"], f"{where}.burst_s") if "burst_s" in table else DEFAULT_BURST_S
    return IdentityQuota(rate, {s: _rate(r, f"{where}.stores.{s}") for s, r in stores.items()}, burst_s)


class Bucket:
    """A token bucket of `rate` tokens/s holding at most `burst`, full when made; it counts what it
    admitted (`reads`) and refused (`rejected`) under its labels. `sharers`: the processes its quota was
    divided among when it was made."""

    __slots__ = ("rate", "burst", "tokens", "stamp", "quota", "labels", "reads", "rejected", "sharers")

    def __init__(
        self, rate: float, burst: float, now: float, quota: float, labels: tuple[str, str], sharers: int = 1
    ) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = now
        self.quota = quota  # the cluster-wide rate this bucket enforces its share of
        self.labels = labels
        self.sharers = sharers
        self.reads = 0
        self.rejected = 0

    def take(self, cost: int, now: float) -> float:
        """Take `cost` tokens if the bucket holds min(cost, burst) of them: 0.0; else the seconds until it
        will (nothing taken)."""
        tokens = self.tokens + (now - self.stamp) * self.rate
        burst = self.burst
        if tokens > burst:
            tokens = burst
        self.stamp = now
        need = cost if cost < burst else burst
        if tokens >= need:
            self.tokens = tokens - cost
            self.reads += cost
            return 0.0
        self.tokens = tokens
        self.rejected += 1
        return (need - tokens) / self.rate


class Quotas:
    """The quotas a router or node (`process`, as refusals name it) enforces (see the module doc).
    `admit(identity, store, cost)` raises QuotaExceeded past the quota; `active` is False while no quota is
    configured (the data plane then skips the call). `clock` is monotonic seconds; `known_store` says which
    store names are labels; `shared_by(store)` how many processes share a store's quotas (None: the routers
    up, `set_routers`, for every store)."""

    def __init__(
        self,
        config: QuotaConfig | None = None,
        *,
        clock: Callable[[], float] = monotonic,
        known_store: Callable[[str], bool] = lambda store: True,
        process: str = "router",
        shared_by: Callable[[str], int] | None = None,
    ) -> None:
        self.clock = clock
        self.known_store = known_store
        self.process = process
        self.shared_by = shared_by
        self.config = QuotaConfig()
        self.routers = 1
        self.active = False
        # (identity, store) -> its bucket, or None: unlimited
        self._buckets: dict[tuple[str, str], Bucket | None] = {}
        # Counts of buckets dropped (configuration changed), by labels: {identity: {store: [reads, rejected]}}
        self._retired: dict[str, dict[str, list[int]]] = {}
        if config is not None:
            self.configure(config)

    def configure(self, config: QuotaConfig) -> None:
        """Enforce `config` from now on (every bucket made afresh, full)."""
        self.config = config
        self.active = bool(config.identities)
        self._reset()

    def set_routers(self, routers: int) -> None:
        """`routers` routers are up: each enforces its share of every rate."""
        routers = max(1, routers)
        if routers != self.routers:
            self.routers = routers
            self._reset()

    def _reset(self) -> None:
        # A new dict of retired counts, never one changed in place: `counts` may read it from another thread.
        retired = _copy(self._retired)
        for bucket in self._buckets.values():
            if bucket is not None:
                _add(retired, bucket)
        self._retired = retired
        self._buckets = {}

    @property
    def buckets_held(self) -> int:
        """How many (identity, store) buckets are held now: never more than MAX_BUCKETS, whatever store names
        callers make up."""
        return len(self._buckets)

    def reshare(self, stores: Collection[str] | None = None) -> None:
        """The processes sharing the quotas of `stores` (None: of any store) may have changed: each bucket of
        theirs whose divisor (`shared_by`) did is dropped, and made afresh (full) at its new share by the next
        read. Costs a look at each bucket in use, so a caller calls it only when the divisors may change."""
        shared_by = self.shared_by
        if shared_by is None:
            return
        stale = [
            key
            for key, bucket in self._buckets.items()
            if bucket is not None
            and (stores is None or key[1] in stores)
            and max(1, shared_by(key[1])) != bucket.sharers
        ]
        if not stale:
            return
        retired = _copy(self._retired)  # a new dict: `counts` may read the old one from another thread
        buckets = dict(self._buckets)
        for key in stale:
            bucket = buckets.pop(key)
            assert bucket is not None
            _add(retired, bucket)
        self._retired = retired
        self._buckets = buckets

    def admit(self, identity: str, store: str, cost: int = 1) -> None:
        """Take `cost` reads of `store` for `identity`, or raise QuotaExceeded."""
        bucket = self._buckets.get((identity, store), _MISSING)
        if bucket is _MISSING:
            bucket = self._bucket(identity, store)
        if bucket is None:
            return
        wait = bucket.take(cost, self.clock())
        if wait:
            raise QuotaExceeded(identity, store, bucket.rate, max(1, math.ceil(wait)), self.process)

    def _bucket(self, identity: str, store: str) -> Bucket | None:
        if len(self._buckets) >= MAX_BUCKETS:
            self._reset()
        quota = self.config.of(identity)
        rate = quota.rate_of(store) if quota is not None else None
        bucket = None
        if rate is not None:
            assert quota is not None
            sharers = self.routers if self.shared_by is None else max(1, self.shared_by(store))
            share = rate / sharers
            labels = (
                identity if identity in self.config.identities else OTHER,
                store if self.known_store(store) else UNKNOWN_STORE,
            )
            bucket = Bucket(share, share * quota.burst_s, self.clock(), rate, labels, sharers)
        self._buckets[(identity, store)] = bucket
        return bucket

    def counts(self) -> dict[str, dict[str, list[int]]]:
        """{identity label: {store label: [reads admitted, reads refused]}} since start."""
        out = _copy(self._retired)
        for bucket in list(self._buckets.values()):
            if bucket is not None:
                _add(out, bucket)
        return out

    def table(self) -> dict[str, Any]:
        """What /admin/quotas answers: the routers sharing the quotas (a node: per bucket, the `nodes` serving
        its store), and per (identity, store) bucket in use the quota (cluster-wide), this process's share,
        the reads/s it admitted recently (the tokens used) and the counts since start."""
        now = self.clock()
        rows = []
        for (identity, store), bucket in sorted(self._buckets.items()):
            if bucket is None:
                continue
            tokens = min(bucket.burst, bucket.tokens + (now - bucket.stamp) * bucket.rate)
            row: dict[str, Any] = {
                "identity": identity,
                "store": store,
                "quota": bucket.quota,
                "share": bucket.rate,
                # Of the last burst's worth of tokens, how many are spent: the recent rate against the share.
                "used": round(max(0.0, bucket.burst - tokens) / bucket.burst, 3),
                "reads": bucket.reads,
                "rejected": bucket.rejected,
            }
            if self.shared_by is not None:
                row["nodes"] = bucket.sharers
            rows.append(row)
        identities = {
            name: {"rate": q.rate, "burst_s": q.burst_s, "stores": dict(q.stores)}
            for name, q in self.config.identities.items()
        }
        if self.shared_by is not None:
            return {"identities": identities, "buckets": rows}
        return {"routers": self.routers, "identities": identities, "buckets": rows}


_MISSING: Any = object()


def _copy(counts: dict[str, dict[str, list[int]]]) -> dict[str, dict[str, list[int]]]:
    return {identity: {store: list(n) for store, n in stores.items()} for identity, stores in counts.items()}


def _add(out: dict[str, dict[str, list[int]]], bucket: Bucket) -> None:
    identity, store = bucket.labels
    n = out.setdefault(identity, {}).setdefault(store, [0, 0])
    n[0] += bucket.reads
    n[1] += bucket.rejected


class QuotaFile(FilePoller):
    """The quota file at `path`, read into `quotas` at start (QuotaError: the router does not start) and
    again whenever it changes, polled every `poll_s` on the loop `watch` is given until `close()`. A
    changed file that is not valid keeps the previous quotas and is said in one line."""

    def __init__(self, path: str, quotas: Quotas, poll_s: float = POLL_S) -> None:
        super().__init__((path,), poll_s)
        self.path = path
        self.quotas = quotas
        quotas.configure(self._read())

    def _read(self) -> QuotaConfig:
        try:
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise QuotaError(f"cannot read the quota file {self.path}: {exc}") from None
        return QuotaConfig.parse(text, f"quota file {self.path}")

    def check(self) -> bool:
        """Read the file again if it changed since last seen; whether new quotas are in force."""
        in_force = False
        if self.changed():
            try:
                self.quotas.configure(self._read())
                in_force = True
            except QuotaError as exc:
                log.warning("keeping the previous quotas: %s", exc)
            else:
                log.info("quotas from %s in force: %d identities", self.path, len(self.quotas.config.identities))
        return in_force


def quota_file_error(path: str) -> str | None:
    """Why the quota file at `path` cannot be used (one line), or None."""
    try:
        QuotaFile(path, Quotas())
    except QuotaError as exc:
        return str(exc)
    return None


def page_cost(raw_query: bytes) -> int:
    """What a range, history or windows read costs: the page size it asks (`limit`, at most MAX_PAGE),
    else the default page. A malformed limit costs the default (the read itself is then refused)."""
    if b"limit=" in raw_query:
        for part in raw_query.split(b"&"):
            if part.startswith(b"limit=") and part[6:].isdigit():
                return max(1, min(int(part[6:]), MAX_PAGE))
    return DEFAULT_PAGE


def start_quotas(
    path: str, known_store: Callable[[str], bool], process: str = "router"
) -> tuple[Quotas, QuotaFile | None]:
    """A router's or node's (`process`) quotas: those of the quota file at `path` (and what watches it), or
    none ("" path). Raises StartupError (one line) when the file cannot be used."""
    quotas = Quotas(known_store=known_store, process=process)
    if not path:
        return quotas, None
    try:
        return quotas, QuotaFile(path, quotas)
    except QuotaError as exc:
        raise StartupError(str(exc)) from None


class ServingShares:
    """A node's divisor of each store's quotas (`Quotas.shared_by`): the nodes serving a partition of the
    store in the node's partition map (at least 1), since a direct-mode client sends each read to a node
    serving the key's partition. `follow(map)`, called with the node's map before a read is admitted, costs
    one comparison while the map is the same; a new one drops the counts of the stores it may route
    differently (all of them when it does not derive from the last one seen) and reshares their buckets, so
    a change costs in proportion to the stores it touches that are read under a quota."""

    def __init__(self, quotas: Quotas) -> None:
        self.quotas = quotas
        self._map: PartitionMap | None = None
        self._counts: dict[str, int] = {}
        quotas.shared_by = self.count

    def follow(self, m: PartitionMap) -> None:
        last = self._map
        if m is last:
            return
        self._map = m
        delta = m.delta
        if last is None or delta is None or delta.parent != last.seq:
            self._counts = {}
            self.quotas.reshare()
        elif delta.stores:
            for store in delta.stores:
                self._counts.pop(store, None)
            self.quotas.reshare(delta.stores.keys())

    def count(self, store: str) -> int:
        """The nodes serving a partition of `store` in the map followed (0 before one is, or for none)."""
        n = self._counts.get(store)
        if n is None:
            m = self._map
            routes = m.routes.get(store, ()) if m is not None else ()
            n = self._counts[store] = len({endpoint.node_id for endpoints in routes for endpoint in endpoints})
        return n


def quota_families(prefix: str, counts: Mapping[str, Mapping[str, Sequence[int]]]) -> Iterable[Metric]:
    """Reads admitted and refused by quotas (`Quotas.counts`, summed over a service's processes), by identity
    ("other": one the quota file does not name) and store, as `{prefix}_quota_reads` and `_quota_rejections`."""
    rows = sorted((identity, store, n) for identity, stores in counts.items() for store, n in stores.items())
    yield labelled_counter(
        f"{prefix}_quota_reads",
        "reads admitted under a quota (a batch-get counts its keys, a range or timeline read its page size), by "
        "identity and store",
        ["identity", "store"],
        (([identity, store], n[0]) for identity, store, n in rows),
    )
    yield labelled_counter(
        f"{prefix}_quota_rejections",
        "requests refused 429 quota_exceeded, by identity and store",
        ["identity", "store"],
        (([identity, store], n[1]) for identity, store, n in rows),
    )
