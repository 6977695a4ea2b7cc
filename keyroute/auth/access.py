"""Who is asking: the identity a read is made under, and what it may read.

Every data-plane read (and /admin) is made under one `Identity`. With no identity configured (no token
file, no JWT issuer, no client-certificate mapping) every caller is `ANONYMOUS`, which may read every
store: the open behaviour of a cluster that has not turned access control on.

Authentication (which identity a request carries), permissions (which stores it may read), quotas (how
much) and fair shedding (how much at once) all name callers by `Identity.name`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Identity:
    """A caller: its `name` (the token's name, the JWT's subject, the certificate's identity), the stores it
    may read (`stores`; None: every store) and whether it may use /admin."""

    name: str
    stores: frozenset[str] | None = None
    admin: bool = False

    def may_read(self, store: str) -> bool:
        """Whether this caller may read `store`."""
        return self.stores is None or store in self.stores


# Every caller of a cluster without access control.
ANONYMOUS = Identity("anonymous", None, admin=True)


def caller_of(call: Any) -> Identity:
    """The identity a data-plane call (keyroute.http.dataplane.Call) is made under: ANONYMOUS until an
    authenticator has set one."""
    return getattr(call, "identity", None) or ANONYMOUS
