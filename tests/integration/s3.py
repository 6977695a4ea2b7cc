"""An S3-API server for the object-storage tests: moto's server mode (`python -m moto.server`), a MOCK of
the S3 API (not a real S3), run as a real process on 127.0.0.1 and spoken to over HTTP by pyarrow's S3
client exactly as a real endpoint would be.

What a keyroute process needs to reach it is what it needs for any S3-compatible server, all in the
environment (`S3Bucket.env`): AWS_ENDPOINT_URL (http://127.0.0.1:PORT; pyarrow's `FileSystem.from_uri`
reads it, a bare `S3FileSystem()` does not), AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_REGION.
Addressing is path-style (pyarrow's default: `force_virtual_addressing=False`) and the scheme is the one
in the endpoint URL (http).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.util import free_port, wait_for

REGION = "us-east-1"


@dataclass(frozen=True)
class S3Server:
    """A running moto server and the (made-up, per session) credentials every test uses with it."""

    host: str
    port: int
    access_key: str
    secret_key: str
    log_path: Path
    region: str = REGION

    @property
    def endpoint(self) -> str:
        """The endpoint URL, scheme included (what AWS_ENDPOINT_URL holds)."""
        return f"http://{self.host}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """The environment a subprocess needs to use this server through pyarrow (and any AWS SDK)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            # Credentials come from the environment: never ask an EC2 metadata service that isn't there.
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def filesystem(self) -> Any:
        """A pyarrow S3FileSystem on this server, configured explicitly (independent of os.environ)."""
        from pyarrow import fs

        return fs.S3FileSystem(
            access_key=self.access_key,
            secret_key=self.secret_key,
            region=self.region,
            scheme="http",
            endpoint_override=f"{self.host}:{self.port}",
            allow_bucket_creation=True,
            allow_bucket_deletion=True,
        )

    def create_bucket(self, name: str) -> None:
        self.filesystem().create_dir(name)

    def answers(self) -> bool:
        """The server answers S3 requests (a bucket listing through pyarrow)."""
        from pyarrow import fs

        self.filesystem().get_file_info(fs.FileSelector("", recursive=False))
        return True


@dataclass(frozen=True)
class S3Bucket:
    """A fresh bucket (and a prefix in it) for one test."""

    server: S3Server
    name: str
    prefix: str

    @property
    def env(self) -> dict[str, str]:
        return self.server.env

    @property
    def secret_key(self) -> str:
        return self.server.secret_key

    def uri(self, *parts: str) -> str:
        """`s3://bucket/prefix[/part...]`."""
        return "/".join([f"s3://{self.name}/{self.prefix}", *parts])

    def path(self, *parts: str) -> str:
        """The same place in pyarrow's own path syntax (`bucket/prefix/...`), for `filesystem()`."""
        return "/".join([f"{self.name}/{self.prefix}", *parts])

    def filesystem(self) -> Any:
        return self.server.filesystem()

    def objects(self) -> list[str]:
        """Every object under the prefix (relative to it), sorted."""
        from pyarrow import fs

        infos = self.filesystem().get_file_info(fs.FileSelector(self.path(), recursive=True, allow_not_found=True))
        base = self.path() + "/"
        return sorted(i.path[len(base) :] for i in infos if i.type == fs.FileType.File)


@contextmanager
def moto_server(log_dir: Path, timeout_s: float = 60.0) -> Iterator[S3Server]:
    """`python -m moto.server` on 127.0.0.1 and a free port; yields once it answers S3 requests, stops it on
    exit. Its output goes to `log_dir/moto.log` (shown when it fails to start)."""
    port = free_port()
    log_path = log_dir / "moto.log"
    server = S3Server(
        host="127.0.0.1",
        port=port,
        access_key="AKIAKEYROUTE" + secrets.token_hex(4).upper(),
        secret_key="kr-test-secret-" + secrets.token_hex(16),
        log_path=log_path,
    )
    # The server itself needs no credentials; keep the caller's AWS settings (if any) away from it.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", server.host, "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    try:

        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"moto server exited {proc.returncode}:\n{log_path.read_text(errors='replace')}")
            # moto's own API answers first; then an S3 request through pyarrow proves the S3 side.
            with httpx.Client(trust_env=False, timeout=2.0) as http:
                if http.get(f"{server.endpoint}/moto-api/").status_code != 200:
                    return False
            return server.answers()

        try:
            wait_for(up, timeout_s=timeout_s, interval_s=0.1, message=f"moto server on port {port}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- moto log ---\n{log_path.read_text(errors='replace')[-3000:]}") from None
        yield server
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def new_bucket(server: S3Server) -> S3Bucket:
    """A bucket no other test uses, with a fresh prefix in it."""
    token = uuid.uuid4().hex[:12]
    bucket = S3Bucket(server=server, name=f"kr-{token}", prefix=f"t-{token}")
    server.create_bucket(bucket.name)
    return bucket
