"""ZooKeeper credentials: parsing them (settings and CLI), keeping passwords out of sight, and the ACL built
from them (digests checked against ZooKeeper's own formula, base64(sha1("user:password")))."""

from __future__ import annotations

import base64
import datetime
import hashlib
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from kazoo.security import ACL, OPEN_ACL_UNSAFE, Id, Permissions

from keyroute import cli
from keyroute.cli import build_parser, main, zk_settings_of
from keyroute.cluster import zk
from keyroute.cluster.zk import layout_acl, merged_acl
from keyroute.cluster.zk_tls import ZkTlsError, subject_dn
from keyroute.runtime.settings import ZkIdentity, ZkSettings, ZkTls

WRITER = ZkIdentity("writer", "w-pass")
READER = ZkIdentity("reader", "r-pass")
NODE_ARGS = ["node", "--zk", "zk:2181/keyroute", "--node-id", "n1", "--port", "8000", "--data-dir", "/data"]


def digest(user: str, password: str) -> str:
    """ZooKeeper's DigestAuthenticationProvider.generateDigest, written out independently of kazoo."""
    return f"{user}:{base64.b64encode(hashlib.sha1(f'{user}:{password}'.encode()).digest()).decode()}"


@pytest.mark.parametrize(
    ("text", "user", "password"),
    [("alice:secret", "alice", "secret"), ("alice:se:cr:et", "alice", "se:cr:et"), ("a:" + "x" * 64, "a", "x" * 64)],
)
def test_an_identity_is_user_colon_password(text: str, user: str, password: str) -> None:
    identity = ZkIdentity.parse(text)
    assert (identity.user, identity.password) == (user, password)
    assert identity.credential == text


@pytest.mark.parametrize("text", ["alice", ":secret", "alice:", " alice:secret", ""])
def test_a_malformed_identity_is_refused_without_repeating_the_password(text: str) -> None:
    with pytest.raises(ValueError) as caught:
        ZkIdentity.parse(text)
    assert "secret" not in str(caught.value)


def test_passwords_stay_out_of_reprs() -> None:
    settings = ZkSettings(hosts="zk:2181", auth=WRITER, reader=READER)
    assert "w-pass" not in repr(settings) and "r-pass" not in repr(settings) and "w-pass" not in str(WRITER)
    assert "writer" in repr(settings) and "reader" in repr(settings)


def test_a_reader_needs_an_identity_to_authenticate_as() -> None:
    with pytest.raises(ValueError, match="reader"):
        ZkSettings(hosts="zk:2181", reader=READER)


def test_without_credentials_the_acl_is_world_open() -> None:
    assert layout_acl(ZkSettings()) == list(OPEN_ACL_UNSAFE)


def test_the_writer_gets_everything_and_the_reader_only_reads() -> None:
    acl = layout_acl(ZkSettings(auth=WRITER, reader=READER))
    assert [(e.perms, e.id.scheme, e.id.id) for e in acl] == [
        (Permissions.ALL, "digest", digest("writer", "w-pass")),
        (Permissions.READ, "digest", digest("reader", "r-pass")),
    ]
    assert Permissions.READ == 1 and Permissions.ALL == 31  # ZooKeeper's own bits
    assert [e.perms for e in layout_acl(ZkSettings(auth=WRITER))] == [Permissions.ALL]
    assert len(layout_acl(ZkSettings(auth=WRITER, reader=WRITER))) == 1  # one identity, one entry


def test_merging_removes_world_access_and_keeps_other_identities() -> None:
    wanted = layout_acl(ZkSettings(auth=WRITER, reader=READER))
    other = ACL(Permissions.READ, Id("digest", digest("auditor", "a")))
    stale_reader = ACL(Permissions.ALL, Id("digest", digest("reader", "r-pass")))
    current = [*OPEN_ACL_UNSAFE, other, stale_reader]
    assert merged_acl(current, wanted) == [*wanted, other]
    assert merged_acl(wanted, wanted) == wanted


