"""The `keyroute` command: parses options (each also read from a KEYROUTE_* variable) and starts services.

The environment is read here and nowhere else; everything inward receives typed settings.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from keyroute.auth.authn import AuthnError, check_jwks_url
from keyroute.keys.key_format import KeyFormat, KeyFormatError, parse_key
from keyroute.keys.key_schema import KeySchema, KeySchemaLookupError, check_key_schema, fetch_key_schema
from keyroute.keys.partitioner import MAX_PARTITIONS, Partitioner, key_hash, partition_for
from keyroute.keys.schema_registry import SECRETS_DIR_VARIABLE, RegistrySettings
from keyroute.runtime.logs import FORMATS
from keyroute.runtime.logs import configure as configure_logs
from keyroute.runtime.settings import (
    DEFAULT_STALL_AFTER_MS,
    AccessSettings,
    HttpSettings,
    NodeSettings,
    RequestLimits,
    RouterSettings,
    TlsSettings,
    ZkIdentity,
    ZkSettings,
    ZkTls,
)
from keyroute.zone import (
    SERVICE_ACCOUNT_DIR,
    ZONE_LABELS,
    ZoneError,
    in_cluster_api_url,
    node_zone,
    write_zone,
    zone_from_node,
)

ENV_PREFIX = "KEYROUTE_"
_log = logging.getLogger("keyroute.cli")
# The pipeline's default, repeated here so that `keyroute --help` does not import the pipeline.
DEFAULT_RETAIN = 3


def _env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


class _ArgumentParser(argparse.ArgumentParser):
    """argparse, but a missing option is one line naming it and its variable (exit 1), not the usage."""

    _given: Sequence[str] = ()

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._given = list(sys.argv[1:] if args is None else args)  # for `error`'s "did you mean"
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        required = "the following arguments are required: "
        if message.startswith(required):
            names = message.removeprefix(required).split(", ")
            if all(name.startswith("--") for name in names):
                missing = " and ".join(f"{name} (or {_env_name(name)})" for name in names)
                what = "is" if len(names) == 1 else "are"
                line = f"{self.prog}: {missing} {what} required"
                # Often a misspelt option: the one given that this command does not take.
                options = {flag for action in self._actions for flag in action.option_strings}
                unknown = [a for a in self._given if a.startswith("--") and a.split("=", 1)[0] not in options]
                line += _did_you_mean(unknown, options)
                self.exit(1, f"{line}; `{self.prog} --help` lists the options\n")
        super().error(message)


def _did_you_mean(given: Iterable[str], options: Iterable[str]) -> str:
    """"; did you mean --X?" for the first of `given` that is close to one of `options`, else ""."""
    known = sorted(flag for flag in options if flag.startswith("--"))
    for text in given:
        if text.startswith("--"):
            close = difflib.get_close_matches(text.split("=", 1)[0], known, n=1)
            if close:
                return f" ({text.split('=', 1)[0]} is not an option: did you mean {close[0]}?)"
    return ""


def _leaf(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command `args` holds: `keyroute store list`'s for ["store", "list", ...]."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        chosen = getattr(args, sub.dest, None) if sub is not None else None
        if sub is None or chosen not in sub.choices:
            return parser
        parser = sub.choices[chosen]


def _unrecognized(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> str:
    """One line for arguments the command does not take, with the closest option as "did you mean"."""
    leaf = _leaf(parser, args)
    options = {flag for action in leaf._actions for flag in action.option_strings}
    line = f"{leaf.prog}: unrecognized arguments: {' '.join(extras)}" + _did_you_mean(extras, options)
    return line + f"; `{leaf.prog} --help` lists the options"


class _Parser:
    """argparse with every option defaulting to its KEYROUTE_* environment variable."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    def option(
        self,
        parser: argparse.ArgumentParser,
        flag: str,
        *,
        type: Callable[[str], Any] = str,
        default: Any = None,
        required: bool = False,
        help: str = "",
        secret: bool = False,
        **kwargs: Any,
    ) -> None:
        env_name = _env_name(flag)
        if env_name in self.env:
            # A secret stays text until argparse converts it, so that a bad value is a usage error that
            # does not repeat it; its value never appears in --help.
            default = self.env[env_name] if secret else type(self.env[env_name])
            required = False
        suffix = f" [env {env_name}]"
        if default is not None and not secret:
            suffix += f" (default: {default})"
        parser.add_argument(flag, type=type, default=default, required=required, help=help + suffix, **kwargs)

    def flag(self, parser: argparse.ArgumentParser, flag: str, *, help: str = "") -> None:
        """An on/off switch; its variable is true for 1/true/yes/on."""
        env_name = _env_name(flag)
        default = self.env.get(env_name, "").strip().lower() in ("1", "true", "yes", "on")
        parser.add_argument(flag, action="store_true", default=default, help=f"{help} [env {env_name}]")


