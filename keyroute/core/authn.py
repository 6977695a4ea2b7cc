"""Who is asking: a request's credentials (a bearer token, a JWT, a client certificate's name) turned into the
`keyroute.core.access.Identity` it reads under.

    TokenFile       static tokens from a TOML or JSON file, looked at again when it changes: each entry a
                    `name`, its `stores` (a list, or "*") and `admin`; a `token` (as given, or `sha256`, its
                    hex digest) or a `certificate` (a client certificate's SAN or subject CN)
    JwtVerifier     JSON Web Tokens signed by an issuer's keys (a JWKS, from a file or fetched), with an
                    explicit list of asymmetric algorithms (never `none`, never HS*); `iss`, `aud`, `exp`,
                    `nbf` checked with a small leeway; the stores from a claim, or from groups and a mapping
    Authenticator   both, behind one `identify(authorization, now)`, each raw Authorization header's identity
                    cached until it expires or the token file changes

Nothing here speaks HTTP: keyroute.http.authn takes the headers and the TLS peer of a call, and fetches a
JWKS from its URL.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from keyroute.core.access import Identity
from keyroute.core.api import Unauthorized

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
# A JWKS is fetched again for an unknown key id at most this often.
JWKS_REFRESH_S = 30.0
# How often the token file is looked at for a change.
POLL_S = 2.0
# Cached Authorization headers at most (the cache is emptied when full).
CACHE_SIZE = 10_000
# Longer Authorization headers are refused without looking at them.
MAX_CREDENTIAL_BYTES = 16_384
_BEARER = b"bearer "


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


class JwtVerifier:
    """Verifies JWTs by `policy` against the keys of a JWKS that `load_keys()` returns (its JSON bytes; a
    file's, or a URL's, fetched again for an unknown key id at most every `refresh_s`)."""

    def __init__(
        self,
        policy: JwtPolicy,
        load_keys: Callable[[], bytes],
        *,
        refresh_s: float = JWKS_REFRESH_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        import jwt  # only a router or node that verifies JWTs pays for importing it

        self._jwt, self.policy, self._load_keys = jwt, policy, load_keys
        self.refresh_s, self._clock = refresh_s, clock
        self._keys: dict[str | None, Any] = {}
        self._loaded_at = -refresh_s
        self._refresh()
        if not self._keys:
            raise AuthnError("the JWKS has no usable signing key (RSA, EC or OKP)")

    @property
    def issuer(self) -> str:
        return self.policy.issuer

    def _refresh(self) -> None:
        self._loaded_at = self._clock()
        try:
            document = json.loads(self._load_keys())
            keys = {}
            for jwk in document["keys"]:
                if jwk.get("kty") not in ALGORITHMS_BY_KEY_TYPE or jwk.get("use", "sig") != "sig":
                    continue
                keys[jwk.get("kid")] = (self._jwt.PyJWK(jwk).key, ALGORITHMS_BY_KEY_TYPE[jwk["kty"]], jwk)
        except AuthnError:
            if not self._keys:
                raise
            log.warning("keeping the previous JWT signing keys: the JWKS could not be fetched")
            return
        except Exception as exc:
            if not self._keys:
                raise AuthnError(f"the JWKS does not load: {exc}") from None
            log.warning("keeping the previous JWT signing keys: the JWKS does not load: %s", exc)
            return
        self._keys = keys

    def _key(self, kid: Any) -> Any:
        found = self._keys.get(kid)
        if found is None and kid is None and len(self._keys) == 1:
            found = next(iter(self._keys.values()))
        if found is None and isinstance(kid, str) and self._clock() - self._loaded_at >= self.refresh_s:
            self._refresh()  # a key the issuer has just added
            found = self._keys.get(kid)
        return found

    def verify(self, token: str) -> tuple[Identity, float]:
        """The identity a valid token names and when it expires (seconds since the epoch). Unauthorized
        (invalid_token) for anything else: malformed, another algorithm, an unknown key, a bad signature,
        another issuer or audience, expired, not yet valid, without stores."""
        jwt = self._jwt
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise Unauthorized("the bearer token is not a valid JWT", invalid_token=True) from None
        alg = header.get("alg")
        if alg not in ALGORITHMS:
            raise Unauthorized(f"JWT algorithm {str(alg)[:20]!r} is not accepted", invalid_token=True)
        found = self._key(header.get("kid"))
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
        return Identity(sub, self._stores(claims)), float(claims["exp"])

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
    lookup per read) until its JWT expires or the token file changes, which is looked at every `poll_s`."""

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
        # Raw Authorization header -> its identity and when that expires (seconds since the epoch).
        self._cache: dict[bytes, tuple[Identity, float]] = {}

    def describe(self) -> str:
        """What callers are identified by, for the start-up line."""
        ways = []
        if self.tokens is not None:
            ways.append(f"tokens and certificates of {self.tokens.path}")
        if self.jwt is not None:
            ways.append(f"JWTs of {self.jwt.issuer}")
        return " and ".join(ways)

    def poll(self, now: float) -> None:
        """Look at the token file again when `poll_s` has passed since the last look (`now`: monotonic)."""
        if now - self._looked >= self.poll_s:
            self._looked = now
            if self.tokens is not None and self.tokens.check():
                self._cache.clear()

    def identify(self, authorization: bytes | None) -> Identity:
        """The identity of a request's Authorization header (`Bearer TOKEN`). Unauthorized without one, or
        with a token no configured way knows."""
        if authorization is None:
            raise Unauthorized("credentials required: Authorization: Bearer TOKEN")
        cached = self._cache.get(authorization)
        if cached is not None:
            identity, expires = cached
            if expires == float("inf") or self._clock() < expires:
                return identity
            del self._cache[authorization]
        if len(authorization) > MAX_CREDENTIAL_BYTES:
            raise Unauthorized("the Authorization header is too long", invalid_token=True)
        if authorization[:7].lower() != _BEARER:
            raise Unauthorized("credentials required: Authorization: Bearer TOKEN")
        token = authorization[7:].strip()
        identity = None
        expires = float("inf")
        if self.tokens is not None:
            identity = self.tokens.identify(token)
        if identity is None and self.jwt is not None and token.count(b".") == 2:
            try:
                text = token.decode("ascii")
            except UnicodeDecodeError:
                raise Unauthorized("the bearer token is not a valid JWT", invalid_token=True) from None
            identity, expires = self.jwt.verify(text)
        if identity is None:
            raise Unauthorized("the bearer token is not valid", invalid_token=True)
        if len(self._cache) >= CACHE_SIZE:
            self._cache.clear()
        self._cache[authorization] = (identity, expires)
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
