"""What a process says when it cannot get a ZooKeeper session (keyroute.cluster.zk.connect): a host name that
does not resolve is said as such, not as an unreachable server; a refused port stays "cannot reach". No server
is started: the names and ports are chosen to fail."""

from __future__ import annotations

import pytest

from keyroute.cluster import zk
from keyroute.runtime.settings import ZkSettings
from tests.util import free_port


def test_a_host_that_does_not_resolve_is_said_to_not_resolve() -> None:
    settings = ZkSettings(hosts="no-such-zookeeper.invalid:2181", connect_timeout_s=0.5)
    with pytest.raises(zk.ZkUnavailableError) as raised:
        zk.connect(settings, ensure_layout=False)
    message = str(raised.value)
    assert message.startswith("ZooKeeper host no-such-zookeeper.invalid does not resolve ("), message
    assert "check the host names in --zk" in message and "cannot reach" not in message


def test_a_refused_port_is_still_cannot_reach() -> None:
    settings = ZkSettings(hosts=f"127.0.0.1:{free_port()}", connect_timeout_s=0.5)
    with pytest.raises(zk.ZkUnavailableError, match=r"^cannot reach ZooKeeper at 127\.0\.0\.1:\d+ within 0\.5 s"):
        zk.connect(settings, ensure_layout=False)