def _hedge_after_ms(text: str) -> float | None:
    """`auto` (None: derived from observed latencies) or a number of milliseconds, 0 meaning never."""
    if text.strip().lower() == "auto":
        return None
    try:
        return _non_negative_float(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number of milliseconds: {exc}") from None


def _number(
    convert: Callable[[str], Any], expected: str, fits: Callable[[Any], bool], range_message: str
) -> Callable[[str], Any]:
    """An argparse type: `convert(text)` when it spells `expected` and the value `fits`, else a usage error
    (`range_message` followed by the text)."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, not {text!r}") from None
        if not fits(value):
            raise argparse.ArgumentTypeError(f"{range_message}, not {text!r}")
        return value

    return parse


_non_negative_float = _number(float, "a number", lambda v: 0 <= v < float("inf"), "expected a number from 0 up")
_positive_int = _number(int, "a whole number", lambda v: v >= 1, "expected at least 1")
_positive_float = _number(float, "a number", lambda v: 0 < v < float("inf"), "expected a number above 0")
_port = _number(int, "a port number", lambda v: 0 < v < 65536, "a port is between 1 and 65535")
_percent = _number(float, "a percentage", lambda v: 0 <= v <= 100, "a percentage is between 0 and 100")


def _zk_identity(text: str) -> ZkIdentity | None:
    """USER:PASSWORD for ZooKeeper's digest scheme; empty means none (e.g. an absent optional Secret)."""
    text = text.rstrip("\r\n")  # a Secret written from a file often ends with a newline
    if not text:
        return None
    try:
        return ZkIdentity.parse(text)
    except ValueError as exc:  # ArgumentTypeError: argparse shows the message, never the value
        raise argparse.ArgumentTypeError(str(exc)) from None


def _zk_options(p: _Parser, parser: argparse.ArgumentParser, *, writes: bool) -> None:
    """--zk, the identity this process authenticates as and, for processes that write, the reader."""
    p.option(parser, "--zk", required=True, help="ZooKeeper HOST:PORT[/chroot]")
    p.option(
        parser,
        "--zk-auth",
        type=_zk_identity,
        secret=True,
        metavar="USER:PASSWORD",
        help="ZooKeeper digest identity USER:PASSWORD this process authenticates as"
        + (
            "; it gets ALL on everything this process creates (none: world-open ACLs, anyone can rewrite routing)"
            if writes
            else "; READ is all this process needs"
        ),
    )
    _secret_file_option(p, parser, "--zk-auth")
    if writes:
        p.option(
            parser,
            "--zk-reader",
            type=_zk_identity,
            secret=True,
            metavar="USER:PASSWORD",
            help="digest identity USER:PASSWORD granted READ on everything this process creates (the routers')",
        )
        _secret_file_option(p, parser, "--zk-reader")
        p.option(
            parser,
            "--zk-reader-dn",
            default="",
            metavar="DN",
            help="x509 identity granted READ on everything this process creates: the subject DN of the "
            "routers' ZooKeeper client certificate as ZooKeeper writes it (RFC 2253, e.g. CN=router,O=example)",
        )
    p.option(
        parser,
        "--zk-tls-ca",
        type=_optional_path,
        metavar="PEM",
        help="connect to ZooKeeper over TLS, "
        "trusting server certificates that chain to this CA (and checking the host name)",
    )
    p.option(
        parser,
        "--zk-tls-cert",
        type=_optional_path,
        metavar="PEM",
        help="client certificate presented to ZooKeeper (with --zk-tls-ca); without --zk-auth, its subject DN "
        "is this process's ZooKeeper identity (x509)",
    )
    p.option(parser, "--zk-tls-key", type=_optional_path, metavar="PEM", help="the key of --zk-tls-cert")


def _optional_path(text: str) -> Path | None:
    """A file name; empty means none (an unset variable in a manifest)."""
    return Path(text) if text.strip() else None


def _secret_text(text: str) -> str:
    return text.rstrip("\r\n")  # a Secret written from a file often ends with a newline


def _secret_file_option(p: _Parser, parser: argparse.ArgumentParser, flag: str) -> None:
    """`FLAG-file`: the secret option `flag`'s value read from a file at start (a Kubernetes Secret mounted as
    a file keeps the value out of the process's environment)."""
    p.option(
        parser,
        f"{flag}-file",
        type=_optional_path,
        metavar="FILE",
        help=f"read {flag} from this file at start (a trailing newline dropped), instead of giving it",
    )


# Secret options that also come from a file (`--X-file`), and how each option converts its text.
_SECRET_FILES: dict[str, Callable[[str], Any]] = {
    "zk_auth": _zk_identity,
    "zk_reader": _zk_identity,
    "cluster_secret": _secret_text,
    "admin_token": _secret_text,
}


def _read_secret_files(args: argparse.Namespace) -> str | None:
    """Fill each secret option given as `--X-file` from its file; why that cannot be done, or None."""
    for name, convert in _SECRET_FILES.items():
        path = getattr(args, f"{name}_file", None)
        if path is None:
            continue
        flag = "--" + name.replace("_", "-")
        if getattr(args, name, None):
            return f"give {flag} ({_env_name(flag)}) or {flag}-file ({_env_name(flag)}_FILE), not both"
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            return f"{flag}-file {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})"
        try:
            setattr(args, name, convert(text))
        except argparse.ArgumentTypeError as exc:
            return f"{flag}-file {path}: {exc}"
    return None


def _serving_options(p: _Parser, parser: argparse.ArgumentParser) -> None:
    """Request limits and access control, the same for routers and nodes."""
    limits = RequestLimits()
    p.option(
        parser,
        "--cluster-secret",
        type=_secret_text,
        secret=True,
        help="shared by every router and node (a Kubernetes Secret); with it, forwarding headers count only "
        "from members proving they hold it. Empty: anyone may send them (local use only). NEW,OLD during a "
        "rotation: members send with the first and accept any",
    )
    _secret_file_option(p, parser, "--cluster-secret")
    p.option(
        parser,
        "--admin-token",
        type=_secret_text,
        secret=True,
        help="token /admin/* requires (Authorization: Bearer TOKEN, or the cookie of a login at /admin/login); "
        "NEW,OLD during a rotation (either is accepted); empty: admin endpoints are open",
    )
    _secret_file_option(p, parser, "--admin-token")
    p.flag(parser, "--metrics-require-token", help="/metrics also requires the admin token")
    p.flag(
        parser,
        "--metrics-open",
        help="with access control on, /metrics answers scrapers without credentials (otherwise it needs an "
        "admin caller or the admin token: its labels name every store and caller)",
    )
    p.option(
        parser,
        "--access-tokens",
        default="",
        help="TOML or JSON file of callers' tokens and certificates, each with its stores (re-read when it "
        "changes); with it (or --jwt-issuer) every read needs a caller allowed its store. Empty: open",
    )
    p.option(parser, "--jwt-issuer", default="", help="accept JWTs from this issuer (`iss`) as bearer tokens")
    p.option(parser, "--jwt-audience", default="", help="the `aud` JWTs must name (empty: not checked)")
    p.option(parser, "--jwt-jwks-url", default="", help="where the issuer's signing keys (JWKS) are fetched")
    p.option(parser, "--jwt-jwks-file", default="", help="the issuer's signing keys (JWKS), from a file")
    p.option(
        parser,
        "--jwt-jwks-refresh-s",
        type=_positive_float,
        default=AccessSettings().jwt_jwks_refresh_s,
        help="fetch the JWKS again this often, in the background: a key removed from it stops authenticating "
        "within one period",
    )
    p.flag(parser, "--jwt-jwks-allow-http", help="accept an http:// --jwt-jwks-url (tests and local issuers only)")
    p.option(parser, "--jwt-stores-claim", default="keyroute_stores", help="the JWT claim listing its stores")
    p.option(parser, "--jwt-groups-claim", default="", help="the JWT claim listing its groups (instead of stores)")
    p.option(parser, "--jwt-groups-file", default="", help="TOML or JSON file: the stores each group may read")
    p.option(parser, "--max-batch-keys", type=int, default=1000, help="keys in one batch-get (413 beyond)")
    p.option(
        parser,
        "--max-key-bytes",
        type=int,
        default=limits.max_key_bytes,
        help="longest key in bytes, UTF-8 after percent-decoding (414, or 400 for a batch entry); 0: no limit",
    )
    p.option(
        parser,
        "--max-body-bytes",
        type=int,
        default=limits.max_body_bytes,
        help="largest request body (413 body_too_large); 0: no limit",
    )
    p.option(
        parser,
        "--max-header-bytes",
        type=int,
        default=limits.max_header_bytes,
        help="largest request line plus headers (431 headers_too_large); 0: no limit",
    )
    p.option(
        parser,
        "--max-concurrent-requests",
        type=int,
        default=limits.max_concurrent_requests,
        help="requests in progress at once; beyond it 503 overloaded with Retry-After at once, never queued; "
        "0: no limit",
    )
    p.option(
        parser,
        "--max-concurrent-per-caller",
        type=int,
        default=limits.max_concurrent_per_caller,
        help="requests in progress at once of one authenticated caller (503 overloaded beyond it); 0: only its "
        "fair share once the process is saturated",
    )
    p.option(
        parser,
        "--body-timeout-s",
        type=float,
        default=limits.body_timeout_s,
        help="a request body must arrive whole within this many seconds (408 body_timeout); 0: no limit",
    )


def _admin_port(text: str) -> int | None:
    """A port number, or empty (an unset variable): none."""
    text = text.strip()
    if not text:
        return None
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, not {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is between 1 and 65535, not {text!r}")
    return port


def _admin_port_option(p: _Parser, parser: argparse.ArgumentParser) -> None:
    p.option(
        parser,
        "--admin-port",
        type=_admin_port,
        # Taken as text from KEYROUTE_ADMIN_PORT and converted by argparse: a bad value is a usage error.
        secret=True,
        help="serve /admin/* and /metrics (and the probes, the API document) on this second port only; the "
        "data port then answers them 404. Unset: everything on --port",
    )


def _tls_options(p: _Parser, parser: argparse.ArgumentParser, *, router: bool) -> None:
    """HTTPS on every port this service listens on, and mutual TLS between members (docs/configuration.md)."""
    p.option(
        parser,
        "--tls-cert",
        default="",
        help="PEM certificate (chain) to serve HTTPS with on every port; reloaded when the file changes",
    )
    p.option(parser, "--tls-key", default="", help="PEM private key of --tls-cert")
    p.option(
        parser,
        "--tls-client-ca",
        default="",
        help="PEM CA file: clients must present a certificate chaining to it (mutual TLS with clients); a client "
        "certificate naming a member role is refused"
        if router
        else "PEM CA file of clients reading nodes directly, beside --member-ca (a different CA): its "
        "certificates are callers', never members'",
    )
    p.option(
        parser,
        "--member-ca",
        default="",
        help="PEM CA file of the cluster's members: connect to nodes over TLS presenting --tls-cert, and (nodes) "
        "require every client's certificate to chain to it, honouring member headers from routers and nodes only",
    )


def _http_settings(args: argparse.Namespace, **kwargs: Any) -> HttpSettings:
    if args.admin_port is not None and args.admin_port == args.port:
        raise SystemExit(f"keyroute {args.command}: --admin-port must differ from --port ({args.port})")
    try:
        tls = TlsSettings(
            cert=args.tls_cert, key=args.tls_key, client_ca=getattr(args, "tls_client_ca", ""), member_ca=args.member_ca
        )
    except ValueError as exc:
        raise SystemExit(f"keyroute {args.command}: {exc}") from None
    advertised = kwargs.get("advertise_url", "")
    if tls.enabled and advertised.lower().startswith("http://"):
        raise SystemExit(f"keyroute {args.command}: --advertise-url {advertised} is http://, but --tls-cert is HTTPS")
    return HttpSettings(host=args.host, port=args.port, admin_port=args.admin_port, tls=tls, **kwargs)


_ACCESS_OPTIONS = (
    "access_tokens",
    "jwt_issuer",
    "jwt_audience",
    "jwt_jwks_url",
    "jwt_jwks_file",
    "jwt_stores_claim",
    "jwt_groups_claim",
    "jwt_groups_file",
)


def _limits(args: argparse.Namespace) -> dict[str, Any]:
    """The settings fields `_serving_options` fills, for NodeSettings and RouterSettings alike."""
    for name in (
        "max_batch_keys",
        "max_key_bytes",
        "max_body_bytes",
        "max_header_bytes",
        "max_concurrent_requests",
        "max_concurrent_per_caller",
    ):
        if getattr(args, name) < 0:
            raise SystemExit(f"keyroute {args.command}: --{name.replace('_', '-')} must not be negative")
    if not args.body_timeout_s >= 0:
        raise SystemExit(f"keyroute {args.command}: --body-timeout-s must not be negative")
    if args.jwt_jwks_url:
        try:
            check_jwks_url(args.jwt_jwks_url, args.jwt_jwks_allow_http)
        except AuthnError as exc:
            raise SystemExit(f"keyroute {args.command}: {exc}") from None
    return {
        "max_batch_keys": max(1, args.max_batch_keys),
        "limits": RequestLimits(
            max_key_bytes=args.max_key_bytes,
            max_body_bytes=args.max_body_bytes,
            max_header_bytes=args.max_header_bytes,
            max_concurrent_requests=args.max_concurrent_requests,
            max_concurrent_per_caller=args.max_concurrent_per_caller,
            body_timeout_s=args.body_timeout_s,
        ),
        "access": AccessSettings(
            cluster_secret=args.cluster_secret or "",
            admin_token=args.admin_token or "",
            metrics_require_token=args.metrics_require_token,
            metrics_open=args.metrics_open,
            **{name: getattr(args, name) or "" for name in _ACCESS_OPTIONS},
            jwt_jwks_refresh_s=args.jwt_jwks_refresh_s,
            jwt_jwks_allow_http=args.jwt_jwks_allow_http,
        ),
    }


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    p = _Parser(env)
    parser = _ArgumentParser(
        prog="keyroute",
        description=(
            "One-hop HTTP reads of partitioned state, split exactly as a Kafka producer splits a keyed topic."
        ),
    )
    p.option(parser, "--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    p.option(
        parser,
        "--log-format",
        default="text",
        choices=FORMATS,
        help="text (for a terminal) or json (one JSON object per line, for log collectors)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    zk = sub.add_parser("zookeeper", help="run a real ZooKeeper server in the foreground (needs only Java)")
    p.option(zk, "--port", type=int, default=2181, help="client port")
    p.option(zk, "--host", default="127.0.0.1", help="address to listen on")
    p.option(zk, "--data-dir", type=Path, required=True, help="where ZooKeeper keeps its data")
    p.option(zk, "--secure-port", type=int, help="TLS client port (needs --tls-cert and --tls-key)")
    p.option(zk, "--tls-cert", type=_optional_path, metavar="PEM", help="the server's certificate (chain)")
    p.option(zk, "--tls-key", type=_optional_path, metavar="PEM", help="the key of --tls-cert")
    p.option(
        zk,
        "--tls-client-ca",
        type=_optional_path,
        metavar="PEM",
        help="require client certificates on the TLS port, chaining to this CA; a client is then known by its "
        "certificate's subject DN (x509 ACLs)",
    )
    p.flag(zk, "--tls-only", help="serve the TLS port alone: no plaintext client port")

    pipe = sub.add_parser("pipeline", help="compute stores with Spark and publish new versions")
    pipe_sub = pipe.add_subparsers(dest="pipeline_command", required=True, metavar="ACTION")
    build = pipe_sub.add_parser("build", help="compute every store in the spec, write and publish a new version")
    p.option(build, "--spec", type=Path, required=True, help="store spec (TOML)")
    _zk_options(p, build, writes=True)
    p.option(build, "--output", required=True, help="snapshot root (path or file:// URI shared with the nodes)")
    p.option(build, "--master", help="Spark master (default: local[*])")
    p.option(
        build,
        "--spark-secret-file",
        type=_optional_path,
        metavar="FILE",
        help="shared secret: Spark's RPC authenticated and encrypted, shuffle files encrypted (on Kubernetes "
        "the same file must be mounted in the executors)",
    )
    p.option(
        build,
        "--retain",
        type=int,
        default=DEFAULT_RETAIN,
        help="versions of each store kept for a rollback, the new one included; older snapshots are removed",
    )

    _secrets_dir_option(p, build)

    node = sub.add_parser("node", help="run a state node")
    _zk_options(p, node, writes=True)
    _secrets_dir_option(p, node)
    p.option(node, "--node-id", required=True, help="unique, stable node id (e.g. the pod name)")
    p.option(node, "--port", type=int, required=True, help="HTTP port")
    _admin_port_option(p, node)
    _tls_options(p, node, router=False)
    p.option(node, "--host", default="127.0.0.1", help="address to listen on")
    p.option(node, "--advertise-url", default="", help="URL other members use to reach this node")
    p.option(node, "--data-dir", type=Path, required=True, help="where the node keeps its loaded partitions")
    p.option(
        node,
        "--zone",
        default="",
        help="failure domain this node runs in (availability zone, rack): a partition's replicas go to different "
        "zones when there are enough (in Kubernetes: the Node's topology.kubernetes.io/zone label, see --zone-file)",
    )
    p.option(
        node,
        "--zone-file",
        type=Path,
        help="when --zone is empty, read the zone from this file at start (in Kubernetes: written by the init "
        "container `keyroute zone-from-node`); an empty file gives no zone",
    )
    p.flag(
        node,
        "--require-zone",
        help="refuse to start without a zone (from --zone or --zone-file): replicas would spread over nodes only",
    )
    # The node's waits and timeouts, as --help lists them: (flag, type, default, help).
    for flag, kind, default, text in (
        ("--zk-session-timeout-s", float, 10.0, "ZooKeeper session timeout"),
        (
            "--drain-timeout-s",
            float,
            60.0,
            "on SIGTERM, how long to wait for other nodes to serve this node's partitions",
        ),
        (
            "--restart-grace-s",
            _non_negative_float,
            120.0,
            "on SIGTERM, how long this node's partitions stay assigned to it while it restarts (0: hand them over; "
            "`keyroute node-drain` makes the next stop a departure)",
        ),
        (
            "--version-grace-s",
            float,
            300.0,
            "how long a replaced version's files stay on disk (a rollback meanwhile reuses them)",
        ),
        ("--forward-timeout-s", float, 5.0, "timeout for one request to another node"),
        (
            "--min-offset-wait-ms",
            float,
            500.0,
            "how long a read with min_offset waits for a live partition to apply it (then 503 not_up_to_bound)",
        ),
    ):
        p.option(node, flag, type=kind, default=default, help=text)
    p.option(
        node,
        "--live-batch-records",
        type=int,
        default=2000,
        help="records a live store's consumer takes per call; each partition's share goes in one LMDB transaction",
    )
    p.option(
        node,
        "--live-sync-ms",
        type=_non_negative_float,
        default=1000.0,
        help="how often a live partition's commits are flushed to disk (0: after every commit); a process crash "
        "loses nothing either way",
    )
    _serving_options(p, node)
    p.option(
        node,
        "--quota-file",
        default="",
        help="TOML file of read quotas per identity and store (reads/s, split among the nodes serving the store) "
        "for reads made straight to this node (direct mode), re-read when it changes; needs --cluster-secret or "
        "--member-ca; none: no quotas",
    )

    router = sub.add_parser("router", help="run a router")
    _zk_options(p, router, writes=False)
    p.option(router, "--port", type=int, required=True, help="HTTP port")
    _admin_port_option(p, router)
    _tls_options(p, router, router=True)
    p.option(router, "--host", default="127.0.0.1", help="address to listen on")
    p.option(
        router,
        "--router-id",
        default="",
        help="this router's id, which its member certificate names (keyroute-router.ID.DOMAIN); default: the host "
        "name (on Kubernetes, the pod name)",
    )
    p.option(router, "--upstream-timeout-s", type=float, default=5.0, help="timeout for one request to a node")
    p.option(router, "--zk-session-timeout-s", type=float, default=10.0, help="ZooKeeper session timeout")
    p.option(router, "--upstream-connect-timeout-s", type=float, default=1.0, help="timeout for connecting to a node")
    _serving_options(p, router)
    p.option(
        router,
        "--hedge-after-ms",
        type=_hedge_after_ms,
        default="auto",
        help="send a single-key read not answered within this many ms to a second replica too; "
        "auto: the p95 of recent node latencies (2 ms to 1 s); 0: never",
    )
    p.option(
        router,
        "--retry-budget-percent",
        type=_percent,
        default=10.0,
        help="hedges allowed as a percentage of reads (plus a burst of 10); failovers after errors always go",
    )
    p.option(
        router,
        "--stall-after-ms",
        type=_non_negative_float,
        default=DEFAULT_STALL_AFTER_MS,
        help="a read none of whose requests has replied within this many ms goes to the next replica, "
        "whatever the retry budget (a frozen node); 0: never",
    )
    p.option(
        router,
        "--workers",
        type=_positive_int,
        default=1,
        help="router processes sharing the port, each with its own map watcher (about one per spare core)",
    )
    p.option(
        router,
        "--quota-file",
        default="",
        help="TOML file of read quotas per identity and store (reads/s, split among the routers up), "
        "re-read when it changes; none: no quotas",
    )

    store = sub.add_parser("store", help="list published stores, roll a store back to a retained version, delete one")
    store_sub = store.add_subparsers(dest="store_command", required=True, metavar="ACTION")
    listing = store_sub.add_parser("list", help="print each store's current and retained versions (JSON lines)")
    _zk_options(p, listing, writes=False)
    roll = store_sub.add_parser("rollback", help="make a retained version of a store current again")
    _zk_options(p, roll, writes=True)
    p.option(roll, "--store", required=True, help="store name")
    p.option(roll, "--version", type=int, required=True, help="a retained version (see `keyroute store list`)")
    p.flag(roll, "--no-verify", help="do not check the version's snapshot manifest from this machine")
    delete = store_sub.add_parser(
        "delete", help="delete a store: its record goes and a tombstone tells every node to drop its files"
    )
    _zk_options(p, delete, writes=True)
    p.option(delete, "--store", required=True, help="store name")
    _adopt_parser(p, store_sub)
    drain = sub.add_parser(
        "node-drain",
        help="make a node's next stop a departure (scale-down, decommission): its partitions are handed over "
        "rather than held for its restart",
    )
    _zk_options(p, drain, writes=True)
    p.option(drain, "--node-id", required=True, help="the node to drain")
    cluster = sub.add_parser("cluster", help="the cluster's identity and security policy in ZooKeeper")
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True, metavar="ACTION")
    _zk_options(p, cluster_sub.add_parser("id", help="print the cluster id of a chroot (JSON)"), writes=False)
    _policy_parser(p, cluster_sub)

    zkb = sub.add_parser("zk", help="back up and restore keyroute's records in ZooKeeper")
    zkb_sub = zkb.add_subparsers(dest="zk_command", required=True, metavar="ACTION")
    zk_dump = zkb_sub.add_parser(
        "dump", help="write the chroot's persistent records (not nodes' ephemeral ones) to one JSON file"
    )
    _zk_options(p, zk_dump, writes=False)
    p.option(zk_dump, "--out", required=True, help="file to write the dump to (- for standard output)")
    zk_restore = zkb_sub.add_parser(
        "restore", help="write a dump into a chroot without a cluster id (a new or wiped ZooKeeper)"
    )
    _zk_options(p, zk_restore, writes=True)
    p.option(zk_restore, "--in", dest="in_file", required=True, help="a file `keyroute zk dump` wrote")
    p.flag(zk_restore, "--force", help="also write over a chroot that holds the dump's own cluster id")
    zk_lock = zkb_sub.add_parser(
        "lock-root",
        help="let only the writer identity create at ZooKeeper's root (everyone may still read it): on an "
        "ensemble keyroute does not share with other applications",
    )
    _zk_options(p, zk_lock, writes=True)

    zone = sub.add_parser(
        "zone-from-node",
        help="write the zone label of the Kubernetes Node this pod runs on to a file (an init container's job)",
    )
    p.option(
        zone, "--output", type=Path, required=True, help="file to write the zone to (empty when the Node has none)"
    )
    p.option(zone, "--node-name", default="", help="the Kubernetes Node's name (downward API: spec.nodeName)")
    p.option(
        zone,
        "--api-url",
        default=in_cluster_api_url(env),
        help="the Kubernetes API server (default: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT)",
    )
    p.option(
        zone,
        "--service-account-dir",
        type=Path,
        default=SERVICE_ACCOUNT_DIR,
        help="where the pod's service-account token (token) and the cluster's CA (ca.crt) are mounted",
    )
    p.option(zone, "--timeout-s", type=_positive_float, default=10.0, help="timeout for the request to the API server")

    demo = sub.add_parser("demo", help="run everything on this machine with generated sample data")
    p.option(demo, "--port", type=int, default=8080, help="router port")
    p.option(demo, "--workdir", type=Path, default=Path(".keyroute-demo"), help="where the demo keeps its files")
    p.option(demo, "--events", type=int, default=120_000, help="sample events per store")
    demo.add_argument(
        "action", nargs="?", choices=["kill-node"], help="kill-node N: SIGKILL the running demo's node-N (a crash)"
    )
    demo.add_argument("node", nargs="?", type=int, metavar="N", help="the node to kill (0, 1, 2)")

    registry = sub.add_parser(
        "schema-registry",
        help="run a development Schema Registry (the REST API subset confluent-kafka's clients use; not for "
        "production)",
    )
    p.option(registry, "--port", type=_port, default=8081, help="port to listen on")
    p.option(registry, "--host", default="127.0.0.1", help="address to listen on")
    p.option(registry, "--data", type=Path, help="a JSON file the registry keeps its schemas in (default: memory)")

    part = sub.add_parser("partition", help="print the partition of each key (arguments or stdin lines)")
    p.option(part, "--partitions", type=int, required=True, help="number of partitions of the topic/store")
    p.option(part, "--partitioner", default="murmur2", help="murmur2 | crc32 | fnv1a")
    p.option(
        part,
        "--key-format",
        default="string",
        help="string | int16 | int32 | int64 | uuid | bytes | avro | protobuf | json_schema",
    )
    p.option(part, "--key-schema-id", type=int, help="Schema Registry keys: the id the producer's serializer writes")
    p.option(part, "--key-schema", type=Path, help="Schema Registry keys: a file holding the key schema's text")
    p.option(part, "--schema-registry", help="Schema Registry keys: the registry URL to read the key schema from")
    p.option(part, "--key-subject", help="Schema Registry keys: the subject whose latest schema keys are written in")
    p.option(part, "--key-message", default="", help="Protobuf keys: the key message's full name (default: the first)")
    part.add_argument("keys", nargs="*", metavar="KEY", help="keys; when none are given, one per stdin line")
    # The logging options are taken after the command too (`keyroute node --log-level DEBUG ...`).
    for leaf in (zk, build, node, router, listing, roll, zone, demo, registry, part, zk_dump, zk_restore):
        leaf.add_argument("--log-level", default=argparse.SUPPRESS, help="as before the command")
        leaf.add_argument("--log-format", default=argparse.SUPPRESS, choices=FORMATS, help="as before the command")
    return parser


def _names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected one or more store names separated by commas")
    return names


def _adopt_parser(p: _Parser, store_sub: Any) -> None:
    adopt = store_sub.add_parser(
        "adopt",
        help="publish again the complete versions an output location holds, into an empty or rebuilt ZooKeeper",
    )
    _zk_options(p, adopt, writes=True)
    p.option(adopt, "--output", required=True, help="the pipeline's --output: a directory or filesystem URI")
    p.option(
        adopt,
        "--store",
        type=_names,
        metavar="S[,S...]",
        help="adopt only these stores (default: every store found under --output)",
    )
    p.option(
        adopt,
        "--retain",
        type=_positive_int,
        default=DEFAULT_RETAIN,
        help="versions of each store to publish, the newest current and the others retained for a rollback",
    )
    p.option(
        adopt,
        "--replication-factor",
        type=_positive_int,
        default=1,
        help="replicas per partition of a store that has no record (the spec's value; manifests do not hold it)",
    )
    ids = adopt.add_mutually_exclusive_group()
    p.option(
        ids,  # type: ignore[arg-type]
        "--cluster-id",
        help="when the chroot has no cluster id: restore this one (node.json of the nodes' data directories) so "
        "that those nodes may rejoin",
    )
    p.flag(
        ids,  # type: ignore[arg-type]
        "--new-cluster-id",
        help="when the chroot has no cluster id: create a new one (nodes that joined the old cluster then refuse "
        "to start)",
    )


def _policy_parser(p: _Parser, cluster_sub: Any) -> None:
    policy = cluster_sub.add_parser(
        "policy", help="what every router and node must have configured to serve (docs/security.md#cluster-policy)"
    )
    policy_sub = policy.add_subparsers(dest="policy_command", required=True, metavar="ACTION")
    given = policy_sub.add_parser(
        "set", help="write the cluster policy (the whole of it: a requirement not given is dropped); prints it (JSON)"
    )
    _zk_options(p, given, writes=True)
    p.flag(given, "--require-access-control", help="every member must check callers (--access-tokens or --jwt-issuer)")
    p.option(
        given,
        "--member-auth",
        default="none",
        metavar="none|secret|mtls",
        help="how members must prove themselves to each other: the cluster secret (or mutual TLS), or mutual TLS",
    )
    p.option(
        given,
        "--require-tls",
        default="",
        metavar="WIRE[,WIRE...]",
        help="wires every member must encrypt: client (HTTPS to callers), member (--member-ca), zookeeper",
    )
    _zk_options(p, policy_sub.add_parser("show", help="print the cluster policy (JSON)"), writes=False)


def _stdin_keys() -> Iterable[str]:
    data = sys.stdin.buffer.read()
    if not data:
        return []
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # the final terminator ends the last key, it does not start an empty one
    keys = []
    for line in lines:
        if line.endswith(b"\r"):
            line = line[:-1]
        keys.append(line.decode("utf-8", "surrogateescape"))
    return keys


def _partition_key_schema(args: argparse.Namespace, key_format: KeyFormat) -> KeySchema | None:
    """The key schema `keyroute partition` serializes keys with: from --key-schema-id and --key-schema, or read
    from --schema-registry (by --key-subject or --key-schema-id). Raises ValueError, saying what is missing."""
    given = [flag for flag, value in _key_schema_flags(args) if value]
    if not key_format.registered:
        if given:
            raise ValueError(f"{given[0]} applies to --key-format avro, protobuf or json_schema")
        return None
    if args.schema_registry:
        if args.key_schema is not None or (args.key_subject is None) == (args.key_schema_id is None):
            raise ValueError("with --schema-registry give --key-subject or --key-schema-id (one of them)")
        registry = RegistrySettings.parse({"url": args.schema_registry}, "--schema-registry")
        return fetch_key_schema(key_format, registry, args.key_subject, args.key_schema_id, args.key_message)
    if args.key_schema is None or args.key_schema_id is None or args.key_subject is not None:
        raise ValueError(
            f"{key_format.value} keys need --key-schema-id N --key-schema FILE, or --schema-registry URL with "
            "--key-subject S (or --key-schema-id N)"
        )
    schema = KeySchema(key_format, args.key_schema_id, args.key_schema.read_text("utf-8").strip(), args.key_message)
    try:
        check_key_schema(schema)
    except ValueError as exc:
        raise ValueError(f"--key-schema {str(args.key_schema)!r}: {exc}") from None
    return schema


def _key_schema_flags(args: argparse.Namespace) -> list[tuple[str, object]]:
    return [
        ("--key-schema-id", args.key_schema_id is not None),
        ("--key-schema", args.key_schema),
        ("--schema-registry", args.schema_registry),
        ("--key-subject", args.key_subject),
        ("--key-message", args.key_message),
    ]


def cmd_partition(args: argparse.Namespace) -> int:
    try:
        partitioner = Partitioner.parse(args.partitioner)
        key_format = KeyFormat.parse(args.key_format)
    except ValueError as exc:
        print(f"keyroute partition: {exc}", file=sys.stderr)
        return 2
    if not 1 <= args.partitions <= MAX_PARTITIONS:
        print(
            f"keyroute partition: --partitions must be from 1 to {MAX_PARTITIONS} (a Kafka topic's partition "
            f"count is a 32-bit integer), got {args.partitions}",
            file=sys.stderr,
        )
        return 2
    try:
        key_schema = _partition_key_schema(args, key_format)
    except (KeySchemaLookupError, OSError, ValueError) as exc:
        print(f"keyroute partition: {exc}", file=sys.stderr)
        return 1
    keys = args.keys if args.keys else _stdin_keys()
    failed = 0
    out = sys.stdout
    for text in keys:
        try:
            key = parse_key(key_format, text, key_schema)
        except KeyFormatError as exc:
            failed += 1
            shown = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
            error = {"key": shown, "error": "bad_key", "message": str(exc)}
            out.write(json.dumps(error, ensure_ascii=False) + "\n")
            continue
        record = {
            "key": key.text,
            "partition": partition_for(partitioner, key.data, args.partitions),
            "hash": key_hash(partitioner, key.data),
        }
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
    out.flush()
    return 1 if failed else 0


def cmd_zookeeper(args: argparse.Namespace) -> int:
    from keyroute.dev.zookeeper_server import ServerTls, ZooKeeperLaunchError, check_port_free, command

    tls = None
    if args.secure_port is not None:
        if args.tls_cert is None or args.tls_key is None:
            print("keyroute zookeeper: --secure-port needs --tls-cert and --tls-key", file=sys.stderr)
            return 1
        tls = ServerTls(args.secure_port, args.tls_cert, args.tls_key, args.tls_client_ca, not args.tls_only)
    elif args.tls_only or args.tls_cert or args.tls_key or args.tls_client_ca:
        print("keyroute zookeeper: the TLS options need --secure-port (KEYROUTE_SECURE_PORT)", file=sys.stderr)
        return 1
    try:
        for port in [args.port] if tls is None or tls.plaintext else []:
            check_port_free(args.host, port)
        if tls is not None:
            check_port_free(args.host, tls.port)
        argv = command(args.data_dir.resolve(), args.port, args.host, tls=tls)
    except ZooKeeperLaunchError as exc:
        print(f"keyroute zookeeper: {exc}", file=sys.stderr)
        return 1
    sys.stdout.flush()
    os.execv(argv[0], argv)  # the JVM takes over this process: signals reach ZooKeeper directly
    return 0  # pragma: no cover


def cmd_schema_registry(args: argparse.Namespace) -> int:
    from keyroute.dev.schema_registry_dev import Registry, serve

    try:
        with socket.create_server((args.host, args.port)):
            pass
    except OSError as exc:
        print(f"keyroute schema-registry: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 1
    try:
        Registry(args.data)  # a data file that does not load is a usage error, not a traceback
    except ValueError as exc:
        print(f"keyroute schema-registry: {exc}", file=sys.stderr)
        return 1
    serve(args.host, args.port, args.data)
    return 0


def _zk(args: argparse.Namespace) -> ZkSettings:
    timeout = getattr(args, "zk_session_timeout_s", 10.0)
    auth, reader = getattr(args, "zk_auth", None), getattr(args, "zk_reader", None)
    tls = ZkTls(args.zk_tls_ca, args.zk_tls_cert, args.zk_tls_key) if args.zk_tls_ca is not None else None
    reader_dn = getattr(args, "zk_reader_dn", "").strip()
    return ZkSettings.parse(args.zk, session_timeout_s=timeout, auth=auth, reader=reader, tls=tls, reader_dn=reader_dn)


def _unusable_zk_tls_files(args: argparse.Namespace) -> str | None:
    """Why the ZooKeeper TLS files cannot be used, or None: said at once, even by a router (which would
    otherwise start and retry ZooKeeper, as it does while ZooKeeper is away)."""
    if getattr(args, "zk_tls_ca", None) is None:
        return None
    from keyroute.cluster.zk_tls import ZkTlsError, check_files

    try:
        check_files(ZkTls(args.zk_tls_ca, args.zk_tls_cert, args.zk_tls_key))
    except ZkTlsError as exc:
        return str(exc)
    return None


def _check_zk_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors among the ZooKeeper options, named with their variables."""
    if not hasattr(args, "zk"):
        return
    cert, key = args.zk_tls_cert, args.zk_tls_key
    if (cert is not None or key is not None) and args.zk_tls_ca is None:
        parser.error("--zk-tls-cert and --zk-tls-key (KEYROUTE_ZK_TLS_*) need --zk-tls-ca (KEYROUTE_ZK_TLS_CA)")
    if (cert is None) != (key is None):
        parser.error("--zk-tls-cert (KEYROUTE_ZK_TLS_CERT) and --zk-tls-key (KEYROUTE_ZK_TLS_KEY) go together")
    readers = getattr(args, "zk_reader", None) is not None or getattr(args, "zk_reader_dn", "").strip()
    if readers and args.zk_auth is None and cert is None:
        parser.error(
            "--zk-reader and --zk-reader-dn (KEYROUTE_ZK_READER*) need an identity granted ALL: --zk-auth "
            "(KEYROUTE_ZK_AUTH) or a client certificate (--zk-tls-cert)"
        )


def _without_pipeline_extra(what: str) -> bool:
    """True (said on stderr) when pyspark is missing: the serving image has no Spark and no JRE."""
    try:
        import pyspark  # noqa: F401 (the pipeline imports it next anyway)
    except ImportError:
        pass
    else:
        return False
    print(f"{what} needs pyspark, which is not installed: pip install 'keyroute[pipeline]'", file=sys.stderr)
    return True


def _secrets_dir_option(p: Any, parser: argparse.ArgumentParser) -> None:
    p.option(
        parser,
        "--secrets-dir",
        type=_optional_path,
        metavar="DIR",
        help="a folder of secrets, one file per name (a mounted Kubernetes Secret): where a live store's "
        '"${NAME}" that is not an environment variable is read from',
    )


def _environ_with_secrets_dir(args: argparse.Namespace) -> dict[str, str]:
    """The environment `${NAME}` references are resolved from, with the --secrets-dir folder in it."""
    environ = dict(os.environ)
    if args.secrets_dir is not None:
        environ[SECRETS_DIR_VARIABLE] = str(args.secrets_dir)
    return environ


def cmd_pipeline(args: argparse.Namespace) -> int:
    if _without_pipeline_extra("keyroute pipeline build"):
        return 1
    from keyroute.pipeline.build import KafkaAccess, build
    from keyroute.pipeline.errors import PipelineError
    from keyroute.pipeline.publish import retaining

    if args.retain < 1:
        print("keyroute pipeline build: --retain must be at least 1", file=sys.stderr)
        return 2
    try:
        with retaining(args.retain):
            # Live stores' Kafka settings may name environment variables (secrets): resolved here, at the edge.
            kafka = KafkaAccess(_environ_with_secrets_dir(args))
            secret = args.spark_secret_file
            published = build(args.spec, _zk(args), args.output, args.master, kafka=kafka, spark_secret_file=secret)
    except PipelineError as exc:
        print(f"keyroute pipeline build: {exc}", file=sys.stderr)
        return 1
    for version in published:
        print(json.dumps(version.describe()))
    return 0


def cmd_store(args: argparse.Namespace) -> int:
    if args.store_command == "adopt":  # an operator's tool on the serving image: nothing of the pipeline's
        return cmd_adopt(args)
    from keyroute.cluster.zk import ZkUnavailableError, close, connect
    from keyroute.pipeline.errors import PipelineError
    from keyroute.pipeline.publish import delete_store, describe_store, list_stores, rollback

    what = f"keyroute store {args.store_command}"
    try:
        # Listing only reads: it creates nothing, so a read-only identity may list.
        client = connect(_zk(args), ensure_layout=args.store_command != "list")
    except ZkUnavailableError as exc:
        print(f"{what}: {exc}", file=sys.stderr)
        return 1
    try:
        if args.store_command == "list":
            records = list_stores(client)
            for record in records:
                print(json.dumps(describe_store(record), ensure_ascii=False))
            if not records:
                return _nothing_published(what, client, _zk(args))
            return 0
        if args.store_command == "delete":
            print(json.dumps(delete_store(client, args.store), ensure_ascii=False))
            return 0
        before = next((r for r in list_stores(client) if r.name == args.store), None)
        if before is not None and before.version == args.version:
            print(
                f"{what}: version {args.version} is already current for store {args.store!r}; nothing was changed",
                file=sys.stderr,
            )
            return 1
        record = rollback(client, args.store, args.version, verify=not args.no_verify)
    except PipelineError as exc:
        print(f"{what}: {exc}", file=sys.stderr)
        return 1
    finally:
        close(client)
    line = describe_store(record)
    line["previous_version"] = before.version if before is not None else None
    print(json.dumps(line, ensure_ascii=False))
    return 0


def _nothing_published(what: str, client: Any, zk: ZkSettings) -> int:
    """No store to list: 1 with one line when the chroot holds no cluster at all (likely a mistyped --zk),
    0 with a note when a cluster is there and has published nothing yet."""
    from keyroute.cluster import zk_layout
    from keyroute.cluster.cluster_identity import chroots_with_a_cluster, empty_chroot_message

    nodes = client.get_children(zk_layout.NODES) if client.exists(zk_layout.NODES) else []
    if client.exists(zk_layout.CLUSTER) is None and not nodes:
        print(f"{what}: {empty_chroot_message(zk, chroots_with_a_cluster(zk))}", file=sys.stderr)
        return 1
    print(f"{what}: no store is published at {zk.connect_string} yet", file=sys.stderr)
    return 0


def cmd_adopt(args: argparse.Namespace) -> int:
    from keyroute.cli.adopt import AdoptError, adopt
    from keyroute.cluster.cluster_identity import ClusterIdError, create_cluster_id, read_cluster_id
    from keyroute.cluster.zk import ZkUnavailableError, close, connect

    what = "keyroute store adopt"
    try:
        client = connect(_zk(args))
    except ZkUnavailableError as exc:
        print(f"{what}: {exc}", file=sys.stderr)
        return 1
    try:
        chroot = _zk(args).chroot or "/"
        found = read_cluster_id(client)
        if found is None and args.cluster_id is None and not args.new_cluster_id:
            print(
                f"{what}: chroot {chroot} has no cluster id: pass --cluster-id ID (the cluster_id in the nodes' "
                "node.json) to let those nodes rejoin, or --new-cluster-id for a new cluster",
                file=sys.stderr,
            )
            return 1
        if found is not None and (args.new_cluster_id or args.cluster_id not in (None, found.id)):
            print(f"{what}: chroot {chroot} already has cluster id {found.id}; nothing was changed", file=sys.stderr)
            return 1
        if found is None:
            created, _ = create_cluster_id(client, args.cluster_id)
            print(f"{what}: chroot {chroot} now has cluster id {created.id}", file=sys.stderr)
        results = adopt(
            client,
            args.output,
            args.store,
            retain=args.retain,
            replication_factor=args.replication_factor,
        )
    except (AdoptError, ClusterIdError) as exc:
        print(f"{what}: {exc}", file=sys.stderr)
        return 1
    finally:
        close(client)
    for result in results:
        for skipped in result.skipped:
            print(f"{what}: store {result.store!r}: skipped {skipped}", file=sys.stderr)
        print(json.dumps(result.describe(), ensure_ascii=False))
    return 1 if any(result.action == "skipped" for result in results) else 0


def cmd_cluster(args: argparse.Namespace) -> int:
    if args.cluster_command == "policy":
        return cmd_cluster_policy(args)
    from keyroute.cluster.cluster_identity import ClusterIdError, read_cluster_id
    from keyroute.cluster.zk import ZkUnavailableError, close, connect

    zk_settings = _zk(args)
    try:
        client = connect(zk_settings, ensure_layout=False)
    except ZkUnavailableError as exc:
        print(f"keyroute cluster id: {exc}", file=sys.stderr)
        return 1
    try:
        found = read_cluster_id(client)
    except ClusterIdError as exc:
        print(f"keyroute cluster id: {exc}", file=sys.stderr)
        return 1
    finally:
        close(client)
    if found is None:
        print(f"keyroute cluster id: chroot {zk_settings.chroot or '/'} has no cluster id", file=sys.stderr)
        return 1
    print(json.dumps({"cluster_id": found.id, "created_at": found.created_at}))


def cmd_cluster_policy(args: argparse.Namespace) -> int:
    from kazoo.exceptions import NoAuthError

    from keyroute.cluster.cluster_policy import ClusterPolicy, PolicyError, read_policy, write_policy
    from keyroute.cluster.zk import ZkUnavailableError, close, connect

    what = f"keyroute cluster policy {args.policy_command}"
    zk_settings = _zk(args)
    where = zk_settings.chroot or "/"
    wanted = None
    if args.policy_command == "set":  # the options are checked before ZooKeeper is touched
        try:
            wanted = ClusterPolicy.of_options(args.require_access_control, args.member_auth, args.require_tls)
        except PolicyError as exc:
            print(f"{what}: {exc}", file=sys.stderr)
            return 1
    try:
        client = connect(zk_settings, ensure_layout=wanted is not None)
    except ZkUnavailableError as exc:
        print(f"{what}: {exc}", file=sys.stderr)
        return 1
    try:
        if wanted is None and zk_settings.chroot and client.exists("/") is None:
            print(f"{what}: chroot {where} does not exist on ZooKeeper {zk_settings.hosts}", file=sys.stderr)
            return 1
        try:
            found = read_policy(client)
        except PolicyError as exc:
            if wanted is None:
                print(f"{what}: {exc}", file=sys.stderr)
                return 1
            found = None  # setting the policy again is how a broken record is mended
        if wanted is not None:
            write_policy(client, wanted)
    except NoAuthError:
        verb = "change" if wanted is not None else "read"
        print(f"{what}: this ZooKeeper identity may not {verb} the cluster policy at {where}", file=sys.stderr)
        return 1
    finally:
        close(client)
    if wanted is None:
        shown = found if found is not None else ClusterPolicy()
        print(json.dumps({"chroot": where, "recorded": found is not None, **shown.describe()}))
        return 0
    if not zk_settings.has_identity:
        print(
            f"{what}: warning: without a ZooKeeper identity (--zk-auth, or --zk-tls-cert) the policy is "
            "world-writable: anyone who reaches ZooKeeper can loosen it",
            file=sys.stderr,
        )
    previous = None if found is None else found.describe()
    print(json.dumps({"chroot": where, "recorded": True, **wanted.describe(), "previous": previous}))
    return 0


def cmd_zk(args: argparse.Namespace) -> int:
    from kazoo.exceptions import KazooException
    from kazoo.handlers.threading import KazooTimeoutError

    from keyroute.cli.zk_backup import Dump, ZkBackupError, dump, restore
    from keyroute.cluster.zk import ZkUnavailableError, close, connect
    from keyroute.runtime.logs import describe

    what = f"keyroute zk {args.zk_command}"
    zk_settings = _zk(args)
    if args.zk_command == "lock-root":
        return _lock_root(what, zk_settings)
    where = zk_settings.chroot or "/"
    backup: Dump | None = None
    if args.zk_command == "restore":  # the dump is read and checked before ZooKeeper is touched
        try:
            backup = Dump.parse(Path(args.in_file).read_bytes())
        except OSError as exc:
            print(f"{what}: cannot read {args.in_file}: {exc.strerror or exc}", file=sys.stderr)
            return 1
        except ZkBackupError as exc:
            print(f"{what}: {args.in_file}: {exc}", file=sys.stderr)
            return 1
    try:
        client = connect(zk_settings, ensure_layout=backup is not None)
    except ZkUnavailableError as exc:
        print(f"{what}: {exc}", file=sys.stderr)
        return 1
    try:
        if backup is None:
            if zk_settings.chroot and client.exists("/") is None:
                print(f"{what}: chroot {where} does not exist on ZooKeeper {zk_settings.hosts}", file=sys.stderr)
                return 1
            taken = dump(client, zk_settings.chroot)
        else:
            restored = restore(client, backup, where, force=args.force)
    except ZkBackupError as exc:
        print(f"{what}: {exc}", file=sys.stderr)
        return 1
    except (KazooException, KazooTimeoutError) as exc:  # say, the connection lost midway; or no permission
        print(f"{what}: ZooKeeper at {zk_settings.hosts} refused or failed: {describe(exc)}", file=sys.stderr)
        return 1
    finally:
        close(client)
    if backup is not None:
        summary = {"chroot": where, "cluster_id": backup.cluster_id, **restored.describe()}
        print(json.dumps(summary))
        return 0
    try:
        _write_atomically(args.out, taken.to_bytes())
    except OSError as exc:
        print(f"{what}: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if taken.cluster_id is None:
        print(f"{what}: chroot {where} has no cluster id (dumped all the same)", file=sys.stderr)
    summary = {"chroot": where, "cluster_id": taken.cluster_id, "znodes": len(taken.znodes), "out": args.out}
    print(json.dumps(summary), file=sys.stderr if args.out == "-" else sys.stdout)
    return 0


def _lock_root(what: str, zk_settings: ZkSettings) -> int:
    from kazoo.exceptions import KazooException
    from kazoo.handlers.threading import KazooTimeoutError

    from keyroute.cluster.zk import ZkUnavailableError, lock_root
    from keyroute.runtime.logs import describe

    try:
        acl = lock_root(zk_settings)
    except ZkUnavailableError as exc:
        print(f"{what}: {exc}", file=sys.stderr)
        return 1
    except (KazooException, KazooTimeoutError) as exc:
        print(f"{what}: ZooKeeper at {zk_settings.hosts} refused or failed: {describe(exc)}", file=sys.stderr)
        return 1
    print(json.dumps({"root_acl": acl}))
    return 0


def _write_atomically(out: str, content: bytes) -> None:
    """`content` to file `out` (whole or not at all: written beside it, then renamed), or stdout for "-"."""
    if out == "-":
        sys.stdout.buffer.write(content)
        sys.stdout.flush()
        return
    target = Path(out)
    partial = target.with_name(f".{target.name}.partial")
    try:
        with open(partial, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()


def cmd_node_drain(args: argparse.Namespace) -> int:
    from keyroute.cluster.zk import ZkUnavailableError, close, connect
    from keyroute.state_node.registration import request_drain

    try:
        client = connect(_zk(args), ensure_layout=False)
    except ZkUnavailableError as exc:
        print(f"keyroute node-drain: {exc}", file=sys.stderr)
        return 1
    try:
        at = request_drain(client, args.node_id)
    finally:
        close(client)
    print(json.dumps({"node_id": args.node_id, "drain_requested_at": at}))
    return 0


def cmd_zone_from_node(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # its one INFO line per request says nothing more
    try:
        found = zone_from_node(args.node_name, args.api_url, args.service_account_dir, timeout_s=args.timeout_s)
        write_zone(args.output, found.zone)
    except ZoneError as exc:
        print(f"keyroute zone-from-node: {exc}", file=sys.stderr)
        return 1
    if found.zone:
        _log.info("zone %s (label %s of node %s) written to %s", found.zone, found.label, found.node_name, args.output)
    else:
        _log.warning(
            "node %s has no %s label: %s is empty, this keyroute node will have no zone",
            found.node_name,
            " or ".join(ZONE_LABELS),
            args.output,
        )
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    from keyroute.http.quotas import quota_file_error
    from keyroute.state_node.service import run

    # A live partition resolves its Kafka settings' `${NAME}` references from the process's environment (when
    # it connects): the folder given as a flag goes there, at this edge, once.
    if args.secrets_dir is not None:
        os.environ[SECRETS_DIR_VARIABLE] = str(args.secrets_dir)

    try:
        zone = node_zone(args.zone, args.zone_file, args.require_zone)
    except ZoneError as exc:
        print(f"keyroute node: {exc}", file=sys.stderr)
        return 1
    if not zone:
        _log.warning(
            "this node has no zone (--zone, --zone-file): the controller spreads its partitions' replicas over "
            "nodes only, and a zone's outage may take every replica of a partition"
        )
    settings = NodeSettings(
        node_id=args.node_id,
        data_dir=args.data_dir,
        zk=_zk(args),
        http=_http_settings(args, advertise_url=args.advertise_url),
        zone=zone,
        drain_timeout_s=args.drain_timeout_s,
        restart_grace_s=args.restart_grace_s,
        version_grace_s=args.version_grace_s,
        forward_timeout_s=args.forward_timeout_s,
        min_offset_wait_ms=args.min_offset_wait_ms,
        live_batch_records=args.live_batch_records,
        live_sync_ms=args.live_sync_ms,
        **_limits(args),
        quota_file=args.quota_file,
    )
    if settings.quota_file and (refused := quota_file_error(settings.quota_file)) is not None:
        print(f"keyroute node: {refused}", file=sys.stderr)
        return 1
    return run(settings)


def cmd_router(args: argparse.Namespace) -> int:
    from keyroute.http.quotas import quota_file_error
    from keyroute.router.service import run

    settings = RouterSettings(
        zk=_zk(args),
        http=_http_settings(args),
        upstream_timeout_s=args.upstream_timeout_s,
        upstream_connect_timeout_s=args.upstream_connect_timeout_s,
        **_limits(args),
        hedge_after_ms=args.hedge_after_ms,
        retry_budget_percent=args.retry_budget_percent,
        stall_after_ms=args.stall_after_ms,
        workers=args.workers,
        quota_file=args.quota_file,
        router_id=args.router_id,
    )
    if settings.quota_file and (refused := quota_file_error(settings.quota_file)) is not None:
        print(f"keyroute router: {refused}", file=sys.stderr)
        return 1
    # Worker processes start afresh and set up their logging as this process did.
    return run(
        settings,
        setup=functools.partial(configure_logs, args.log_format, str(args.log_level), fields={"service": "router"}),
    )


def cmd_demo(args: argparse.Namespace) -> int:
    if _without_pipeline_extra("keyroute demo"):
        return 1
    from keyroute.dev.demo import DemoSettings, kill_node, run

    if args.action == "kill-node":
        if args.node is None:
            print("keyroute demo kill-node: which node? e.g. `keyroute demo kill-node 1`", file=sys.stderr)
            return 1
        return kill_node(args.workdir.resolve(), args.node)
    return run(DemoSettings(router_port=args.port, workdir=args.workdir.resolve(), events=args.events))


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "zookeeper": cmd_zookeeper,
    "pipeline": cmd_pipeline,
    "store": cmd_store,
    "node": cmd_node,
    "router": cmd_router,
    "demo": cmd_demo,
    "partition": cmd_partition,
    "schema-registry": cmd_schema_registry,
    "cluster": cmd_cluster,
    "zk": cmd_zk,
    "node-drain": cmd_node_drain,
    "zone-from-node": cmd_zone_from_node,
}


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    parser = build_parser(env)
    args, extras = parser.parse_known_args(argv)
    if extras:
        parser.exit(2, _unrecognized(parser, args, extras) + "\n")
    if (unreadable := _read_secret_files(args)) is not None:
        print(f"keyroute {args.command}: {unreadable}", file=sys.stderr)
        return 1
    _check_zk_options(parser, args)
    if (unusable := _unusable_zk_tls_files(args)) is not None:
        print(f"keyroute {args.command}: {unusable}", file=sys.stderr)
        return 1
    if args.log_format not in FORMATS:  # a value from the environment, which argparse does not check
        parser.error(f"--log-format (KEYROUTE_LOG_FORMAT) must be one of {', '.join(FORMATS)}")
    fields = {"service": args.command}
    if getattr(args, "node_id", None):
        fields["node"] = args.node_id
    configure_logs(args.log_format, str(args.log_level), fields=fields)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`keyroute partition ... | head`): stop quietly, as other tools do. Python would
        # otherwise complain again when it flushes stdout at exit.
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE
