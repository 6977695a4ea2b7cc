"""Runs one state node in the foreground until SIGTERM or SIGINT, then leaves the cluster gracefully.

`keyroute node` calls `run(settings)`: keyroute's HTTP server (`keyroute.http.server`) with the node's app
(admin, health, metrics) and its data plane (reads). The first stop signal starts a graceful stop and then
stops the server, which finishes the requests in flight; a second signal cuts the graceful part short. The
graceful stop is a planned restart (`--restart-grace-s` above 0 and no drain request: the node records the
restart, de-announces and goes, its partitions staying assigned to it; keyroute.state_node.restarts) or a
departure (hand every partition over, de-announce, serving reads all the while). The exit code is 0 after a
signal-initiated shutdown, 1 when the node could not start (ZooKeeper unreachable, port taken: logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from keyroute.api import HEADER_NODE
from keyroute.http.admission import Admission
from keyroute.http.asgi import ASGIApp
from keyroute.http.exchange import ServerLimits
from keyroute.http.server import HttpServer
from keyroute.http.server import run as serve
from keyroute.http.tls import PeerCheck
from keyroute.runtime.logs import describe
from keyroute.runtime.settings import NodeSettings
from keyroute.state_node.app import Node, create_app
from keyroute.state_node.dataplane import NodeDataPlane

log = logging.getLogger(__name__)

# After the graceful leave, requests in flight get at most this long to finish (a Kubernetes grace period
# must cover the leave's drain timeout plus this).
SHUTDOWN_GRACE_S = 10.0
# The graceful leave gets the drain timeout plus this long (to de-announce and see it in the map); past that
# it is cut short, as by a second stop signal: a ZooKeeper call that waits for an unreachable ZooKeeper must
# not keep the node from stopping.
LEAVE_MARGIN_S = 5.0
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_UNLIMITED = sys.maxsize
# A router re-encodes the keys it sends on (integers become strings, `", "` separators): a body within the
# router's limit may grow by this much per key and must still fit the node's.
_REENCODING_BYTES_PER_KEY = 8


def server_limits(settings: NodeSettings) -> ServerLimits:
    """What the node's HTTP server bounds before any request is handled: request heads (431) as the settings
    say, bodies (413) with room for a router's re-encoding of a batch-get, and the time a body has to arrive
    (408), as the settings say (0 switches a limit off)."""
    limits = settings.limits
    return ServerLimits(
        max_header_bytes=limits.max_header_bytes or _UNLIMITED,
        max_body_bytes=body_limit(limits.max_body_bytes, settings.max_batch_keys) or _UNLIMITED,
        body_timeout_s=limits.body_timeout_s,
    )


def body_limit(max_body_bytes: int, max_batch_keys: int) -> int:
    """The largest batch-get body a node takes: a router's limit plus room for its re-encoding of a batch it
    split (a few bytes per key); 0 when bodies are not limited."""
    return max_body_bytes + _REENCODING_BYTES_PER_KEY * max_batch_keys if max_body_bytes else 0


class NodeServer(HttpServer):
    """The node's HTTP server: `stop` first hands the node's partitions over (`Node.leave`) while reads are
    still served, then stops as `HttpServer.stop` does. A stop signal that arrives during the leave cuts it
    short; one during the final stop changes nothing (the stop is bounded by its grace period)."""

    def __init__(self, app: ASGIApp, settings: NodeSettings) -> None:
        """`app`: the node's app (`keyroute.state_node.app.create_app`), whose lifespan puts the `Node` on its
        `state`. The requests the server refuses itself are counted by the app's admission checks
        (`state.admission`, made by create_app), so /metrics shows them with the others."""
        admission: Admission = app.state.admission  # type: ignore[attr-defined]
        super().__init__(
            app,
            server_limits(settings),
            data_plane=NodeDataPlane.from_state,
            on_refusal=admission.refused,
            name=f"node {settings.node_id}",
            error_headers=[(HEADER_NODE.lower().encode("ascii"), settings.node_id.encode("latin-1"))],
            # With a member CA every client presents a certificate from it or from the clients' CA (members
            # are told by the identity their certificate names, which must be the member CA's); without
            # one, only the probes are answered.
            tls=settings.http.tls,
            require_ca=(settings.http.tls.member_ca, settings.http.tls.client_ca),
            require_ca_option="--member-ca or --tls-client-ca" if settings.http.tls.client_ca else "--member-ca",
            peer_check=PeerCheck(settings.http.tls.member_ca, settings.http.tls.client_ca),
        )
        self._left = False

    async def stop(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        with _signals_handled() as on_signal:
            node: Node | None = getattr(getattr(self.app, "state", None), "node", None)
            if node is not None and not self._left:
                self._left = True
                await _leave(node, on_signal)
            on_signal(lambda: None)
            await super().stop(min(grace_s, SHUTDOWN_GRACE_S))


async def _leave(node: Node, on_signal: Callable[[Callable[[], object]], None]) -> None:
    leaving = asyncio.get_running_loop().create_task(stop_gracefully(node))
    on_signal(leaving.cancel)
    bound_s = node.settings.drain_timeout_s + LEAVE_MARGIN_S
    try:
        await asyncio.wait((leaving,), timeout=bound_s)
    except asyncio.CancelledError:
        leaving.cancel()
        raise
    if not leaving.done():
        leaving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await leaving
        log.warning(
            "node %s stops at once: its graceful leave did not end within %.0fs (the drain timeout and %.0fs; is "
            "ZooKeeper unreachable?)",
            node.node_id,
            bound_s,
            LEAVE_MARGIN_S,
        )
    elif leaving.cancelled():
        log.warning("node %s stops at once: a second stop signal came during its graceful leave", node.node_id)
    elif leaving.exception() is not None:  # leaving must end in a stop, whatever happened on the way
        log.error("graceful leave failed; stopping now", exc_info=leaving.exception())


async def stop_gracefully(node: Node, clock: Callable[[], float] = time.time) -> None:
    """What a node does when asked to stop (SIGTERM): a planned restart when the settings allow one and no
    drain request says otherwise; else a departure (`Node.leave`: every partition handed over first).
    `clock`: the wall clock its restart record is stamped with."""
    grace_s = node.settings.restart_grace_s
    registration = node.registration
    if grace_s <= 0 or registration is None:
        await node.leave()
        return
    try:
        if await asyncio.to_thread(registration.drain_requested):
            log.info("node %s was asked to drain: handing its partitions over before it stops", node.node_id)
            await node.leave()
            return
        await asyncio.to_thread(registration.mark_restarting, grace_s, clock())
    except Exception as exc:  # ZooKeeper unreachable: nobody can hold or take over; leave as before
        log.warning(
            "recording node %s's planned restart failed (%s): handing its partitions over", node.node_id, describe(exc)
        )
        await node.leave()
        return
    log.info(
        "node %s stops for a restart: its partitions stay assigned to it for %.0fs (their other replicas serve "
        "them meanwhile); `keyroute node-drain` makes a stop a departure",
        node.node_id,
        grace_s,
    )
    _say_unserved(node)
    node.ownership.leave()  # nothing new loaded or dropped; what is held is served until the server stops
    await node.ownership.withdraw()
    # Routers see the withdrawal through the same kind of watch as we do: once ours has fired, theirs have too
    # (or are about to). A straggler meanwhile is still answered from the view.
    await node.ownership.wait_for_map(lambda m: node.node_id not in m.serving, timeout_s=2.0)


def _say_unserved(node: Node) -> None:
    """Warn, before a planned restart, of the partitions held here that no other node serves meanwhile."""
    alone = node.ownership.alone()
    if alone is not None:
        log.warning(
            "node %s stops as the only live node: its %d partition(s) are served by no node until it is back",
            node.node_id,
            alone,
        )
        return
    m = node.ownership.map
    live = m.live_nodes()
    others = [record for name, record in m.serving.items() if name != node.node_id and name in live]
    unserved = [
        f"{store} p{p}"
        for store, parts in node.ownership.serving_view().items()
        for p in parts
        if not any(p in record.stores.get(store, {}) for record in others)
    ]
    if unserved:
        log.warning(
            "node %s stops for a restart with %d partition(s) no other node serves: they answer 503 until it is "
            "back: %s",
            node.node_id,
            len(unserved),
            ", ".join(unserved[:10]),
        )


@contextmanager
def _signals_handled() -> Iterator[Callable[[Callable[[], object]], None]]:
    """While open, SIGINT and SIGTERM (on the main thread) call the callback last given to the function
    yielded; they are restored to their default afterwards (the server's own handlers are gone by then)."""
    loop = asyncio.get_running_loop()
    action: list[Callable[[], object]] = [lambda: None]
    installed: list[signal.Signals] = []
    if threading.current_thread() is threading.main_thread():
        for sig in _SIGNALS:
            try:
                loop.add_signal_handler(sig, lambda: action[0]())
            except (NotImplementedError, RuntimeError, ValueError):
                continue
            installed.append(sig)

    def on_signal(callback: Callable[[], object]) -> None:
        action[0] = callback

    try:
        yield on_signal
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def run(settings: NodeSettings) -> int:
    """Serve until told to stop; 0 after a clean shutdown, 1 if the node could not start."""
    server = NodeServer(create_app(settings), settings)
    http = settings.http
    if serve(server, http.host, http.port, admin_port=http.admin_port) != 0:
        return 1  # the server said why, in one line
    log.info("node %s stopped", settings.node_id)
    return 0
