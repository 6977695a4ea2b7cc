"""A member's reads, closed while it does not satisfy the cluster policy (keyroute.cluster.cluster_policy).

`PolicyGate` is what a router's or node's `PolicyWatch` hands each new check to: while the check is unmet,
every data-plane request is answered 503 `policy_not_satisfied` naming what is missing (`Admission.withheld`,
looked at before anything else a read costs); once it is met again, reads are served. Each change is said in
one log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from keyroute.api import PolicyNotSatisfied
from keyroute.cluster.cluster_policy import PolicyCheck
from keyroute.http.admission import Admission

log = logging.getLogger(__name__)

# A policy is tightened or met by an operator: a client asks again in a while, not at once.
RETRY_AFTER_S = 30


class PolicyGate:
    """Applies policy checks to `admission` on `loop`; `name` ("router", "node n1") is whom log lines name."""

    def __init__(self, admission: Admission, name: str, loop: asyncio.AbstractEventLoop) -> None:
        self.admission = admission
        self.name = name
        self._loop = loop

    def __call__(self, check: PolicyCheck) -> None:
        """A new check, from any thread (ZooKeeper's): applied on the loop."""
        with contextlib.suppress(RuntimeError):  # the loop has closed: the process is stopping
            self._loop.call_soon_threadsafe(self.apply, check)

    def apply(self, check: PolicyCheck) -> None:
        """Withhold reads while `check` is unmet, serve them once it is met (on the loop)."""
        before = self.admission.withheld
        if check.satisfied:
            self.admission.withheld = None
            if before is not None:
                log.warning("%s serves reads again: it satisfies the cluster policy", self.name)
            return
        if before is not None and before.message == check.message:
            return
        self.admission.withheld = PolicyNotSatisfied(check.message, RETRY_AFTER_S)
        log.error("%s serves no read: %s", self.name, check.message)

    @property
    def message(self) -> str | None:
        """Why reads are withheld now, None while they are served."""
        withheld = self.admission.withheld
        return withheld.message if isinstance(withheld, PolicyNotSatisfied) else None
