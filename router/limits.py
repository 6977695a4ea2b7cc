"""The router's request limits and admin access, built from its settings: the admission checks every request
passes and the uvicorn protocol that bounds request heads before the application sees them.
"""

from __future__ import annotations

from keyroute.core.bounded_http import bounded_httptools
from keyroute.core.request_guard import Admission
from keyroute.core.security import BearerAuth
from keyroute.core.settings import RouterSettings
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def protected_paths(settings: RouterSettings) -> tuple[str, ...]:
    """Paths that need the admin token (when one is configured): admin, and metrics if asked for."""
    return ("/admin", "/metrics") if settings.access.metrics_require_token else ("/admin",)


def admission(settings: RouterSettings) -> Admission:
    """The router's concurrency limit, header-size limit and admin token, shared by the ASGI guard in front
    of the application and the server protocol's own key-read path."""
    limits = settings.limits
    return Admission(
        max_concurrent_requests=limits.max_concurrent_requests,
        max_header_bytes=limits.max_header_bytes,
        admin=BearerAuth(settings.access.admin_token),
        protected=protected_paths(settings),
        retry_after_s=settings.unavailable_retry_after_s,
    )


def http_protocol(settings: RouterSettings, base: type[HttpToolsProtocol] = HttpToolsProtocol) -> type:
    """uvicorn's `http` protocol class: `base` with request heads bounded by `max_header_bytes`."""
    return bounded_httptools(settings.limits.max_header_bytes, base)
