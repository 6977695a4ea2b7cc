"""Who is asking: a request's credentials (a bearer token, a JWT, a client certificate's name) turned into the
`keyroute.auth.access.Identity` it reads under.

    TokenFile       static tokens from a TOML or JSON file, looked at again when it changes: each entry a
                    `name`, its `stores` (a list, or "*") and `admin`; a `token` (as given, or `sha256`, its
                    hex digest) or a `certificate` (a client certificate's SAN or subject CN)
    SigningKeys     an issuer's signing keys (a JWKS), read at start and then only in the background: every
                    `refresh_s`, and (rate-limited, one fetch at a time) when a token names a key id not in
                    the set; each fetch within a total deadline, a failed one keeping the last good set
    JwtVerifier     JSON Web Tokens signed by those keys, with an explicit list of asymmetric algorithms (never
                    `none`, never HS*); `iss`, `aud`, `exp`, `nbf` checked with a small leeway; the stores
                    from a claim, or from groups and a mapping; the caller named `jwt:SUBJECT`
    Authenticator   both, behind one `identify(authorization, now)`, each raw Authorization header's identity
                    cached until it expires, the token file changes or a refresh removes the key it was
                    verified with

A JWT's subject and a token's name never name the same caller: every JWT identity is `jwt:` followed by its
subject, and a token file may not name a token so. Quotas, fair shares and metrics, which go by identity
names, keep the two apart.

Nothing here speaks HTTP, and nothing here makes a read wait for a fetch: keyroute.http.authn takes the
headers and the TLS peer of a call, and fetches a JWKS from its URL (on SigningKeys' thread).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
import tomllib
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from keyroute.api import Unauthorized
from keyroute.auth.access import Identity
from keyroute.runtime.settings import JWKS_REFRESH_S

log = logging.getLogger(__name__)

# Signatures a JWT may carry: asymmetric only, so that a public key can never serve as an HMAC secret.
ALGORITHMS_BY_KEY_TYPE = {
    "RSA": ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512"),
    "EC": ("ES256", "ES384", "ES512"),
    "OKP": ("EdDSA",),
}
ALGORITHMS = tuple(a for algs in ALGORITHMS_BY_KEY_TYPE.values() for a in algs)
DEFAULT_STORES_CLAIM = "keyroute_stores"
LEEWAY_S = 30.0
# A token naming a key id not in the set asks for a fetch at most this often (and one at a time).
JWKS_UNKNOWN_KID_S = 30.0
# A whole fetch (connecting, the answer's head and its whole body) is abandoned past this.
JWKS_DEADLINE_S = 5.0
# A larger JWKS is refused (a real one is a few kilobytes).
MAX_JWKS_BYTES = 1 << 20
# What every JWT identity's name starts with, before the subject: never a token's name.
JWT_PREFIX = "jwt:"
# How often the token file is looked at for a change.
POLL_S = 2.0
# Cached Authorization headers at most (the cache is emptied when full).
CACHE_SIZE = 10_000
# Longer Authorization headers are refused without looking at them.
MAX_CREDENTIAL_BYTES = 16_384
_BEARER = b"bearer "
# The signing key id of a cached token file's identity: none a JWKS can have.
_TOKEN = object()


class AuthnError(Exception):
    """A token file, JWKS or group mapping that does not load: the message says which and why, in one line."""


def file_stamp(paths: Iterable[str]) -> tuple[Any, ...]:
    """What tells a changed file from the one seen before, for each of `paths` (None: not there): device,
    inode (a swapped symbolic link, as Kubernetes rotates a mounted Secret, is a new one), size, mtime."""
    stamps: list[Any] = []
    for path in paths:
        try:
            st = os.stat(path)  # follows symbolic links
        except OSError:
            stamps.append(None)
        else:
            stamps.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(stamps)


def read_document(path: str, what: str) -> Any:
    """A TOML or JSON file (JSON when it ends in .json or starts with `{`), parsed; AuthnError otherwise."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise AuthnError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
        if path.endswith(".json") or text.lstrip().startswith("{"):
            return json.loads(text)
        return tomllib.loads(text)
    except (UnicodeDecodeError, ValueError) as exc:
        raise AuthnError(f"the {what} {path} is neither valid TOML nor JSON: {exc}") from None


