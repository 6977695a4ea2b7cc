"""A real ZooKeeper server for local use, started from the jars bundled in the pyspark wheel.

Only Java is needed: nothing is downloaded. Used by `keyroute zookeeper`, the demo and the tests.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

# The server and what it loads at runtime (networking, metrics, logging); versions come from the wheel.
_JAR_PREFIXES = (
    "zookeeper-",
    "slf4j-api-",
    "log4j-slf4j2-impl-",
    "log4j-api-",
    "log4j-core-",
    "netty-",
    "commons-io-",
    "commons-cli-",
    "metrics-core-",
    "audience-annotations-",
    "snappy-java-",
)

MAIN_CLASS = "org.apache.zookeeper.server.ZooKeeperServerMain"


class ZooKeeperLaunchError(RuntimeError):
    """The embedded ZooKeeper could not be found, started, or did not become ready."""


@dataclass(frozen=True, slots=True)
class ServerTls:
    """A TLS client port (`secureClientPort`, Netty): the server's certificate and key (PEM), and the CA its
    clients' certificates must chain to (`client_ca`: client certificates required; None: not asked for).
    `plaintext`: whether the plain `clientPort` is served too. Clients that present a certificate are
    authenticated as its subject DN (scheme `x509`)."""

    port: int
    cert: Path
    key: Path
    client_ca: Path | None = None
    plaintext: bool = True

    def keystore(self, data_dir: Path) -> Path:
        """The key followed by the certificate chain in one PEM file, as ZooKeeper's PEM key store reads it
        (written at start; a certificate renewed later needs a restart)."""
        from cryptography.hazmat.primitives import serialization

        files = {"--tls-cert": self.cert, "--tls-key": self.key, "--tls-client-ca": self.client_ca}
        for flag, path in files.items():
            try:
                if path is not None:
                    path.read_bytes()
            except OSError as exc:
                raise ZooKeeperLaunchError(f"cannot read {flag} {path}: {exc.strerror or exc}") from None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(self.cert, self.key)
            key = serialization.load_pem_private_key(self.key.read_bytes(), password=None)
        except (ssl.SSLError, ValueError, TypeError) as exc:
            raise ZooKeeperLaunchError(
                f"--tls-cert {self.cert} and --tls-key {self.key} are not a PEM certificate and its unencrypted "
                f"PEM key ({getattr(exc, 'reason', None) or exc})"
            ) from None
        try:
            if self.client_ca is not None:
                context.load_verify_locations(self.client_ca)
        except ssl.SSLError as exc:
            raise ZooKeeperLaunchError(
                f"--tls-client-ca {self.client_ca} holds no PEM certificate ({exc.reason})"
            ) from None
        cert = self.cert.read_bytes().strip()
        # PKCS #8: the only private key form ZooKeeper's PEM reader takes (not an "EC/RSA PRIVATE KEY").
        pkcs8 = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        parts = [pkcs8.strip(), cert]
        folder = data_dir / "tls"
        folder.mkdir(mode=0o700, exist_ok=True)
        path = folder / "keystore.pem"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(b"\n".join(parts) + b"\n")
        return path

    def config_lines(self, data_dir: Path, host: str) -> list[str]:
        lines = [
            "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory",
            f"secureClientPort={self.port}",
            f"secureClientPortAddress={host}",
            f"ssl.keyStore.location={self.keystore(data_dir)}",
            "ssl.keyStore.type=PEM",
            "ssl.enabledProtocols=TLSv1.3,TLSv1.2",
            "authProvider.x509=org.apache.zookeeper.server.auth.X509AuthenticationProvider",
        ]
        if self.client_ca is None:
            return [*lines, "ssl.clientAuth=none"]
        return [
            *lines,
            f"ssl.trustStore.location={self.client_ca.resolve()}",
            "ssl.trustStore.type=PEM",
            "ssl.clientAuth=need",
        ]


def jars_dir() -> Path:
    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.submodule_search_locations:
        raise ZooKeeperLaunchError("pyspark is not installed: its wheel carries the ZooKeeper jars")
    folder = Path(next(iter(spec.submodule_search_locations))) / "jars"
    if not any(folder.glob("zookeeper-[0-9]*.jar")):
        raise ZooKeeperLaunchError(f"no ZooKeeper jar in {folder}")
    return folder


def classpath() -> str:
    folder = jars_dir()
    jars = sorted(p for p in folder.glob("*.jar") if p.name.startswith(_JAR_PREFIXES))
    return os.pathsep.join(str(p) for p in jars)


def write_config(
    data_dir: Path, port: int, host: str = "127.0.0.1", tick_time_ms: int = 500, tls: ServerTls | None = None
) -> Path:
    """zoo.cfg for a standalone server; the admin HTTP server is off (it would take port 8080)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "data").mkdir(exist_ok=True)
    cfg = data_dir / "zoo.cfg"
    plaintext = [f"clientPort={port}", f"clientPortAddress={host}"] if tls is None or tls.plaintext else []
    secure = tls.config_lines(data_dir, host) if tls is not None else []
    cfg.write_text(
        "\n".join(
            [
                f"tickTime={tick_time_ms}",
                f"dataDir={data_dir / 'data'}",
                *plaintext,
                *secure,
                "admin.enableServer=false",
                "4lw.commands.whitelist=ruok,srvr,stat,mntr",
                "maxClientCnxns=0",
                f"minSessionTimeout={tick_time_ms * 2}",
                "maxSessionTimeout=60000",
                "autopurge.snapRetainCount=3",
                "autopurge.purgeInterval=1",
                "",
            ]
        )
    )
    log_cfg = data_dir / "log4j2.properties"
    log_cfg.write_text(
        "\n".join(
            [
                "rootLogger.level = warn",
                "rootLogger.appenderRef.stderr.ref = stderr",
                "appender.stderr.type = Console",
                "appender.stderr.name = stderr",
                "appender.stderr.target = SYSTEM_ERR",
                "appender.stderr.layout.type = PatternLayout",
                "appender.stderr.layout.pattern = %d{ISO8601} zookeeper %-5p %c{1}: %m%n",
                # Said once, at INFO: where the server listens ("binding to port ..."; the connection
                # factory's note on its threads and buffers is left out).
                "logger.listening.name = org.apache.zookeeper.server.NIOServerCnxnFactory",
                "logger.listening.level = info",
                "logger.listening.filter.threads.type = RegexFilter",
                "logger.listening.filter.threads.regex = Configuring NIO connection handler.*",
                "logger.listening.filter.threads.onMatch = DENY",
                "logger.listening.filter.threads.onMismatch = NEUTRAL",
                # With TLS (Netty serves both ports): the same line per port, and none of its settings.
                "logger.netty.name = org.apache.zookeeper.server.NettyServerCnxnFactory",
                "logger.netty.level = info",
                "logger.netty.filter.settings.type = RegexFilter",
                "logger.netty.filter.settings.regex = (zookeeper\\.|handshakeThrottling|configure |bound to port).*",
                "logger.netty.filter.settings.onMatch = DENY",
                "logger.netty.filter.settings.onMismatch = NEUTRAL",
                # Says that an unlimited number of connections is configured, which is what we asked for.
                "logger.cnxn_limit.name = org.apache.zookeeper.server.ServerCnxnFactory",
                "logger.cnxn_limit.level = error",
                # A health probe (a four-letter word) that hangs up as soon as it has its answer races the
                # server's own close of that socket, which then logs an ERROR with a stack trace: benign.
                "logger.probe_close.name = org.apache.zookeeper.server.ServerCnxn",
                "logger.probe_close.level = warn",
                "logger.probe_close.filter.close.type = RegexFilter",
                "logger.probe_close.filter.close.regex = Error closing a command socket.*",
                "logger.probe_close.filter.close.onMatch = DENY",
                "logger.probe_close.filter.close.onMismatch = NEUTRAL",
                "",
            ]
        )
    )
    return cfg


