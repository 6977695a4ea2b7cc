"""The `schema_registry` settings a spec gives (a live store's values, a store's keys), the client configuration
they make for confluent-kafka's SchemaRegistryClient, and a small cached fetch of schemas by id or subject.

    [stores.NAME.live.schema_registry]
    url = "https://registry.example:8081"          # several: comma-separated
    "basic.auth.user.info" = "${SR_USER_INFO}"      # USER:PASSWORD, only as an ${ENV} reference
    # or "bearer.auth.token" = "${SR_TOKEN}" (with "bearer.auth.logical.cluster" where the registry wants one)
    "ssl.ca.location" = "/etc/keyroute/registry-ca.pem"
    "ssl.certificate.location" = "..."  "ssl.key.location" = "..."  "ssl.key.password" = "${SR_KEY_PASSWORD}"
    timeout = 10

Option names are the client's own (confluent-kafka's SchemaRegistryClient), so a working client configuration
copies over. Secrets are never written to a spec, a manifest or ZooKeeper: each is an `${ENV}` reference that
the process reading the registry resolves from its environment when it connects.

Errors of a fetch are split in two for the callers that decide what to do with a record: `UnknownSchema` (the
registry answered that the id or subject does not exist: the record or spec is wrong) and
`RegistryUnavailable` (no answer, or a server error: try again later).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from keyroute.runtime.logs import describe

SECRET_OPTIONS = frozenset({"basic.auth.user.info", "bearer.auth.token", "ssl.key.password"})
_TEXT_OPTIONS = frozenset(
    {
        "bearer.auth.logical.cluster",
        "bearer.auth.identity.pool.id",
        "ssl.ca.location",
        "ssl.certificate.location",
        "ssl.key.location",
    }
)
_NUMBER_OPTIONS = frozenset({"timeout", "max.retries", "retries.wait.ms", "retries.max.wait.ms"})
OPTIONS = frozenset({"url"}) | SECRET_OPTIONS | _TEXT_OPTIONS | _NUMBER_OPTIONS
# How long `latest` trusts an answer about a subject's newest version.
LATEST_TTL_S = 30.0


class RegistrySettingsError(ValueError):
    """A `schema_registry` table that cannot be used; the message names the option and how to fix it."""


class UnknownSchema(LookupError):
    """The registry says the schema id (or subject, or version) does not exist."""


class RegistryUnavailable(ConnectionError):
    """The registry did not answer, or answered with a server error: worth trying again later."""


def env_reference(value: str) -> str | None:
    """NAME when `value` is exactly `${NAME}`, else None."""
    match = re.fullmatch(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", value)
    return None if match is None else match[1]


# A folder of secrets, one file per name (a Kubernetes Secret mounted as a volume): where a `${NAME}` that is
# not in the environment is read from, so that no secret need be put in a process's environment.
SECRETS_DIR_VARIABLE = "KEYROUTE_SECRETS_DIR"


def resolve_env(what: str, value: str, environ: Mapping[str, str], error: type[ValueError]) -> str:
    """`value`, or what it names as `${NAME}`: the variable NAME of `environ`, else the file NAME in the folder
    `environ[KEYROUTE_SECRETS_DIR]` names (one trailing newline dropped); `error` when neither is there or
    the file cannot be read."""
    ref = env_reference(value)
    if ref is None:
        return value
    if ref in environ:
        return environ[ref]
    folder = environ.get(SECRETS_DIR_VARIABLE, "")
    if not folder:
        raise error(f"{what} names ${{{ref}}}, which is not set")
    path = Path(folder) / ref
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{what} names ${{{ref}}}, which is neither set nor a file in {folder}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{what} names ${{{ref}}}: {path} cannot be read ({describe(exc)})") from None
    return text[:-1] if text.endswith("\n") else text


@dataclass(frozen=True, slots=True)
class RegistrySettings:
    """Where the Schema Registry is and how to reach it; `options` are the client's option names (secrets as
    `${ENV}` references, numbers as text)."""

    url: str
    options: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, table: Any, where: str = "schema_registry") -> RegistrySettings:
        """The settings a spec's table describes; RegistrySettingsError naming the option otherwise."""
        if not isinstance(table, Mapping):
            raise RegistrySettingsError(f"{where} must be a table (url = ..., and the client's TLS/auth options)")
        unknown = sorted(set(table) - OPTIONS)
        if unknown:
            raise RegistrySettingsError(
                f"{where}: unknown option {unknown[0]!r} (options: {', '.join(sorted(OPTIONS))})"
            )
        url = table.get("url")
        if not isinstance(url, str) or not url.strip():
            raise RegistrySettingsError(f'{where}.url is required: url = "https://registry:8081"')
        for one in url.split(","):
            parts = urlsplit(one.strip())
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise RegistrySettingsError(f"{where}.url {one.strip()!r} is not an http(s) URL")
            if parts.username is not None or parts.password is not None:
                raise RegistrySettingsError(
                    f'{where}.url carries credentials: give them as "basic.auth.user.info" = "${{ENV_VAR}}"'
                )
        options: dict[str, str] = {}
        for name, value in table.items():
            if name == "url":
                continue
            if name in _NUMBER_OPTIONS:
                if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                    raise RegistrySettingsError(f"{where}.{name} must be a number from 0 up, not {value!r}")
            elif not isinstance(value, str) or not value:
                raise RegistrySettingsError(f"{where}.{name} must be a non-empty string")
            if name in SECRET_OPTIONS and env_reference(value) is None:
                raise RegistrySettingsError(
                    f'{where}.{name} is a secret: write it as "${{ENV_VAR}}" and set that variable where the '
                    "registry is read (secrets are never written to manifests or ZooKeeper)"
                )
            options[name] = str(value)
        if "basic.auth.user.info" in options and "bearer.auth.token" in options:
            raise RegistrySettingsError(f"{where}: give basic.auth.user.info or bearer.auth.token, not both")
        return cls(url=",".join(u.strip() for u in url.split(",")), options=options)

    def client_conf(self, environ: Mapping[str, str]) -> dict[str, Any]:
        """The configuration of confluent-kafka's SchemaRegistryClient, `${ENV}` references resolved from
        `environ` (RegistrySettingsError when one is unset)."""
        conf: dict[str, Any] = {"url": self.url}
        for name, value in self.options.items():
            text = resolve_env(f"schema_registry.{name}", value, environ, RegistrySettingsError)
            conf[name] = (float(text) if name == "timeout" else int(float(text))) if name in _NUMBER_OPTIONS else text
        if "basic.auth.user.info" in conf and ":" not in conf["basic.auth.user.info"]:
            raise RegistrySettingsError("schema_registry.basic.auth.user.info must be USER:PASSWORD")
        if "bearer.auth.token" in conf:
            conf["bearer.auth.credentials.source"] = "STATIC_TOKEN"
            conf.setdefault("bearer.auth.logical.cluster", "")
        return conf

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "options": dict(sorted(self.options.items()))}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> RegistrySettings:
        return cls(url=str(doc["url"]), options={str(k): str(v) for k, v in dict(doc.get("options", {})).items()})


