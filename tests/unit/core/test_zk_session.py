"""SessionKeeper's decisions, on a stand-in client, an injected probe and an injected clock."""

from __future__ import annotations

import logging

import pytest

from keyroute.cluster.zk_session import ServerView, SessionKeeper
from keyroute.runtime.logs import describe
from keyroute.runtime.settings import ZkSettings

SETTINGS = ZkSettings(hosts="zk:2181", chroot="/prod", session_timeout_s=4.0)


class FakeClient:
    def __init__(self, last_zxid: int) -> None:
        self.connected = False
        self.last_zxid = last_zxid
        self.restarted = 0

    def restart(self) -> None:
        self.restarted += 1
        self.connected = True
        self.last_zxid = 0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def keeper(client: FakeClient, view: ServerView | None, clock: Clock, cluster: str | None = None) -> SessionKeeper:
    probes: list[ServerView | None] = [view]
    return SessionKeeper(
        client,  # type: ignore[arg-type]
        SETTINGS,
        cluster_id=lambda: cluster,
        probe=lambda _settings: probes[-1],
        clock=clock,
    )


def test_a_session_is_restarted_only_after_the_session_timeout_and_when_the_server_is_behind() -> None:
    client, clock = FakeClient(last_zxid=0x500), Clock()
    k = keeper(client, ServerView(zxid=0x20, cluster_id="c1"), clock, cluster="c1")
    assert k.check() is False  # first look at a lost connection: only noted
    clock.now += 3.9
    assert k.check() is False and client.restarted == 0  # within the session timeout: kazoo's own reconnects
    clock.now += 0.2
    assert k.check() is True
    assert client.restarted == 1 and k.restarts == 1
    assert k.check() is False  # connected again: nothing to do


@pytest.mark.parametrize(
    ("view", "why"),
    [
        (None, "ZooKeeper down: the probe cannot connect either"),
        (ServerView(zxid=0x500, cluster_id="c1"), "the server is not behind: a network problem, kazoo retries"),
        (ServerView(zxid=0x900, cluster_id="c1"), "the server is ahead"),
    ],
)
def test_no_restart_unless_the_server_is_behind(view: ServerView | None, why: str) -> None:
    client, clock = FakeClient(last_zxid=0x500), Clock()
    k = keeper(client, view, clock, cluster="c1")
    k.check()
    clock.now += 60
    assert k.check() is False, why
    assert client.restarted == 0


def test_a_server_behind_without_this_cluster_is_waited_on_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    client, clock = FakeClient(last_zxid=0x500), Clock()
    views: list[ServerView | None] = [ServerView(zxid=0x3, cluster_id=None)]
    k = SessionKeeper(
        client,  # type: ignore[arg-type]
        SETTINGS,
        cluster_id=lambda: "c1",
        probe=lambda _s: views[-1],
        clock=clock,
    )
    k.check()
    with caplog.at_level(logging.WARNING, logger="keyroute.cluster.zk_session"):
        for _ in range(5):
            clock.now += 5
            assert k.check() is False
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and "holds no keyroute cluster at /prod" in said[0] and "keyroute zk restore" in said[0]
        # Another cluster's record there: still no restart (a node never joins another cluster's history).
        views.append(ServerView(zxid=0x9, cluster_id="c2"))
        clock.now += 5
        assert k.check() is False
        assert "holds cluster c2" in caplog.records[-1].getMessage()
        # The restore brings this cluster back: a new session.
        views.append(ServerView(zxid=0x40, cluster_id="c1"))
        clock.now += 5
        assert k.check() is True
        assert "starting a new ZooKeeper session" in caplog.records[-1].getMessage()
    assert client.restarted == 1


def test_a_router_takes_any_cluster_record() -> None:
    client, clock = FakeClient(last_zxid=0x500), Clock()
    k = keeper(client, ServerView(zxid=0x40, cluster_id="whatever"), clock, cluster=None)
    k.check()
    clock.now += 5
    assert k.check() is True


def test_a_failed_restart_is_said_with_its_reason_and_tried_again(caplog: pytest.LogCaptureFixture) -> None:
    class Failing(FakeClient):
        def restart(self) -> None:
            self.restarted += 1
            raise TimeoutError()

    client, clock = Failing(last_zxid=0x500), Clock()
    k = keeper(client, ServerView(zxid=0x40, cluster_id="c1"), clock)
    k.check()
    clock.now += 5
    with caplog.at_level(logging.WARNING, logger="keyroute.cluster.zk_session"):
        assert k.check() is False
        assert caplog.records[-1].getMessage() == "starting a new ZooKeeper session failed (TimeoutError); trying again"
        clock.now += 1
        k.check()
    assert client.restarted == 2


def test_describe_names_an_exception_without_text() -> None:
    assert describe(TimeoutError()) == "TimeoutError"
    assert describe(ValueError("bad value")) == "bad value"
    assert describe(RuntimeError("  ")) == "RuntimeError"
