"""The API errors keyroute.http raises itself: 405 (routing), 417, 403 client_certificate_required and
member_certificate_refused (the protocol), 303 to the login form (the admission checks).

Their own module, never compiled (setup.py): a class that mypyc compiles as a subclass of an interpreted one
(`ApiError`) does not keep the status and code it declares in its body.
"""

from __future__ import annotations

from keyroute.api import ApiError

__all__ = [
    "LOGIN_PATH",
    "ClientCertificateRequired",
    "ExpectationFailed",
    "LogIn",
    "MemberCertificateRefused",
    "MethodNotAllowed",
]

LOGIN_PATH = "/admin/login"


class MethodNotAllowed(ApiError):
    """405: the path is a route's, the method is not one of its methods (`Allow` lists them)."""

    status = 405
    code = "method_not_allowed"

    def __init__(self, allow: str) -> None:
        super().__init__("Method Not Allowed", {"Allow": allow})


class ExpectationFailed(ApiError):
    """An `Expect` other than 100-continue (the API itself has no use for Expect: only the server answers it)."""

    status = 417
    code = "expectation_failed"


class ClientCertificateRequired(ApiError):
    """A request other than a probe on a TLS connection without the client certificate the server requires."""

    status = 403
    code = "client_certificate_required"


class MemberCertificateRefused(ApiError):
    """A TLS client whose certificate claims a member identity this port does not grant it (keyroute.http.tls
    `PeerCheck`): every request of the connection is refused, and the connection closed."""

    status = 403
    code = "member_certificate_refused"


class LogIn(ApiError):
    """303 to the login form: how a browser page without a session is answered."""

    status = 303
    code = "login_required"

    def __init__(self) -> None:
        super().__init__(f"log in at {LOGIN_PATH}", {"Location": LOGIN_PATH, "Cache-Control": "no-store"})