def stores_of(value: Any, where: str) -> frozenset[str] | None:
    """Stores as a file or claim names them: "*" (every store: None), a list of names, or names separated by
    spaces or commas. AuthnError for anything else."""
    if value == "*":
        return None
    if isinstance(value, str):
        return frozenset(value.replace(",", " ").split())
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return None if "*" in value else frozenset(value)
    raise AuthnError(f'{where}: stores must be "*" or a list of store names')


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


@dataclass(frozen=True, slots=True)
class Tokens:
    """A token file's contents: identities by the sha256 digest of their token, and by certificate name."""

    by_digest: Mapping[bytes, Identity]
    by_certificate: Mapping[str, Identity]


def parse_tokens(document: Any, where: str) -> Tokens:
    """A token file's parsed document: `{"tokens": [{"name", "token" | "sha256" | "certificate", "stores",
    "admin"}, ...]}`. AuthnError naming the first entry that does not fit."""
    entries = document.get("tokens") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise AuthnError(f'{where} has no list of tokens (a [[tokens]] table or a "tokens" array)')
    by_digest: dict[bytes, Identity] = {}
    by_certificate: dict[str, Identity] = {}
    for i, entry in enumerate(entries, 1):
        at = f"{where}, token {i}"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
            raise AuthnError(f"{at}: each token needs a name")
        admin = entry.get("admin", False)
        if not isinstance(admin, bool):
            raise AuthnError(f"{at}: admin must be true or false")
        if entry["name"].startswith(JWT_PREFIX):
            raise AuthnError(f"{at}: a name starting with {JWT_PREFIX!r} is a JWT subject's, never a token's")
        if "stores" not in entry:
            raise AuthnError(f'{at}: stores missing (a list of store names, or "*")')
        identity = Identity(entry["name"], stores_of(entry["stores"], at), admin)
        given = [k for k in ("token", "sha256", "certificate") if k in entry]
        if len(given) != 1 or not isinstance(entry[given[0]], str) or not entry[given[0]]:
            raise AuthnError(f"{at}: give exactly one of token, sha256 or certificate")
        value = entry[given[0]]
        if given[0] == "certificate":
            by_certificate[value] = identity
            continue
        if given[0] == "token":
            digest = _digest(value.encode("utf-8"))
        else:
            try:
                digest = bytes.fromhex(value)
            except ValueError:
                digest = b""
            if len(digest) != 32:
                raise AuthnError(f"{at}: sha256 must be the 64 hex digits of the token's SHA-256 digest")
        if digest in by_digest:
            raise AuthnError(f"{at}: the same token as {by_digest[digest].name!r}")
        by_digest[digest] = identity
    return Tokens(by_digest, by_certificate)


class TokenFile:
    """The tokens of `path`, looked at again (`check`) when the file changes: a file that no longer loads
    keeps the previous tokens, said in one log line. The first load raises AuthnError."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen = file_stamp((path,))
        self.tokens = parse_tokens(read_document(path, "token file"), path)

    def check(self) -> bool:
        """Load the file again if it changed since last seen; whether new tokens are in use."""
        stamp = file_stamp((self.path,))
        if stamp == self._seen:
            return False
        self._seen = stamp
        try:
            tokens = parse_tokens(read_document(self.path, "token file"), self.path)
        except AuthnError as exc:
            log.warning("keeping the previous tokens: %s", exc)
            return False
        self.tokens = tokens
        log.info(
            "tokens reloaded from %s: %d tokens, %d certificates",
            self.path,
            len(tokens.by_digest),
            len(tokens.by_certificate),
        )
        return True

    def identify(self, token: bytes) -> Identity | None:
        """The identity of `token`, or None. Looked up by its SHA-256 digest: the time taken depends on the
        digest alone, never on how much of a known token the presented one matches."""
        return self.tokens.by_digest.get(_digest(token))


@dataclass(frozen=True, slots=True)
class JwtPolicy:
    """What a JWT must say: its issuer (`iss`), audience (`aud`; "" not checked), and where its stores are:
    the claim `stores_claim`, or (with `groups_claim`) the stores `groups` maps its groups to. `exp` and
    `nbf` are checked with `leeway_s`."""

    issuer: str
    audience: str = ""
    stores_claim: str = DEFAULT_STORES_CLAIM
    groups_claim: str = ""
    groups: Mapping[str, frozenset[str] | None] = field(default_factory=dict)
    leeway_s: float = LEEWAY_S


def check_jwks_url(url: str, allow_http: bool) -> None:
    """AuthnError (one line) unless `url` is an https:// URL, or an http:// one and `allow_http`: keys
    fetched in the clear could be swapped on the way, and then anyone could sign tokens."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme == "https" or (scheme == "http" and allow_http):
        return
    if scheme == "http":
        raise AuthnError(
            f"--jwt-jwks-url {url} is http://: signing keys are fetched over https:// only "
            "(--jwt-jwks-allow-http for tests and local issuers)"
        )
    raise AuthnError(f"--jwt-jwks-url {url} is not an https:// URL")


