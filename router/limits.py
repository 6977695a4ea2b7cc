"""The router's request limits and admin access, built from its settings: the admission checks every request
passes (the app's and the data plane's alike) and the limits of the HTTP server in front of both.
"""

from __future__ import annotations

import sys

from keyroute.auth.security import BearerAuth
from keyroute.http.admission import Admission
from keyroute.http.authn import admin_paths
from keyroute.http.exchange import ServerLimits
from keyroute.runtime.settings import RouterSettings


def protected_paths(settings: RouterSettings) -> tuple[str, ...]:
    """Paths that need the admin token or an admin caller: admin, and metrics (keyroute.http.authn)."""
    return admin_paths(settings.access)


def admission(settings: RouterSettings) -> Admission:
    """The router's concurrency limit, header-size limit and admin token, shared by the ASGI guard in front
    of the application and the data plane (router/dataplane.py)."""
    limits = settings.limits
    return Admission(
        max_concurrent_requests=limits.max_concurrent_requests,
        max_concurrent_per_caller=limits.max_concurrent_per_caller,
        max_header_bytes=limits.max_header_bytes,
        admin=BearerAuth(settings.access.admin_token),
        protected=protected_paths(settings),
        retry_after_s=settings.unavailable_retry_after_s,
    )


def server_limits(settings: RouterSettings) -> ServerLimits:
    """What the router's HTTP server bounds before any request is handled: request heads (431) and bodies
    (413), as the settings say (0 switches a limit off)."""
    limits = settings.limits
    return ServerLimits(
        max_header_bytes=limits.max_header_bytes or _UNLIMITED,
        max_body_bytes=limits.max_body_bytes or _UNLIMITED,
        body_timeout_s=limits.body_timeout_s,
    )


_UNLIMITED = sys.maxsize