def test_the_cli_reads_identities_from_options_and_environment() -> None:
    env = {"KEYROUTE_ZK_AUTH": "writer:w-pass\n", "KEYROUTE_ZK_READER": "reader:r-pass"}
    settings = zk_settings_of(build_parser(env).parse_args(NODE_ARGS))
    assert (settings.auth, settings.reader) == (WRITER, READER)
    assert (settings.hosts, settings.chroot) == ("zk:2181", "/keyroute")
    given = build_parser(env).parse_args([*NODE_ARGS, "--zk-auth", "other:o-pass"])
    assert zk_settings_of(given).auth == ZkIdentity("other", "o-pass")
    none = zk_settings_of(build_parser({"KEYROUTE_ZK_AUTH": ""}).parse_args(NODE_ARGS))  # an absent optional Secret
    assert (none.auth, none.reader) == (None, None)
    router = build_parser({"KEYROUTE_ZK_AUTH": "reader:r-pass"}).parse_args(
        ["router", "--zk", "zk:2181", "--port", "8080"]
    )
    assert (zk_settings_of(router).auth, zk_settings_of(router).reader) == (READER, None)
    listing = build_parser({"KEYROUTE_ZK_AUTH": "reader:r-pass"}).parse_args(["store", "list", "--zk", "zk:2181"])
    assert zk_settings_of(listing).auth == READER


def test_routers_and_listings_take_no_reader_option(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["router", "--zk", "zk:2181", "--port", "1"], ["store", "list", "--zk", "zk:2181"]):
        with pytest.raises(SystemExit):
            build_parser({}).parse_args([*argv, "--zk-reader", "reader:r-pass"])
    assert "unrecognized arguments" in capsys.readouterr().err


def test_cli_errors_and_help_never_show_a_password(capsys: pytest.CaptureFixture[str]) -> None:
    env = {"KEYROUTE_ZK_AUTH": "writer:w-pass", "KEYROUTE_ZK_READER": "reader:r-pass"}
    with pytest.raises(SystemExit):
        build_parser(env).parse_args(["node", "--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "[env KEYROUTE_ZK_AUTH]" in shown and "[env KEYROUTE_ZK_READER]" in shown
    assert "w-pass" not in shown and "r-pass" not in shown
    with pytest.raises(SystemExit) as exited:
        build_parser({"KEYROUTE_ZK_AUTH": "nopassword-here"}).parse_args(NODE_ARGS)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--zk-auth" in err and "USER:PASSWORD" in err and "nopassword-here" not in err
    with pytest.raises(SystemExit) as exited:
        main([*NODE_ARGS, "--zk-reader", "reader:r-pass"], env={})
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--zk-reader" in err and "--zk-auth" in err and "r-pass" not in err


def test_the_cli_reads_zookeeper_tls_options_from_options_and_environment(tmp_path: Path) -> None:
    env = {"KEYROUTE_ZK_TLS_CA": "/tls/ca.crt", "KEYROUTE_ZK_TLS_CERT": "/tls/tls.crt", "KEYROUTE_ZK_TLS_KEY": ""}
    args = build_parser(env).parse_args([*NODE_ARGS, "--zk-tls-key", "/tls/tls.key", "--zk-reader-dn", "CN=r"])
    settings = zk_settings_of(args)
    assert settings.tls == ZkTls(Path("/tls/ca.crt"), Path("/tls/tls.crt"), Path("/tls/tls.key"))
    assert (settings.reader_dn, settings.auth) == ("CN=r", None)
    assert zk_settings_of(build_parser({}).parse_args(NODE_ARGS)).tls is None
    router = build_parser({"KEYROUTE_ZK_TLS_CA": "/ca.pem"}).parse_args(["router", "--zk", "zk:2181", "--port", "1"])
    assert zk_settings_of(router).tls == ZkTls(Path("/ca.pem"))


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--zk-tls-cert", "c.pem", "--zk-tls-key", "k.pem"], "need --zk-tls-ca"),
        (["--zk-tls-ca", "ca.pem", "--zk-tls-cert", "c.pem"], "go together"),
        (["--zk-tls-ca", "ca.pem", "--zk-reader-dn", "CN=r"], "need an identity granted ALL"),
    ],
)
def test_zookeeper_tls_options_that_do_not_fit_together_are_usage_errors(
    extra: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*NODE_ARGS, *extra], env={})
    assert exited.value.code == 2
    assert said in capsys.readouterr().err


