"""Session-wide real components: one ZooKeeper server, one SparkSession and one Kafka-protocol broker (librdkafka's
mock cluster); a fresh chroot and fresh topics per test."""

from __future__ import annotations

import logging
import random
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from keyroute.dev.kafka_mock import MockKafka
from keyroute.dev.zookeeper_server import EmbeddedZooKeeper
from keyroute.runtime.settings import ZkSettings
from tests.util import Proc, free_port, wait_for

# The files that take longest, longest first (seconds: `--durations` of one run on two workers, at load 6-12).
# `make test` hands files to its workers in collection order (--no-loadscope-reorder), so these start first and the
# many short files fill in the end. In xdist's own order (most tests first) the long integration files, which hold
# few tests each, came last and one of them was the suite's tail.
LONGEST_FIRST = (
    "tests/integration/test_pipeline.py",  # 239
    "tests/integration/test_demo.py",  # 244, less since its killed node is one of the shared demo's
    "tests/integration/test_pipeline_catalog.py",  # 142
    "tests/integration/test_object_storage.py",  # 118
    "tests/integration/test_schema_keys.py",  # 73
    "tests/integration/test_orderings.py",  # 71
    "tests/integration/test_timeline_reads.py",  # 67
    "tests/integration/test_partition_map_page.py",  # 61
    "tests/integration/test_live_node.py",  # 60
    "tests/integration/test_text_times_pipeline.py",  # 54
    "tests/integration/test_chaos.py",  # 51
    "tests/integration/test_fuzz_router.py",  # 51
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files in LONGEST_FIRST first, then the other integration files, then the rest; each file's tests in
    their own order, and files otherwise in pytest's (a stable sort)."""
    rank = {path: n for n, path in enumerate(LONGEST_FIRST)}

    def place(item: pytest.Item) -> tuple[int, bool]:
        path = item.nodeid.split("::", 1)[0]
        return rank.get(path, len(rank)), not path.startswith("tests/integration/")

    items.sort(key=place)


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A test that runs the CLI installs handlers on pytest's captured stderr, which is closed after the
    test; later log records (threads, shutdown) must not go there."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session", autouse=True)
def _kazoo_draws_its_own_random_numbers() -> Iterator[None]:
    """kazoo's connection threads draw their jitter (and host order) from the `random` module, at every ping and
    every reconnection attempt, beside whatever test runs. Hypothesis fails a test whose global random state moves
    while it draws an example ("Do not use the `random` module inside strategies", made an error here), and
    replays it: with any kazoo client alive in the worker (a module's shared cluster, a client a failed test left
    behind), property tests failed as flaky and schemathesis' runs replayed real requests until pytest-timeout. In
    the test process kazoo gets a generator of its own; the processes the tests start are untouched."""
    from kazoo import retry
    from kazoo.protocol import connection

    with pytest.MonkeyPatch.context() as patch:
        own = random.Random()
        for module in (retry, connection):
            patch.setattr(module, "random", own)  # raising: a kazoo that no longer draws there fails loudly
        yield


@pytest.fixture(scope="session")
def zk_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedZooKeeper]:
    server = EmbeddedZooKeeper(port=free_port(), data_dir=tmp_path_factory.mktemp("zookeeper"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def zk_settings(zk_server: EmbeddedZooKeeper) -> ZkSettings:
    """A chroot of its own for each test, so tests never see each other's records."""
    return ZkSettings(hosts=zk_server.connect_string, chroot=f"/t-{uuid.uuid4().hex[:12]}", session_timeout_s=4.0)


@pytest.fixture(scope="module")
def module_zk_settings(zk_server: EmbeddedZooKeeper) -> ZkSettings:
    """A chroot shared by one module's tests: for a cluster started once for the tests that only read it."""
    return ZkSettings(hosts=zk_server.connect_string, chroot=f"/m-{uuid.uuid4().hex[:12]}", session_timeout_s=4.0)


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from keyroute.pipeline.session import create_session

    session = create_session(master="local[2]", local_dir=Path(tmp_path_factory.mktemp("spark")))
    yield session
    session.stop()


@pytest.fixture(scope="session")
def kafka() -> Iterator[MockKafka]:
    """One mock Kafka cluster for the session (in this process; other processes reach it over TCP at
    `kafka.bootstrap_servers`). Tests create their own topics with `kafka_topic`, never share one."""
    with MockKafka() as cluster:
        yield cluster


@pytest.fixture
def kafka_topic(kafka: MockKafka) -> Callable[[int], str]:
    """`kafka_topic(partitions)`: a new topic with a name no other test uses, created on the session's
    cluster (`kafka`) with that many partitions."""

    def create(partitions: int) -> str:
        name = f"t-{uuid.uuid4().hex[:12]}"
        kafka.create_topic(name, partitions)
        return name

    return create


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One S3-API server for the session: moto's server mode (a mock S3) as a real process on 127.0.0.1
    (tests/integration/s3.py). Started on first use only: moto is a dev dependency."""
    import importlib.util

    from tests.integration.s3 import moto_server

    if importlib.util.find_spec("moto") is None:
        pytest.fail("moto[server] is not installed: install the dev extras (pip install -e '.[dev]')")
    with moto_server(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server):  # type: ignore[no-untyped-def]
    """A fresh bucket and prefix per test; `.env` is what the test's subprocesses need to reach it
    (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION)."""
    from tests.integration.s3 import new_bucket

    return new_bucket(s3_server)


@pytest.fixture(scope="session")
def schema_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One development Schema Registry for the session (keyroute.dev.schema_registry_dev, `keyroute schema-registry`)
    as a process on 127.0.0.1; yields its URL. Tests register under subjects of their own (e.g. the topic
    from `kafka_topic`), never share one."""
    import httpx

    port = free_port()
    proc = Proc(["schema-registry", "--port", str(port)], tmp_path_factory.mktemp("schema-registry") / "log").start()
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.alive, proc.output()
        return httpx.get(f"{url}/subjects", timeout=2).status_code == 200

    try:
        wait_for(up, timeout_s=30, message="the schema registry to answer")
        yield url
    finally:
        proc.stop()
