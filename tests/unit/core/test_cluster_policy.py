"""The cluster policy (keyroute.cluster.cluster_policy): what a member's settings lack under a policy, the record's
JSON (closed for what it cannot read), the options `keyroute cluster policy set` takes, and the gate that
withholds a member's reads (keyroute.http.policy_gate)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from kazoo.exceptions import ConnectionLoss, NoAuthError, NoNodeError

from keyroute.cluster.cluster_policy import (
    ClusterPolicy,
    MemberSecurity,
    PolicyCheck,
    PolicyError,
    PolicyWatch,
    Requirement,
    UnmetPolicyError,
    unmet,
)
from keyroute.cluster.zk import ZkUnavailableError
from keyroute.http.admission import Admission
from keyroute.http.policy_gate import PolicyGate
from keyroute.runtime.settings import (
    AccessSettings,
    HttpSettings,
    NodeSettings,
    RouterSettings,
    TlsSettings,
    ZkSettings,
    ZkTls,
)

EVERYTHING = ClusterPolicy(True, "mtls", frozenset({"client", "member", "zookeeper"}))
MEMBER = frozenset({"member"})
FULLY_SECURED = MemberSecurity(
    access_control=True, cluster_secret=False, member_tls=True, client_tls=True, zookeeper_tls=True
)


def whats(missing: list[Requirement]) -> list[str]:
    return [requirement.what for requirement in missing]


def test_the_default_policy_asks_nothing_of_a_member_with_nothing_configured() -> None:
    assert unmet(ClusterPolicy(), MemberSecurity()) == []
    assert unmet(EVERYTHING, FULLY_SECURED) == []


def test_each_requirement_names_what_is_missing_and_the_option_that_provides_it() -> None:
    missing = unmet(EVERYTHING, MemberSecurity())
    assert whats(missing) == [
        "caller access control",
        "mutual TLS between members",  # TLS between members is the same option: said once
        "TLS to clients",
        "TLS to ZooKeeper",
    ]
    hows = [requirement.how for requirement in missing]
    assert "--access-tokens" in hows[0] and "--jwt-issuer" in hows[0]
    assert "--member-ca" in hows[1] and "--tls-cert" in hows[2] and "--zk-tls-ca" in hows[3]


@pytest.mark.parametrize(
    ("policy", "member", "missing"),
    [
        (ClusterPolicy(require_access_control=True), MemberSecurity(access_control=True), []),
        (ClusterPolicy(member_auth="secret"), MemberSecurity(cluster_secret=True), []),
        (ClusterPolicy(member_auth="secret"), MemberSecurity(member_tls=True), []),  # mutual TLS proves more
        (ClusterPolicy(member_auth="secret"), MemberSecurity(client_tls=True), ["authentication between members"]),
        (ClusterPolicy(member_auth="mtls"), MemberSecurity(cluster_secret=True), ["mutual TLS between members"]),
        (ClusterPolicy(require_tls=MEMBER), MemberSecurity(cluster_secret=True), ["TLS between members"]),
        (ClusterPolicy(require_tls=MEMBER), MemberSecurity(member_tls=True), []),
        (ClusterPolicy(require_tls=frozenset({"client"})), MemberSecurity(member_tls=True), ["TLS to clients"]),
        (ClusterPolicy(require_tls=frozenset({"zookeeper"})), MemberSecurity(client_tls=True), ["TLS to ZooKeeper"]),
        (ClusterPolicy(unknown=("the requirement 'kafka_tls'",)), FULLY_SECURED, ["the requirement 'kafka_tls'"]),
    ],
)
def test_a_member_satisfies_a_requirement_with_what_it_asks_or_something_stronger(
    policy: ClusterPolicy, member: MemberSecurity, missing: list[str]
) -> None:
    assert whats(unmet(policy, member)) == missing


def test_a_members_security_is_read_from_its_settings() -> None:
    node = NodeSettings(node_id="n1", data_dir=Path("/nonexistent"))
    assert MemberSecurity.of(node) == MemberSecurity()
    tls = TlsSettings(cert="c.pem", key="k.pem", member_ca="ca.pem")
    zk = ZkSettings(tls=ZkTls(Path("zk-ca.pem")))
    router = RouterSettings(
        zk=zk, http=HttpSettings(tls=tls), access=AccessSettings(jwt_issuer="https://issuer", cluster_secret="s")
    )
    assert MemberSecurity.of(router) == MemberSecurity(True, True, True, True, True)
    tokens = dataclasses.replace(node, access=AccessSettings(access_tokens="tokens.toml", cluster_secret="  "))
    assert MemberSecurity.of(tokens) == MemberSecurity(access_control=True)  # a blank secret is none


def test_the_options_make_a_policy_and_a_bad_value_is_one_line() -> None:
    made = ClusterPolicy.of_options(True, "MTLS", " client , zookeeper,", now=12.5)
    assert made == ClusterPolicy(True, "mtls", frozenset({"client", "zookeeper"}), 12.5)
    assert ClusterPolicy.of_options(False, "", "", now=1.0) == ClusterPolicy(updated_at=1.0)
    with pytest.raises(PolicyError, match=r"^--member-auth takes none, secret, mtls, not 'tls'$"):
        ClusterPolicy.of_options(False, "tls", "")
    with pytest.raises(PolicyError, match=r"^--require-tls takes .* client, member, zookeeper, not 'kafka'$"):
        ClusterPolicy.of_options(False, "none", "client,kafka")


def test_the_record_round_trips_and_what_this_version_does_not_know_is_never_met() -> None:
    assert ClusterPolicy.from_json(EVERYTHING.to_json()) == EVERYTHING
    assert ClusterPolicy.from_json(b"{}") == ClusterPolicy()
    newer = {"require_access_control": False, "member_auth": "oidc", "require_tls": ["client", "kafka"], "x": 1}
    read = ClusterPolicy.from_json(json.dumps(newer).encode())
    assert read.require_tls == frozenset({"client"})
    assert read.unknown == ("the requirement 'x'", "member authentication 'oidc'", "TLS on the 'kafka' wire")
    assert len(unmet(read, FULLY_SECURED)) == 3
    for raw in (b"not json", b"[]", b'{"require_access_control": "yes"}', b'{"require_tls": [1]}'):
        with pytest.raises(PolicyError):
            ClusterPolicy.from_json(raw)


def test_a_check_says_in_one_line_what_is_missing_and_an_unreadable_record_is_unmet() -> None:
    assert PolicyCheck.of(None, MemberSecurity()).satisfied
    assert not PolicyCheck.of(None, MemberSecurity()).recorded
    check = PolicyCheck.of(ClusterPolicy(True, "secret").to_json(), MemberSecurity())
    assert check.message == (
        "the cluster policy requires caller access control: set --access-tokens or --jwt-issuer; "
        "authentication between members: set --cluster-secret (or --member-ca)"
    )
    described = check.describe()
    assert (described["recorded"], described["satisfied"], described["member_auth"]) == (True, False, "secret")
    assert len(described["unmet"]) == 2
    broken = PolicyCheck.of(b"{", FULLY_SECURED)
    assert not broken.satisfied and "\n" not in broken.message and "/policy is not JSON" in broken.message


def test_the_gate_withholds_reads_while_a_check_is_unmet_and_says_each_change_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        admission = Admission()
        gate = PolicyGate(admission, "node n1", asyncio.get_running_loop())
        unmet_check = PolicyCheck.of(ClusterPolicy(require_access_control=True).to_json(), MemberSecurity())
        gate(unmet_check)  # from ZooKeeper's thread, as a watch calls it: applied on the loop
        assert admission.withheld is None
        await asyncio.sleep(0)
        assert admission.withheld is not None and admission.withheld.code == "policy_not_satisfied"
        assert gate.message == unmet_check.message
        gate.apply(unmet_check)  # the same again: said once
        gate.apply(PolicyCheck())
        assert admission.withheld is None and gate.message is None

    with caplog.at_level(logging.INFO, logger="keyroute.http.policy_gate"):
        asyncio.run(scenario())
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        "node n1 serves no read: the cluster policy requires caller access control: set --access-tokens or "
        "--jwt-issuer",
        "node n1 serves reads again: it satisfies the cluster policy",
    ]


class StandInClient:
    """What PolicyWatch uses of a kazoo client: get and exists with a watch, listeners, spawn (run at once)."""

    def __init__(self, raw: bytes | None = None, fails: BaseException | None = None) -> None:
        self.raw = raw
        self.fails = fails
        self.watches: list[Any] = []
        self.listeners: list[Any] = []
        self.handler = self

    def spawn(self, call: Any) -> None:
        call()

    def get(self, path: str, watch: Any = None) -> tuple[bytes, None]:
        assert path == "/policy"
        if self.fails is not None:
            raise self.fails
        self.watches.append(watch)
        if self.raw is None:
            raise NoNodeError()
        return self.raw, None

    def exists(self, path: str, watch: Any = None) -> None:
        self.watches.append(watch)
        return None

    def add_listener(self, listener: Any) -> None:
        self.listeners.append(listener)

    def remove_listener(self, listener: Any) -> None:
        self.listeners.remove(listener)

    def changed(self, raw: bytes | None) -> None:
        """The record changes: ZooKeeper fires the watch set by the last read."""
        self.raw = raw
        self.watches[-1](None)


def test_a_watch_refuses_a_start_it_cannot_check_and_tells_each_later_change() -> None:
    told: list[PolicyCheck] = []
    member = MemberSecurity(access_control=True)
    with pytest.raises(ZkUnavailableError, match="reading the cluster policy"):
        PolicyWatch(member, told.append).require(StandInClient(fails=ConnectionLoss()))  # type: ignore[arg-type]
    refused = StandInClient(ClusterPolicy(member_auth="mtls").to_json())
    with pytest.raises(UnmetPolicyError, match="^the cluster policy requires mutual TLS between members"):
        PolicyWatch(member, told.append).require(refused)  # type: ignore[arg-type]
    assert told == [] and refused.listeners == []  # refused: nothing told, nothing left watching

    client = StandInClient(None)
    watch = PolicyWatch(member, told.append)
    watch.require(client)  # type: ignore[arg-type]
    assert watch.check.satisfied and told == [] and watch.version == 0
    client.changed(ClusterPolicy(require_tls=frozenset({"client"})).to_json())
    assert [check.message for check in told] == [
        "the cluster policy requires TLS to clients: set --tls-cert and --tls-key"
    ]
    assert watch.version == 1
    client.fails = NoAuthError()
    client.listeners[0]("CONNECTED")  # a new session: read again, and this identity may no longer
    assert not told[-1].satisfied and "may read" in told[-1].message
    client.fails = None
    client.changed(None)  # the record deleted: nothing asked
    assert told[-1].satisfied and not told[-1].recorded and watch.version == 3
    watch.stop()
    assert client.listeners == []
