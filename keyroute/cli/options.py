"""The command line's machinery: options that default to their KEYROUTE_* variables, usage errors in one line,
value types, and the options several commands share (ZooKeeper, secrets from files, a secrets folder)."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from keyroute.keys.schema_registry import SECRETS_DIR_VARIABLE
from keyroute.runtime.settings import (
    ZkIdentity,
    ZkSettings,
    ZkTls,
    env_name,
    options,
)

_env_name = env_name


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


@dataclass(frozen=True, slots=True)
class DeclaredOption:
    """An option as a command declares it: what its `--help` shows and docs/configuration.md's tables list."""

    command: str  # "keyroute store adopt"
    flag: str
    env: str
    default: Any  # as the command line takes it (text is converted when parsed); None: none
    required: bool
    switch: bool  # on/off
    secret: bool
    help: str  # without the variable and the default --help adds
    # The settings field it sets ("NodeSettings.drain_timeout_s"), when declared there.
    field: str = ""


class _Parser:
    """argparse with every option defaulting to its KEYROUTE_* environment variable; it keeps what each
    command declares (`declared`)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env
        self.declared: list[DeclaredOption] = []
        self._commands: dict[int, str] = {}  # a group's command
        self._field = ""

    def _command(self, parser: Any) -> str:
        return self._commands.get(id(parser)) or parser.prog

    def exclusive(self, parser: argparse.ArgumentParser) -> Any:
        """A group of `parser`'s options of which one at most may be given."""
        group = parser.add_mutually_exclusive_group()
        self._commands[id(group)] = parser.prog
        return group

    def setting(self, parser: argparse.ArgumentParser, settings: type, name: str, **kwargs: Any) -> None:
        """The option of a settings field declared with keyroute.runtime.settings.option: its flag, default and
        help are the declaration's (a `help` given says what the option is for this command)."""
        declared = options(settings)[name]
        help = kwargs.pop("help", declared.help)
        self._field = f"{settings.__name__}.{name}"
        try:
            if isinstance(declared.default, bool):
                self.flag(parser, declared.flag, help=help)
            else:
                # A secret's absence is None, whatever the field holds then.
                default = None if kwargs.get("secret") else declared.spelled
                self.option(parser, declared.flag, default=default, help=help, **kwargs)
        finally:
            self._field = ""

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
        self.declared.append(
            DeclaredOption(self._command(parser), flag, env_name, default, required, False, secret, help, self._field)
        )

    def flag(self, parser: argparse.ArgumentParser, flag: str, *, help: str = "") -> None:
        """An on/off switch; its variable is true for 1/true/yes/on."""
        env_name = _env_name(flag)
        default = self.env.get(env_name, "").strip().lower() in ("1", "true", "yes", "on")
        parser.add_argument(flag, action="store_true", default=default, help=f"{help} [env {env_name}]")
        self.declared.append(
            DeclaredOption(self._command(parser), flag, env_name, default, False, True, False, help, self._field)
        )


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


def zk_settings_of(args: argparse.Namespace) -> ZkSettings:
    timeout = getattr(args, "zk_session_timeout_s", ZkSettings().session_timeout_s)
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


def quota_file_refused(what: str, quota_file: str | None) -> bool:
    """Whether the quota file a router or node is given cannot be used (then said on stderr): checked before
    the process starts serving."""
    from keyroute.http.quotas import quota_file_error

    if quota_file and (refused := quota_file_error(quota_file)) is not None:
        print(f"{what}: {refused}", file=sys.stderr)
        return True
    return False


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