class FetchDeadline:
    """The total deadline of one JWKS fetch: `at` on `clock` (monotonic seconds). A fetch checks it between
    the pieces it receives (`collect`), so a server that trickles its answer is abandoned once it passes."""

    def __init__(self, seconds: float, clock: Callable[[], float]) -> None:
        self.seconds, self.clock = seconds, clock
        self.at = clock() + seconds

    def remaining(self) -> float:
        """Seconds left (0 once passed)."""
        return max(0.0, self.at - self.clock())

    def check(self, what: str) -> None:
        """AuthnError if the deadline has passed."""
        if self.clock() >= self.at:
            raise self.passed(what)

    def passed(self, what: str) -> AuthnError:
        """The error of a fetch of `what` abandoned at the deadline."""
        return AuthnError(f"{what} did not arrive whole within the {self.seconds:g} s deadline: abandoned")

    def collect(self, received: bytearray, chunk: bytes, what: str) -> None:
        """Add `chunk` to `received`; AuthnError past the deadline or beyond MAX_JWKS_BYTES."""
        received += chunk
        if len(received) > MAX_JWKS_BYTES:
            raise AuthnError(f"{what} is larger than {MAX_JWKS_BYTES} bytes")
        self.check(what)


# The signing keys of a JWKS: key id -> (key, the algorithms it may sign with, its JWK as published).
KeySet = Mapping[str | None, tuple[Any, tuple[str, ...], Mapping[str, Any]]]


def parse_jwks(raw: bytes, jwt: Any) -> dict[str | None, tuple[Any, tuple[str, ...], Mapping[str, Any]]]:
    """The usable signing keys of a JWKS document (JSON bytes); `jwt` is PyJWT. Raises for a document that
    does not parse."""
    document = json.loads(raw)
    keys = {}
    for jwk in document["keys"]:
        if jwk.get("kty") not in ALGORITHMS_BY_KEY_TYPE or jwk.get("use", "sig") != "sig":
            continue
        family = ALGORITHMS_BY_KEY_TYPE[jwk["kty"]]
        # A key that names its algorithm signs with that one only.
        algorithms = (jwk["alg"],) if jwk.get("alg") in family else family
        keys[jwk.get("kid")] = (jwt.PyJWK(jwk).key, algorithms, jwk)
    return keys


