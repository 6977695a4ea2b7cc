"""The "did you mean" of an empty chroot: the top-level chroots holding a keyroute cluster, closest first."""

from __future__ import annotations

from typing import Any

import pytest

from keyroute.cluster import cluster_identity, zk
from keyroute.runtime.settings import ZkSettings


class _Root:
    """ZooKeeper's root as a chroot-less client sees it: `clusters` hold /cluster, `stores` published stores."""

    def __init__(self, children: list[str], clusters: set[str], stores: set[str]) -> None:
        self.children, self.clusters, self.stores = children, clusters, stores

    def get_children(self, path: str) -> list[str]:
        if path == "/":
            return self.children
        return ["s"] if path.removesuffix("/stores") in self.stores else []

    def exists(self, path: str) -> Any:
        return object() if path.removesuffix("/cluster") in self.clusters else None

    def exists_async(self, path: str) -> Any:
        return _Done(self.exists(path))

    def get_children_async(self, path: str) -> Any:
        return _Done(self.get_children(path))


class _Done:
    def __init__(self, value: Any) -> None:
        self.value = value

    def get(self, timeout: float | None = None) -> Any:
        return self.value


@pytest.fixture
def root(monkeypatch: pytest.MonkeyPatch) -> _Root:
    found = _Root([], set(), set())
    monkeypatch.setattr(zk, "connect", lambda settings, ensure_layout=True: found)
    monkeypatch.setattr(zk, "close", lambda client: None)
    return found


def test_no_other_cluster_is_no_suggestion(root: _Root) -> None:
    root.children = ["zookeeper", "typo"]
    settings = ZkSettings(hosts="zk:2181", chroot="/typo")
    assert cluster_identity.chroots_with_a_cluster(settings) == []
    message = cluster_identity.empty_chroot_message(settings, [])
    assert message == (
        "no keyroute cluster at ZooKeeper zk:2181 chroot /typo: no cluster record, no nodes, no stores "
        "(is --zk right? a new cluster starts with its first node)"
    )


def test_chroots_holding_a_cluster_come_closest_first(root: _Root) -> None:
    root.children = ["zookeeper", "keyroute", "keyroute-staging", "other", "kr"]
    root.clusters, root.stores = {"/keyroute", "/kr"}, {"/keyroute-staging"}
    settings = ZkSettings(hosts="zk:2181", chroot="/keyrout")
    found = cluster_identity.chroots_with_a_cluster(settings)
    assert found[0] == "/keyroute" and sorted(found) == ["/keyroute", "/keyroute-staging", "/kr"]
    assert "(did you mean /keyroute, " in cluster_identity.empty_chroot_message(settings, found)
