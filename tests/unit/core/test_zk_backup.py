"""keyroute.cli.zk_backup's dump format, and `keyroute zk restore` refusing a bad dump in one line before it
touches ZooKeeper (the dump and the restore themselves: tests/integration/test_zk_backup.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from keyroute.cli import main
from keyroute.cli.zk_backup import Dump, ZkBackupError, Znode
from keyroute.cluster.cluster_identity import ClusterId

IDENTITY = ClusterId("c1", 1.0).to_json()


def document(*entries: dict[str, Any], **fields: Any) -> bytes:
    doc = {"format": "keyroute-zk-dump", "format_version": 1, "chroot": "/k", "cluster_id": "c1"}
    doc["znodes"] = list(entries)
    doc.update(fields)
    return json.dumps(doc).encode()


def test_a_dump_keeps_text_as_text_and_anything_else_as_base64_and_reads_back_the_same() -> None:
    dump = Dump(
        (
            Znode("/cluster", IDENTITY, 0),
            Znode("/placement", b"", 4),
            Znode("/stores/s", "{\"name\": \"東京\"}".encode(), 7),
            Znode("/x/binary", b"\x00\xff\xfe", 1),
        ),
        "/k",
        "c1",
        12.5,
    )
    doc = json.loads(dump.to_bytes())
    entries = {z["path"]: z for z in doc["znodes"]}
    assert entries["/stores/s"] == {"path": "/stores/s", "version": 7, "text": "{\"name\": \"東京\"}"}
    assert entries["/x/binary"] == {"path": "/x/binary", "version": 1, "base64": "AP/+"}
    assert Dump.parse(dump.to_bytes()) == dump


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        (b"{not json", "the dump: not valid JSON"),
        (b"[1, 2]", "the dump: expected a JSON object"),
        (json.dumps({"format": "other"}).encode(), "not a keyroute ZooKeeper dump"),
        (document(format_version=2), "format version 2"),
        (document(znodes={}), "no `znodes` list"),
        (document({"path": "relative", "text": ""}), "no valid absolute path"),
        (document({"path": "/a/../b", "text": ""}), "no valid absolute path"),
        (document({"path": "/a", "text": "", "base64": ""}), "exactly one of"),
        (document({"path": "/a", "base64": "**"}), "not base64"),
        (document({"path": "/a", "text": "", "version": -1}), "invalid version"),
        (document({"path": "/a", "text": ""}, {"path": "/a", "text": "x"}), "more than once"),
        (document({"path": "/cluster", "text": IDENTITY.decode()}, cluster_id="c2"), "is not the id"),
        (document({"path": "/cluster", "text": "nonsense"}), "not a cluster identity"),
    ],
)
def test_a_damaged_dump_is_refused_in_one_line(raw: bytes, said: str) -> None:
    with pytest.raises(ZkBackupError, match=said.replace("(", r"\(")) as caught:
        Dump.parse(raw)
    assert "\n" not in str(caught.value)


def test_restore_refuses_an_unreadable_or_damaged_dump_before_connecting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Port 9 (discard) on 127.0.0.1 would fail to connect slowly: the file is refused first.
    zk = ["--zk", "127.0.0.1:9/k"]
    assert main(["zk", "restore", *zk, "--in", str(tmp_path / "missing.json")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("keyroute zk restore: cannot read ") and "\n" not in err
    damaged = tmp_path / "damaged.json"
    damaged.write_bytes(document({"path": "/a", "base64": "**"}))
    assert main(["zk", "restore", *zk, "--in", str(damaged)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"keyroute zk restore: {damaged}: znode #1 (/a): `base64` is not base64"