def test_an_x509_writer_gets_everything_and_its_readers_only_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zk, "_subject_dn", lambda cert: f"CN={cert.stem}")
    tls = ZkTls(Path("ca.pem"), Path("writer.pem"), Path("writer.key"))
    acl = layout_acl(ZkSettings(tls=tls, reader_dn="CN=router", reader=READER))
    assert [(e.perms, e.id.scheme, e.id.id) for e in acl] == [
        (Permissions.ALL, "x509", "CN=writer"),
        (Permissions.READ, "digest", digest("reader", "r-pass")),
        (Permissions.READ, "x509", "CN=router"),
    ]
    # A digest identity comes first: the certificate then only encrypts.
    both = layout_acl(ZkSettings(auth=WRITER, tls=tls, reader_dn="CN=writer"))
    assert [(e.perms, e.id.scheme) for e in both] == [(Permissions.ALL, "digest"), (Permissions.READ, "x509")]
    # Its own DN named as the reader adds nothing.
    assert len(layout_acl(ZkSettings(tls=tls, reader_dn="CN=writer"))) == 1
    # A CA alone is no identity: world-open, and no reader may be named.
    assert layout_acl(ZkSettings(tls=ZkTls(Path("ca.pem")))) == list(OPEN_ACL_UNSAFE)
    with pytest.raises(ValueError, match="reader"):
        ZkSettings(tls=ZkTls(Path("ca.pem")), reader_dn="CN=router")


def test_subject_dns_are_written_as_java_writes_them(tmp_path: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.RelativeDistinguishedName([x509.NameAttribute(NameOID.DOMAIN_COMPONENT, "example")]),
            x509.RelativeDistinguishedName([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Acme, Inc.")]),
            x509.RelativeDistinguishedName([x509.NameAttribute(NameOID.EMAIL_ADDRESS, "ops@example.com")]),
            x509.RelativeDistinguishedName([x509.NameAttribute(NameOID.COMMON_NAME, " #node=1+a ")]),
        ]
    )
    now = datetime.datetime.now(datetime.UTC)
    cert = x509.CertificateBuilder(name, name, key.public_key(), x509.random_serial_number(), now, now).sign(
        key, hashes.SHA256()
    )
    path = tmp_path / "c.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    # Most specific first; , = + # escaped anywhere, spaces at either end; e-mail as OID=#DER (IA5String).
    assert subject_dn(path) == (
        "CN=\\ \\#node\\=1\\+a\\ ,1.2.840.113549.1.9.1=#160f6f7073406578616d706c652e636f6d,O=Acme\\, Inc.,DC=example"
    )
    path.write_text("not a certificate")
    with pytest.raises(ZkTlsError, match="not a PEM certificate"):
        subject_dn(path)


@pytest.mark.parametrize("command", [["router", "--port", "1"], ["store", "list"]])
def test_unusable_zookeeper_tls_files_stop_any_command_in_one_line(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran = []
    monkeypatch.setitem(cli.COMMANDS, command[0], lambda args: ran.append(args) or 0)
    missing = tmp_path / "ca.pem"
    assert main([*command, "--zk", "zk:2181", "--zk-tls-ca", str(missing)], env={}) == 1
    assert not ran  # a router would otherwise start and retry ZooKeeper for ever
    err = capsys.readouterr().err
    said = f"keyroute {command[0]}: cannot use the ZooKeeper TLS CA {missing} (--zk-tls-ca): No such file or directory"
    assert err == said + "\n"