def registry_client(settings: RegistrySettings, environ: Mapping[str, str]) -> Any:
    """confluent-kafka's SchemaRegistryClient for `settings` (imported here: only registry users pay for it)."""
    from confluent_kafka.schema_registry import SchemaRegistryClient

    try:
        return SchemaRegistryClient(settings.client_conf(environ))
    except (TypeError, ValueError) as exc:
        if isinstance(exc, RegistrySettingsError):
            raise
        raise RegistrySettingsError(f"schema_registry: {exc}") from None


def _classified(call: Callable[[], Any], what: str) -> Any:
    """`call()`, its failure as UnknownSchema (the registry's 404) or RegistryUnavailable (everything else)."""
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    try:
        return call()
    except SchemaRegistryError as exc:
        if exc.http_status_code == 404:
            raise UnknownSchema(f"{what}: {exc.error_message}") from None
        raise RegistryUnavailable(
            f"{what}: the registry answered {exc.http_status_code}: {exc.error_message}"
        ) from None
    except Exception as exc:  # httpx transport errors, TLS, timeouts: the registry is not reachable
        raise RegistryUnavailable(f"{what}: {type(exc).__name__}: {exc}") from None


class SchemaFetcher:
    """Schemas by id (kept for good: an id's schema never changes) and subjects' latest versions (kept for
    `latest_ttl_s`), fetched with one client; thread-safe. `clock` is injectable for tests."""

    def __init__(
        self,
        settings: RegistrySettings,
        environ: Mapping[str, str],
        *,
        client: Any = None,
        latest_ttl_s: float = LATEST_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.client = client if client is not None else registry_client(settings, environ)
        self.latest_ttl_s = latest_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._by_id: dict[tuple[int, str | None], Any] = {}
        self._latest: dict[str, tuple[float, Any]] = {}

    def by_id(self, schema_id: int, fmt: str | None = None) -> Any:
        """The registered schema (confluent-kafka's `Schema`: schema_str, schema_type, references) of an id;
        `fmt` asks for a format (Protobuf's "serialized": the descriptor instead of .proto text)."""
        with self._lock:
            found = self._by_id.get((schema_id, fmt))
        if found is None:
            found = _classified(lambda: self.client.get_schema(schema_id, fmt=fmt), f"schema id {schema_id}")
            with self._lock:
                self._by_id[(schema_id, fmt)] = found
        return found

    def latest(self, subject: str) -> Any:
        """The newest version of `subject` (confluent-kafka's `RegisteredSchema`: schema_id, version, schema)."""
        now = self._clock()
        with self._lock:
            held = self._latest.get(subject)
        if held is not None and now - held[0] < self.latest_ttl_s:
            return held[1]
        # The client keeps its own answer for `latest` for as long as it lives: ask for the version numbers
        # (never cached), then that version (cached by the client: a version never changes).
        versions = _classified(lambda: self.client.get_versions(subject), f"subject {subject!r}")
        if not versions:
            raise UnknownSchema(f"subject {subject!r} has no versions")
        found = self.version(subject, max(versions))
        with self._lock:
            self._latest[subject] = (now, found)
            self._by_id.setdefault((found.schema_id, None), found.schema)
        return found

    def version(self, subject: str, version: int, fmt: str | None = None) -> Any:
        """One version of `subject` (a `RegisteredSchema`), in format `fmt` (see `by_id`)."""
        found = _classified(
            lambda: self.client.get_version(subject, version, fmt=fmt), f"subject {subject!r} v{version}"
        )
        with self._lock:
            self._by_id.setdefault((found.schema_id, fmt), found.schema)
        return found
