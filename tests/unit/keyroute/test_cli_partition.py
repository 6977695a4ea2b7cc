"""`keyroute partition`: one JSON object per key, from arguments or stdin lines exactly as written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from keyroute.cli import build_parser, main
from keyroute.keys.key_format import KeyFormat, parse_key
from keyroute.keys.partitioner import Partitioner, murmur2, partition_for


def run(args: list[str], stdin: bytes = b"") -> tuple[int, list[dict]]:
    proc = subprocess.run(
        [sys.executable, "-m", "keyroute", "partition", *args], input=stdin, capture_output=True, check=False
    )
    return proc.returncode, [json.loads(line) for line in proc.stdout.decode().splitlines()]


def test_kafka_vectors_from_arguments() -> None:
    code, rows = run(["--partitions", "1000", "21", "foobar"])
    assert code == 0
    assert rows[0] == {"key": "21", "partition": (-973932308 & 0x7FFFFFFF) % 1000, "hash": -973932308}
    assert rows[1]["hash"] == -790332482


def test_stdin_lines_are_keys_exactly_as_written() -> None:
    stdin = "a\n\n b \r\nZoë/100%\nlast-without-newline".encode()
    code, rows = run(["--partitions", "12"], stdin)
    assert code == 0
    assert [r["key"] for r in rows] == ["a", "", " b ", "Zoë/100%", "last-without-newline"]
    for row in rows:
        data = row["key"].encode()
        assert row["hash"] == murmur2(data)
        assert row["partition"] == partition_for(Partitioner.MURMUR2, data, 12)


def test_bytes_and_int_keys_and_other_partitioners() -> None:
    code, rows = run(["--partitions", "7", "--key-format", "bytes", "YWJj"])
    assert code == 0 and rows[0]["hash"] == 479470107  # b"abc", Kafka's UtilsTest
    code, rows = run(["--partitions", "12", "--partitioner", "fnv1a", "1468509572224"])
    assert code == 0 and rows[0]["partition"] == 8 and rows[0]["hash"] == 0x80000000
    key = parse_key(KeyFormat.INT64, "-9223372036854775808")
    code, rows = run(["--partitions", "12", "--key-format", "int64", "-9223372036854775808"])
    assert code == 0 and rows[0]["partition"] == partition_for(Partitioner.MURMUR2, key.data, 12)


def test_a_bad_key_is_reported_and_the_exit_code_says_so() -> None:
    code, rows = run(["--partitions", "4", "--key-format", "int32", "12", "3000000000"])
    assert code == 1
    assert rows[0]["key"] == "12" and "partition" in rows[0]
    assert rows[1]["error"] == "bad_key" and "int32" in rows[1]["message"]


@pytest.mark.parametrize("args", [["--partitions", "0", "k"], ["--partitions", "3", "--partitioner", "md5", "k"]])
def test_bad_options_exit_2(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["partition", *args]) == 2
    assert "keyroute partition:" in capsys.readouterr().err


def test_every_option_reads_its_environment_variable() -> None:
    parser = build_parser(
        {"KEYROUTE_ZK": "zk:2181/x", "KEYROUTE_PORT": "9001", "KEYROUTE_NODE_ID": "n7", "KEYROUTE_DATA_DIR": "/data"}
    )
    args = parser.parse_args(["node"])
    assert (args.zk, args.port, args.node_id, str(args.data_dir)) == ("zk:2181/x", 9001, "n7", "/data")


def test_a_partition_count_beyond_kafka_s_says_so_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["partition", "--partitions", "2147483648", "k"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "from 1 to 2147483647" in err and "Traceback" not in err


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    """`keyroute partition ... | head -1`: no BrokenPipeError traceback, the exit code of a SIGPIPE."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "keyroute", "partition", "--partitions", "12"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stdin is not None
    proc.stdin.write("".join(f"key-{i}\n" for i in range(200_000)).encode())
    proc.stdin.close()
    first = proc.stdout.readline()
    proc.stdout.close()  # the reader goes away after one line
    assert json.loads(first)["key"] == "key-0"
    assert proc.wait(timeout=60) == 141
    assert proc.stderr is not None and proc.stderr.read() == b""


def test_the_logging_options_are_taken_after_the_command_too() -> None:
    parser = build_parser({})
    args = parser.parse_args(["partition", "--partitions", "3", "--log-level", "DEBUG", "--log-format", "json", "k"])
    assert (args.log_level, args.log_format) == ("DEBUG", "json")
    args = parser.parse_args(["--log-level", "ERROR", "partition", "--partitions", "3", "k"])
    assert (args.log_level, args.log_format) == ("ERROR", "text")
    node = ["node", "--zk", "z:1", "--node-id", "n", "--data-dir", "/d", "--port", "1", "--log-level", "WARNING"]
    args = parser.parse_args(node)
    assert args.log_level == "WARNING"


def test_zookeeper_on_a_port_in_use_or_a_file_as_data_dir_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["zookeeper", "--port", str(port), "--data-dir", str(tmp_path / "zk")]) == 1
    err = capsys.readouterr().err
    assert err == f"keyroute zookeeper: 127.0.0.1:{port} is in use: pass another --port or --host\n"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert main(["zookeeper", "--port", "0", "--data-dir", str(a_file)]) == 1
    assert capsys.readouterr().err == f"keyroute zookeeper: --data-dir {a_file} is a file, not a directory\n"
