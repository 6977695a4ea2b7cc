"""Avro answers on a real cluster (two `keyroute node` processes and a `keyroute router`): the same keys read
as JSON and as Avro give equal values, straight from a node, forwarded by one and through the router (key
reads, batch-gets with their per-key errors), and through the Python client in both routing modes; errors
stay JSON whatever was asked; an Accept offering neither is 406; both publish the envelope's schema.
History and windows reads in Avro: tests/integration/test_timeline_reads.py."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import fastavro
import httpx
import pytest

from keyroute.client import Client, KeyNotFound
from keyroute.formats.avro_answers import SCHEMA_ID, decode_answer
from keyroute.runtime.settings import ZkSettings
from tests.integration.small_cluster import ROWS, STORE, SmallCluster, expected, key_path, partition, small_cluster

pytestmark = pytest.mark.integration

AVRO = {"accept": "application/avro"}
NAMED = {"accept": f"application/vnd.keyroute.{STORE}+avro"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, module_zk_settings: ZkSettings) -> Iterator[SmallCluster]:
    """One cluster for the module: its tests only read."""
    with small_cluster(tmp_path_factory.mktemp("avro-answers"), module_zk_settings) as c:
        yield c


def avro_of(answer: httpx.Response, media_type: str = "application/avro") -> dict[str, Any]:
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == media_type
    assert answer.headers["x-keyroute-schema-id"] == SCHEMA_ID
    return decode_answer(answer.content)


def test_every_read_answers_the_same_values_in_avro_as_in_json(cluster: SmallCluster) -> None:
    serving = cluster.serving()
    keys = list(ROWS)
    batch = {"keys": [*keys, "nobody", "", 12]}
    with httpx.Client(timeout=10, trust_env=False) as http:
        for base in (cluster.router_url, *cluster.node_urls.values()):
            for key in keys:
                as_json = http.get(base + key_path(key))
                assert as_json.headers["content-type"] == "application/json"
                assert "x-keyroute-schema-id" not in as_json.headers
                assert as_json.json() == expected(key)
                assert avro_of(http.get(base + key_path(key), headers=AVRO)) == expected(key), (base, key)
            # The store's own media type; JSON preferred is JSON.
            named = http.get(base + key_path(keys[0]), headers=NAMED)
            assert avro_of(named, NAMED["accept"]) == expected(keys[0])
            preferred = http.get(
                base + key_path(keys[0]), headers={"accept": "application/json, application/avro;q=0.5"}
            )
            assert preferred.headers["content-type"] == "application/json"
            # A batch-get: found keys, a missing one, an integer and an empty key (per-key answers).
            as_json = http.post(f"{base}/stores/{STORE}/batch-get", json=batch)
            as_avro = http.post(f"{base}/stores/{STORE}/batch-get", json=batch, headers=AVRO)
            results = as_json.json()["results"]
            assert [r["status"] for r in results][: len(keys) + 1] == [200] * len(keys) + [404]
            assert avro_of(as_avro) == as_json.json(), base
        # A node that does not serve a key forwards the read (asking the other for JSON) and answers in Avro.
        for key in keys[:5]:
            outsider = next(n for n in cluster.node_urls if n not in serving[partition(key)])
            forwarded = http.get(cluster.node_urls[outsider] + key_path(key), headers=AVRO)
            assert forwarded.headers["x-keyroute-hops"] == "1"
            assert avro_of(forwarded) == expected(key)
    # The Python client, through the router and routing itself: the same Values as JSON answers give.
    for routing in ("router", "direct"):
        with (
            Client(cluster.router_url, routing=routing, answer_format="avro") as client,
            Client(cluster.router_url, routing=routing) as plain,
        ):
            for key in keys:
                assert client.get(STORE, key) == plain.get(STORE, key), (routing, key)
            got, wanted = client.get_many(STORE, [*keys, "nobody"]), plain.get_many(STORE, [*keys, "nobody"])
            assert got[:-1] == wanted[:-1] and isinstance(got[-1], KeyNotFound), routing
            with pytest.raises(KeyNotFound):
                client.get(STORE, "nobody")
            assert client.stats["direct" if routing == "direct" else "via_router"] > 0


def test_errors_stay_json_406_offers_the_types_and_the_schema_is_published(cluster: SmallCluster) -> None:
    with httpx.Client(timeout=10, trust_env=False) as http:
        for base in (cluster.router_url, *cluster.node_urls.values()):
            missing = http.get(base + key_path("nobody"), headers=AVRO)
            assert missing.status_code == 404 and missing.headers["content-type"] == "application/json"
            assert missing.json()["error"] == "key_not_found"
            unknown = http.get(base + "/stores/nothing/keys/a", headers=AVRO)
            assert unknown.status_code == 404 and unknown.json()["error"] == "store_not_found"
            bad = http.post(f"{base}/stores/{STORE}/batch-get", content=b"not json", headers=AVRO)
            assert bad.status_code == 400 and bad.json()["error"] == "bad_request"
            for read in (
                http.get(base + key_path("C001"), headers={"accept": "text/html"}),
                http.get(base + key_path("C001"), headers={"accept": "application/vnd.keyroute.other+avro"}),
                http.post(f"{base}/stores/{STORE}/batch-get", json={"keys": ["C001"]}, headers={"accept": "text/csv"}),
            ):
                assert read.status_code == 406, (base, read.text)
                assert read.headers["content-type"] == "application/json"
                body = read.json()
                assert body["error"] == "not_acceptable"
                assert "application/json" in body["message"] and "application/avro" in body["message"]
            # A browser's Accept, or none to speak of: JSON.
            browser = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
            assert http.get(base + key_path("C001"), headers={"accept": browser}).json() == expected("C001")
            # Router and nodes publish the answers' schema.
            answer = http.get(f"{base}/stores/{STORE}/schema")
            assert answer.status_code == 200, answer.text
            doc = answer.json()
            assert doc["schema_id"] == SCHEMA_ID and doc["store"] == STORE and doc["columns"] == ["v"]
            assert doc["media_types"] == ["application/avro", f"application/vnd.keyroute.{STORE}+avro"]
            # The published schema reads an answer.
            schema = fastavro.parse_schema(doc["schema"])
            data = http.get(base + key_path("C001"), headers=AVRO).content
            record = fastavro.schemaless_reader(io.BytesIO(data), schema, None)
            assert record["key"] == "C001" and record["value"] == ROWS["C001"]
            assert http.get(f"{base}/stores/nothing/schema").status_code == 404