class SigningKeys:
    """An issuer's signing keys, from `fetch(deadline)` (the JWKS's bytes, read within `deadline`, a
    FetchDeadline): once at start (`load`, which raises AuthnError), then only on this object's own thread
    (`start`), never on a read's path: every `refresh_s`, and when a token names a key id not in the set
    (`ask`: at most one fetch in flight, at most one every `unknown_kid_s`). A fetch that fails, times out or
    brings no usable key keeps the last good set, counted in `fetch_failures` and said in one log line. The
    key ids a refresh removed (or whose key changed) are put on `removed`, for the identities verified with
    them to be forgotten. `clock` is monotonic seconds (tests move it by hand and call `step`)."""

    def __init__(
        self,
        fetch: Callable[[FetchDeadline], bytes],
        *,
        refresh_s: float = JWKS_REFRESH_S,
        unknown_kid_s: float = JWKS_UNKNOWN_KID_S,
        deadline_s: float = JWKS_DEADLINE_S,
        clock: Callable[[], float] = time.monotonic,
        source: str = "the JWKS",
    ) -> None:
        import jwt  # only a router or node that verifies JWTs pays for importing it

        self._jwt, self._fetch, self.source = jwt, fetch, source
        self.refresh_s, self.deadline_s, self._clock = refresh_s, deadline_s, clock
        self.unknown_kid_s = min(unknown_kid_s, refresh_s)
        # Replaced whole by a refresh (one assignment): a read looks it up without a lock.
        self.current: KeySet = {}
        self.loaded = False
        self.fetch_failures = 0
        self.fetches = 0
        # Key ids each refresh removed or changed, in order; taken by the Authenticator on its own thread.
        self.removed: deque[frozenset[str | None]] = deque()
        self._lock = threading.Lock()
        self._asked = False  # a fetch asked for by an unknown key id, not yet done
        self._last_fetch = float("-inf")  # when the last fetch started (clock)
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def load(self) -> None:
        """The first fetch: AuthnError (one line) when it fails or brings no usable key."""
        self._last_fetch = self._clock()
        try:
            keys = self._fetched()
        except AuthnError:
            raise
        except Exception as exc:  # whatever a fetch may raise: one line, never a traceback
            raise AuthnError(f"{self.source} could not be fetched: {type(exc).__name__}: {str(exc)[:200]}") from None
        if not keys:
            raise AuthnError(f"{self.source} has no usable signing key (RSA, EC or OKP)")
        self.current, self.loaded = keys, True

    def _fetched(self) -> dict[str | None, tuple[Any, tuple[str, ...], Mapping[str, Any]]]:
        self.fetches += 1
        deadline = FetchDeadline(self.deadline_s, self._clock)
        raw = self._fetch(deadline)
        deadline.check(self.source)  # a fetch that overran is not used, whatever it brought
        try:
            return parse_jwks(raw, self._jwt)
        except Exception as exc:
            raise AuthnError(f"{self.source} does not load: {str(exc)[:200]}") from None

    def ask(self) -> bool:
        """A token named a key id not in the set: fetch again in the background, unless a fetch is already
        asked for or in flight, or the last one started less than `unknown_kid_s` ago. Whether one is asked
        for. Never waits."""
        with self._lock:
            if self._asked or self._clock() - self._last_fetch < self.unknown_kid_s:
                return False
            self._asked = True
        self._wake.set()
        return True

    def step(self) -> float:
        """What the background thread does when woken: fetch if asked for or due (the period since the last
        fetch has passed). Seconds until the next fetch is due."""
        now = self._clock()
        with self._lock:
            due = self._asked or now - self._last_fetch >= self.refresh_s
            if due:
                self._last_fetch = now
        if due:
            try:
                self.refresh()
            finally:
                with self._lock:
                    self._asked = False
        return max(0.0, self._last_fetch + self.refresh_s - self._clock())

    def refresh(self) -> bool:
        """Fetch the keys now (blocking: the background thread's work) and put them in use; whether it did.
        A failure keeps the last good set."""
        try:
            keys = self._fetched()
            if not keys:
                raise AuthnError(f"{self.source} has no usable signing key (RSA, EC or OKP)")
        except AuthnError as exc:
            self._failed(str(exc))
            return False
        except Exception as exc:  # whatever a fetch may raise: counted and said, never the thread's end
            self._failed(f"{self.source} could not be fetched: {type(exc).__name__}: {str(exc)[:200]}")
            return False
        old = self.current
        removed = frozenset(kid for kid, entry in old.items() if kid not in keys or keys[kid][2] != entry[2])
        self.current = keys  # first the new set, then what it removed (see Authenticator.poll)
        if removed:
            self.removed.append(removed)
            log.info(
                "JWT signing keys refreshed from %s: %d keys; removed or changed: %s",
                self.source,
                len(keys),
                ", ".join(sorted(str(kid) for kid in removed)),
            )
        elif set(keys) != set(old):
            log.info("JWT signing keys refreshed from %s: %d keys", self.source, len(keys))
        return True

    def _failed(self, cause: str) -> None:
        self.fetch_failures += 1
        log.warning("keeping the last good JWT signing keys (%d): %s", len(self.current), cause)

    def start(self) -> None:
        """Refresh in the background from now on, on a daemon thread (`close` stops it)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="jwks-refresh", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        wait = max(0.0, self._last_fetch + self.refresh_s - self._clock())
        while True:
            self._wake.wait(wait)
            self._wake.clear()
            if self._stopped:
                return
            wait = self.step()

    def close(self) -> None:
        """Stop refreshing (a fetch in flight ends by its deadline, on the daemon thread)."""
        self._stopped = True
        self._wake.set()

    @property
    def refreshing(self) -> bool:
        """Whether the background refresh (`start`) runs: False again once `close` has stopped it."""
        thread = self._thread
        return thread is not None and thread.is_alive()


class JwtVerifier:
    """Verifies JWTs by `policy` against `keys` (loaded first if they are not yet: AuthnError)."""

    def __init__(self, policy: JwtPolicy, keys: SigningKeys) -> None:
        import jwt

        self._jwt, self.policy, self.keys = jwt, policy, keys
        if not keys.loaded:
            keys.load()

    @property
    def issuer(self) -> str:
        return self.policy.issuer

    def _key(self, kid: Any) -> tuple[Any, Any]:
        """The key id in the set and its entry for a token's `kid`; (None, None) for none (an unknown key id
        asks for a fetch in the background, never waited for)."""
        keys = self.keys.current
        found = keys.get(kid)
        if found is not None:
            return kid, found
        if kid is None and len(keys) == 1:
            return next(iter(keys.items()))
        if isinstance(kid, str):
            self.keys.ask()  # a key the issuer may just have added: it reads once it is fetched
        return None, None

    def verify(self, token: str) -> tuple[Identity, float]:
        """The identity a valid token names (`jwt:SUBJECT`) and when it expires (seconds since the epoch).
        Unauthorized (invalid_token) for anything else: malformed, another algorithm, an unknown key, a bad
        signature, another issuer or audience, expired, not yet valid, without stores."""
        identity, expires, _ = self.verify_with_key(token)
        return identity, expires

    def verify_with_key(self, token: str) -> tuple[Identity, float, str | None]:
        """`verify`, and the id of the key in the set that verified the token."""
        jwt = self._jwt
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise Unauthorized("the bearer token is not a valid JWT", invalid_token=True) from None
        alg = header.get("alg")
        if alg not in ALGORITHMS:
            raise Unauthorized(f"JWT algorithm {str(alg)[:20]!r} is not accepted", invalid_token=True)
        kid, found = self._key(header.get("kid"))
        if found is None:
            raise Unauthorized("the JWT is signed by an unknown key", invalid_token=True)
        key, algorithms, _ = found
        if alg not in algorithms:
            raise Unauthorized(f"JWT algorithm {alg} does not fit its key", invalid_token=True)
        policy = self.policy
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=[alg],
                audience=policy.audience or None,
                issuer=policy.issuer,
                leeway=policy.leeway_s,
                options={"require": ["exp", "iss", "sub"], "verify_aud": bool(policy.audience)},
            )
        except jwt.ExpiredSignatureError:
            raise Unauthorized("the JWT has expired", invalid_token=True) from None
        except jwt.PyJWTError as exc:
            raise Unauthorized(f"the JWT is not valid: {str(exc)[:100]}", invalid_token=True) from None
        sub = claims.get("sub")
        if not isinstance(sub, str) or not sub:
            raise Unauthorized("the JWT names no subject", invalid_token=True)
        return Identity(JWT_PREFIX + sub, self._stores(claims)), float(claims["exp"]), kid

    def _stores(self, claims: Mapping[str, Any]) -> frozenset[str] | None:
        policy = self.policy
        try:
            if not policy.groups_claim:
                return stores_of(claims.get(policy.stores_claim, []), "the JWT")
            groups = claims.get(policy.groups_claim, [])
            if isinstance(groups, str):
                groups = groups.split()
            if not isinstance(groups, list):
                return frozenset()
            stores: set[str] = set()
            for group in groups:
                if isinstance(group, str) and group in policy.groups:
                    mapped = policy.groups[group]
                    if mapped is None:
                        return None
                    stores |= mapped
            return frozenset(stores)
        except AuthnError:
            return frozenset()  # a claim of another shape grants nothing


def parse_groups(document: Any, where: str) -> dict[str, frozenset[str] | None]:
    """A group mapping file: `{"groups": {"GROUP": ["store", ...] | "*"}}`."""
    groups = document.get("groups") if isinstance(document, dict) else None
    if not isinstance(groups, dict):
        raise AuthnError(f'{where} has no groups table (GROUP = [stores] or "*")')
    return {str(name): stores_of(value, f"{where}, group {name!r}") for name, value in groups.items()}


class Authenticator:
    """Turns an Authorization header (raw bytes) or a client certificate's names into an Identity: tokens of
    a `TokenFile`, JWTs of a `JwtVerifier`, either or both. Each raw header's identity is cached (a dict
    lookup per read) until its JWT expires, the token file changes (looked at every `poll_s`) or a refresh
    of the signing keys removes the key that verified it (taken at the next `poll`)."""

    def __init__(
        self,
        tokens: TokenFile | None = None,
        jwt: JwtVerifier | None = None,
        *,
        poll_s: float = POLL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.tokens, self.jwt = tokens, jwt
        self.poll_s, self._clock = poll_s, clock
        self._looked = time.monotonic()
        # Raw Authorization header -> its identity, when that expires (seconds since the epoch) and the id of
        # the signing key that verified it (_TOKEN: a token of the token file).
        self._cache: dict[bytes, tuple[Identity, float, Any]] = {}
        # Key ids the signing keys' refreshes removed, put there by their thread.
        self._removed: deque[frozenset[str | None]] = jwt.keys.removed if jwt is not None else deque()

    def describe(self) -> str:
        """What callers are identified by, for the start-up line."""
        ways = []
        if self.tokens is not None:
            ways.append(f"tokens and certificates of {self.tokens.path}")
        if self.jwt is not None:
            ways.append(f"JWTs of {self.jwt.issuer}")
        return " and ".join(ways)

    def poll(self, now: float) -> None:
        """Forget the identities of signing keys a refresh removed; look at the token file again when `poll_s`
        has passed since the last look (`now`: monotonic). Called before each read is identified."""
        if self._removed:
            self._forget_removed_keys()
        if now - self._looked >= self.poll_s:
            self._looked = now
            if self.tokens is not None and self.tokens.check():
                self._cache.clear()

    def _forget_removed_keys(self) -> None:
        removed: set[Any] = set()
        while self._removed:
            removed |= self._removed.popleft()
        kept = {header: entry for header, entry in self._cache.items() if entry[2] not in removed}
        if len(kept) != len(self._cache):
            log.info("forgot %d cached JWT identities of removed signing keys", len(self._cache) - len(kept))
        self._cache = kept

    def identify(self, authorization: bytes | None) -> Identity:
        """The identity of a request's Authorization header (`Bearer TOKEN`). Unauthorized without one, or
        with a token no configured way knows."""
        if authorization is None:
            raise Unauthorized("credentials required: Authorization: Bearer TOKEN")
        cached = self._cache.get(authorization)
        if cached is not None:
            known, until, _ = cached
            if until == float("inf") or self._clock() < until:
                return known
            del self._cache[authorization]
        if len(authorization) > MAX_CREDENTIAL_BYTES:
            raise Unauthorized("the Authorization header is too long", invalid_token=True)
        if authorization[:7].lower() != _BEARER:
            raise Unauthorized("credentials required: Authorization: Bearer TOKEN")
        token = authorization[7:].strip()
        identity: Identity | None = None
        expires = float("inf")
        kid: Any = _TOKEN
        if self.tokens is not None:
            identity = self.tokens.identify(token)
        if identity is None and self.jwt is not None and token.count(b".") == 2:
            try:
                text = token.decode("ascii")
            except UnicodeDecodeError:
                raise Unauthorized("the bearer token is not a valid JWT", invalid_token=True) from None
            identity, expires, kid = self.jwt.verify_with_key(text)
            if kid not in self.jwt.keys.current:
                return identity  # its key went while it was verified: not kept (poll has taken the removal)
        if identity is None:
            raise Unauthorized("the bearer token is not valid", invalid_token=True)
        if len(self._cache) >= CACHE_SIZE:
            self._cache.clear()
        self._cache[authorization] = (identity, expires, kid)
        return identity

    def certificate(self, names: Iterable[str]) -> Identity | None:
        """The identity the token file gives the first of a client certificate's `names` it maps, or None."""
        if self.tokens is None:
            return None
        by_certificate = self.tokens.tokens.by_certificate
        for name in names:
            identity = by_certificate.get(name)
            if identity is not None:
                return identity
        return None
