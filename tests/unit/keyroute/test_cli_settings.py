"""Each option declared once: a settings field's option takes its default and help from the field
(keyroute.runtime.settings.option), `--help` shows every option's variable and default, and
docs/configuration.md's tables list every option of every command with the same variable and default, and
no option that does not exist."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from keyroute.cli import DeclaredOption, declared_options, main
from keyroute.runtime import settings
from keyroute.runtime.settings import (
    AccessSettings,
    HttpSettings,
    NodeSettings,
    RequestLimits,
    RouterSettings,
    TlsSettings,
    ZkSettings,
)

DOC = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"
# The variables the kubelet sets, spelled as the table writes --api-url's default.
ENV = {"KUBERNETES_SERVICE_HOST": "$KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT": "$KUBERNETES_SERVICE_PORT"}

ZK = "ZooKeeper options"
SERVING = "Routers and nodes"
STORE = "`keyroute store list`, `keyroute store rollback` and `keyroute store delete`"
ADOPT = "`keyroute store adopt` and `keyroute cluster id`"
POLICY = "`keyroute cluster policy`"
ZK_ADMIN = "`keyroute zk dump`, `keyroute zk restore` and `keyroute zk lock-root`"
# Each command and the sections of docs/configuration.md whose tables list its options, its own first.
SECTIONS = {
    "keyroute": ["Every command"],
    "keyroute zookeeper": ["`keyroute zookeeper`"],
    "keyroute pipeline build": ["`keyroute pipeline build`", ZK],
    "keyroute node": ["`keyroute node`", ZK, SERVING],
    "keyroute router": ["`keyroute router`", ZK, SERVING],
    "keyroute store list": [STORE, ZK],
    "keyroute store rollback": [STORE, ZK],
    "keyroute store delete": [STORE, ZK],
    "keyroute store adopt": [ADOPT, ZK],
    "keyroute cluster id": [ADOPT, ZK],
    "keyroute cluster policy set": [POLICY, ZK],
    "keyroute cluster policy show": [POLICY, ZK],
    "keyroute zk dump": [ZK_ADMIN, ZK],
    "keyroute zk restore": [ZK_ADMIN, ZK],
    "keyroute zk lock-root": [ZK_ADMIN, ZK],
    "keyroute node-drain": ["`keyroute node-drain`", ZK],
    "keyroute zone-from-node": ["`keyroute zone-from-node`"],
    "keyroute demo": ["`keyroute demo`"],
    "keyroute schema-registry": ["`keyroute schema-registry`"],
    "keyroute partition": ["`keyroute partition`"],
}
_ROW = re.compile(r"^\| `(--[a-z0-9-]+)` \| `([A-Z0-9_]+)` \| ([^|]*?) \|", re.MULTILINE)


def documented() -> dict[str, dict[str, tuple[str, str]]]:
    """Each section's option rows: flag -> (variable, default)."""
    tables: dict[str, dict[str, tuple[str, str]]] = {}
    for section in re.split(r"^#{2,4} ", DOC.read_text(encoding="utf-8"), flags=re.MULTILINE)[1:]:
        heading, _, body = section.partition("\n")
        rows = {flag: (env, default.strip()) for flag, env, default in _ROW.findall(body)}
        if rows:
            assert heading not in tables, f"two sections named {heading}"
            tables[heading] = rows
    return tables


def matches(cell: str, option: DeclaredOption) -> bool:
    """Whether a table's default cell says `option`'s default: "—" a required option, "none" or "off" none,
    a number or a `value` exactly that; words describe a default the command works out when it runs."""
    if cell == "—" or option.required:
        return cell == "—" and option.required
    if cell in ("none", "off"):
        return option.default in (None, "", False)
    if re.fullmatch(r"[0-9][0-9.]*", cell):
        return isinstance(option.default, int | float) and not isinstance(option.default, bool) and (
            float(cell) == option.default
        )
    if value := re.fullmatch(r"`([^`]*)`", cell):
        return option.default is not None and str(option.default) == value.group(1)
    return option.default in (None, "")


def by_command() -> dict[str, list[DeclaredOption]]:
    commands: dict[str, list[DeclaredOption]] = {}
    for option in declared_options(ENV):
        commands.setdefault(option.command, []).append(option)
    return commands


def test_every_command_is_given_its_sections() -> None:
    assert set(by_command()) == set(SECTIONS)
    assert {s for sections in SECTIONS.values() for s in sections} == set(documented())


@pytest.mark.parametrize("command", sorted(SECTIONS))
def test_every_option_is_documented_with_its_variable_and_default(command: str) -> None:
    tables = documented()
    for option in by_command()[command]:
        rows = [tables[section][option.flag] for section in SECTIONS[command] if option.flag in tables[section]]
        assert rows, f"{command} {option.flag} is in none of {SECTIONS[command]} in docs/configuration.md"
        env, default = rows[0]
        assert env == option.env, f"{command} {option.flag}"
        assert matches(default, option), f"{command} {option.flag}: the table says {default!r}, not {option.default!r}"


