"""The router's and a node's OpenAPI documents hold for what they answer: schemathesis reads each document
from the server that serves it (a real cluster: two `keyroute node` processes and a `keyroute router`,
real ZooKeeper) and sends every operation requests made from it; each answer's status, media type, headers
and body must be ones the document gives that operation, and none is a 5xx it does not document."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from keyroute.http.openapi import OPENAPI_PATH
from keyroute.runtime.settings import ZkSettings
from tests.integration.small_cluster import ADMIN_TOKEN, SECRET, STORE, SmallCluster, small_cluster

pytestmark = pytest.mark.integration

# A few requests per operation keep the run short; every operation and status is still met each run.
EXAMPLES = 8
AUTH = {"authorization": f"Bearer {ADMIN_TOKEN}"}
# A request the document allows may still be a 400 it documents, for what a schema cannot say (`not_live`:
# min_offset on a store that follows no topic; `from` after `to`; a cursor that is not one).
NOT_CHECKED = [positive_data_acceptance]
CHECKED = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, module_zk_settings: ZkSettings) -> Iterator[SmallCluster]:
    args = ["--cluster-secret", SECRET, "--admin-token", ADMIN_TOKEN]
    with small_cluster(tmp_path_factory.mktemp("openapi"), module_zk_settings, extra_args=args) as c:
        yield c


def check_every_operation(url: str, held: int | None = None) -> int:
    """Every operation of the document `url` serves, asked at `url` with requests made from the document (and,
    as negative cases, requests it does not allow, which must be refused with a documented 4xx); raises with
    every disagreement found. Returns how many requests were sent. `held`: a partition the node at `url` serves
    (a node asked for a partition's range it does not hold answers 503 partition_unavailable, as documented:
    the router asks only nodes that serve it)."""
    document = schemathesis.openapi.from_url(url + OPENAPI_PATH)
    failures: list[str] = []
    sent = 0
    for found in document.get_all_operations():
        operation = found.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            # Positive cases read the cluster's store (a store made up is only ever a 404).
            known: dict[str, object] | None = None
            if mode is GenerationMode.POSITIVE and "{store}" in operation.path:
                known = {"store": STORE}
                if held is not None and "{partition}" in operation.path:
                    known["partition"] = held
            elif mode is GenerationMode.POSITIVE and "{stores}" in operation.path:
                known = {"stores": STORE}  # a read of several stores, of the one there is

            @CHECKED
            @given(operation.as_strategy(mode, path_parameters=known))
            def check(case: schemathesis.Case) -> None:
                nonlocal sent
                sent += 1
                case.call_and_validate(base_url=url, headers=AUTH, timeout=30, excluded_checks=NOT_CHECKED)

            try:
                check()
            except Unsatisfiable:
                continue  # the document allows every request of this operation: there is no negative case
            except Exception as exc:  # each operation's disagreements, all said at the end
                failures.append(f"{mode.value} {operation.label}: {exc}")
        # An outside fuzzer's finds, asked for every time: keys that are numbers but not integers (answered
        # as entries echoing them, which the document did not allow), a login without its form (was a 303).
        cases = {
            "POST /stores/{store}/batch-get": {"body": {"keys": [-2.2250738585072014e-308, 0.99999, "C001"]}},
            "POST /admin/login": {"media_type": "application/x-www-form-urlencoded"},
        }
        if operation.label in cases:
            case = operation.Case(path_parameters={"store": STORE}, **cases[operation.label])
            try:
                case.call_and_validate(base_url=url, headers=AUTH, timeout=30, excluded_checks=NOT_CHECKED)
            except Exception as exc:
                failures.append(f"{operation.label} {cases[operation.label]}: {exc}")
            sent += 1
    assert not failures, "\n\n".join(failures)
    return sent


def test_the_router_answers_as_its_document_says(cluster: SmallCluster) -> None:
    assert check_every_operation(cluster.router_url) >= 17 * EXAMPLES


def test_a_node_answers_as_its_document_says(cluster: SmallCluster) -> None:
    node_id, url = next(iter(cluster.node_urls.items()))
    held = min(p for p, serving in cluster.serving().items() if node_id in serving)
    assert check_every_operation(url, held) >= 15 * EXAMPLES