def command(
    data_dir: Path, port: int, host: str = "127.0.0.1", java: str = "java", tls: ServerTls | None = None
) -> list[str]:
    java_bin = shutil.which(java)
    if java_bin is None:
        raise ZooKeeperLaunchError(f"{java!r} not found on PATH: ZooKeeper needs a Java runtime (17+)")
    if data_dir.exists() and not data_dir.is_dir():
        raise ZooKeeperLaunchError(f"--data-dir {data_dir} is a file, not a directory")
    cfg = write_config(data_dir, port, host, tls=tls)
    return [
        java_bin,
        "-Xmx256m",
        f"-Dlog4j2.configurationFile={data_dir / 'log4j2.properties'}",
        "-Dzookeeper.admin.enableServer=false",
        "-cp",
        classpath(),
        MAIN_CLASS,
        str(cfg),
    ]


def check_port_free(host: str, port: int) -> None:
    """ZooKeeperLaunchError, in one line, when `host:port` cannot be listened on (in use, or not an address
    of this machine): before the JVM starts, which would say it with a Java stack trace."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        reason = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be listened on ({exc.strerror})"
        raise ZooKeeperLaunchError(f"{host}:{port} {reason}: pass another --port or --host") from None


def four_letter_word(
    host: str, port: int, word: str, timeout_s: float = 1.0, context: ssl.SSLContext | None = None
) -> str:
    """Send a four-letter word and read the answer; over TLS with `context` (the secure client port)."""
    with contextlib.ExitStack() as stack:
        sock = stack.enter_context(socket.create_connection((host, port), timeout=timeout_s))
        if context is not None:
            sock = stack.enter_context(context.wrap_socket(sock, server_hostname=host))
        sock.sendall(word.encode("ascii"))
        chunks = []
        while chunk := sock.recv(4096):
            chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", "replace")


def terminate(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Stop a child process: SIGTERM, then SIGKILL if it has not exited within `timeout_s`; reaped either way."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def is_serving(host: str, port: int, context: ssl.SSLContext | None = None) -> bool:
    try:
        return "Mode:" in four_letter_word(host, port, "srvr", context=context)
    except OSError:  # ssl.SSLError included
        return False


class EmbeddedZooKeeper:
    """A ZooKeeper server process owned by this Python process (context manager)."""

    def __init__(
        self,
        port: int,
        data_dir: Path,
        host: str = "127.0.0.1",
        tls: ServerTls | None = None,
        probe_context: ssl.SSLContext | None = None,
    ) -> None:
        """With `tls` and no plaintext port, readiness is asked over TLS with `probe_context` (which must
        hold a client certificate when the server requires one)."""
        self.host = host
        self.port = port
        self.data_dir = Path(data_dir)
        self.tls = tls
        self.probe_context = probe_context
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def connect_string(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, ready_timeout_s: float = 30.0) -> EmbeddedZooKeeper:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.data_dir / "zookeeper.log", "ab")
        self.process = subprocess.Popen(
            command(self.data_dir, self.port, self.host, tls=self.tls),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ZooKeeperLaunchError(
                    f"ZooKeeper exited with code {self.process.returncode}; see {self.data_dir / 'zookeeper.log'}"
                )
            if self._serving():
                return self
            time.sleep(0.1)
        self.stop()
        raise ZooKeeperLaunchError(f"ZooKeeper did not serve on {self.connect_string} within {ready_timeout_s}s")

    def _serving(self) -> bool:
        if self.tls is None or self.tls.plaintext:
            return is_serving(self.host, self.port)
        return is_serving(self.host, self.tls.port, self.probe_context)

    def stop(self, timeout_s: float = 10.0) -> None:
        proc, self.process = self.process, None
        if proc is not None:
            terminate(proc, timeout_s)

    def __enter__(self) -> EmbeddedZooKeeper:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