def test_no_option_is_documented_that_no_command_takes() -> None:
    taken: dict[str, set[str]] = {}
    for command, options in by_command().items():
        for section in SECTIONS[command]:
            taken.setdefault(section, set()).update(option.flag for option in options)
    for section, rows in documented().items():
        assert not set(rows) - taken[section], f"docs/configuration.md, {section}"


def test_the_table_checks_catch_a_wrong_default() -> None:
    """The comparison is one that can disagree."""
    option = DeclaredOption("keyroute demo", "--port", "KEYROUTE_PORT", 8080, False, False, False, "")
    assert matches("8080", option) and not matches("8081", option) and not matches("—", option)
    assert not matches("none", option) and not matches("`8081`", option)
    assert matches("none", DeclaredOption("c", "--x", "KEYROUTE_X", None, False, False, False, ""))
    assert not matches("none", DeclaredOption("c", "--x", "KEYROUTE_X", None, True, False, False, ""))


# The settings classes a node's or a router's options fill.
FILLED = {
    "keyroute node": (NodeSettings, HttpSettings, TlsSettings, ZkSettings, RequestLimits, AccessSettings),
    "keyroute router": (RouterSettings, HttpSettings, TlsSettings, ZkSettings, RequestLimits, AccessSettings),
}


def fields_of(command: str) -> Iterator[tuple[str, settings.Option]]:
    for declared in FILLED[command]:
        for name, option in settings.options(declared).items():
            if declared is HttpSettings and name == "advertise_url" and command == "keyroute router":
                continue  # a node's: a router is reached through its Service
            yield f"{declared.__name__}.{name}", option


@pytest.mark.parametrize("command", sorted(FILLED))
def test_a_settings_field_is_its_option_s_only_declaration(command: str) -> None:
    """Every field declared with `option` is an option of the command, with the field's flag, variable, default
    and help; no option of the command repeats one otherwise."""
    options = {option.flag: option for option in by_command()[command]}
    fields = dict(fields_of(command))
    for name, declared in fields.items():
        option = options[declared.flag]
        assert option.field == name, f"{command} {declared.flag} is not made from {name}"
        assert option.env == declared.env
        assert option.default == (None if option.secret else declared.spelled)
        if (command, declared.flag) != ("keyroute node", "--tls-client-ca"):  # says what it is for a node
            assert option.help == declared.help
    assert {o.field for o in options.values() if o.field} == set(fields)


@pytest.mark.parametrize("command", sorted(c for c in SECTIONS if c != "keyroute"))
def test_help_shows_each_option_with_its_variable_and_default(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option
    with pytest.raises(SystemExit) as exited:
        main([*command.split()[1:], "--help"], env=ENV)
    assert exited.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    for option in by_command()[command]:
        said = f"{option.help} [env {option.env}]"
        if option.default is not None and not option.switch and not option.secret:
            said += f" (default: {option.default})"
        assert " ".join(said.split()) in shown, f"{command} {option.flag}"


def test_defaults_the_command_line_repeats_of_modules_it_does_not_load_are_theirs() -> None:
    """The CLI imports the pipeline and the dev tools only when their command runs, so `keyroute --help`
    repeats a few of their defaults: these stay equal."""
    from keyroute.dev.demo import DemoSettings
    from keyroute.pipeline.publish import DEFAULT_RETAIN

    defaults = {(o.command, o.flag): o.default for o in declared_options({})}
    demo = DemoSettings()
    assert defaults["keyroute demo", "--port"] == demo.router_port
    assert defaults["keyroute demo", "--workdir"] == demo.workdir
    assert defaults["keyroute demo", "--events"] == demo.events
    assert defaults["keyroute pipeline build", "--retain"] == DEFAULT_RETAIN
    assert defaults["keyroute store adopt", "--retain"] == DEFAULT_RETAIN


@pytest.mark.parametrize("command", sorted(FILLED))
def test_a_command_given_no_option_runs_with_the_declared_defaults(
    command: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The settings a command builds with no option given hold each field's declared default: every option
    reaches its own field, and its type reads a spelled default (`auto`) back as the field's value."""
    built: list[NodeSettings | RouterSettings] = []
    service = "keyroute.state_node.service" if command == "keyroute node" else "keyroute.router.service"
    monkeypatch.setattr(f"{service}.run", lambda made, **_: built.append(made) or 0)
    argv = [command.split()[1], "--zk", "127.0.0.1:2181", "--port", "8080"]
    if command == "keyroute node":
        argv += ["--node-id", "n1", "--data-dir", str(tmp_path)]
    assert main(argv, env={}) == 0
    (made,) = built
    parts = {
        NodeSettings: made,
        RouterSettings: made,
        HttpSettings: made.http,
        TlsSettings: made.http.tls,
        ZkSettings: made.zk,
        RequestLimits: made.limits,
        AccessSettings: made.access,
    }
    for name, declared in fields_of(command):
        owner, field = name.split(".")
        part = next(part for cls, part in parts.items() if cls.__name__ == owner)
        assert getattr(part, field) == declared.default, f"{command}: {name}"
