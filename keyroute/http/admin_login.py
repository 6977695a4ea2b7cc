"""The admin login of routers and nodes: a browser never carries the admin token in a URL.

    GET  /admin/login    a small self-contained form (one field, `token`)
    POST /admin/login    the token checked: 303 to the admin page (a router's /admin/ui, a node's partition
                         map) with the session cookie set (`keyroute_admin`: HttpOnly, SameSite=Strict,
                         Path=/admin, Secure when the request came over TLS; its value a MAC of the token,
                         keyroute.auth.security.BearerAuth.session), or 401. With access control on, the
                         token of a token-file caller with `admin = true` logs in as well (its cookie:
                         keyroute.auth.security.caller_session)
    POST /admin/logout   the cookie cleared, 303 to /admin/login

Every /admin endpoint then accepts the cookie as it accepts `Authorization: Bearer` (keyroute.http.admission).
The routes read the admin token from the app's admission checks (`app.state.admission.admin`).
"""

from __future__ import annotations

import html
from typing import Any
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from keyroute.api import BadRequest
from keyroute.auth.security import SESSION_COOKIE, SESSION_LIFETIME_S, BearerAuth
from keyroute.http import openapi
from keyroute.http.admission import LOGIN_PATH, LOGOUT_PATH, read_body
from keyroute.http.openapi import ApiRoute

AFTER_LOGIN = "/admin/ui"
COOKIE_PATH = "/admin"
# A login form is a few dozen bytes; anything much larger is not one.
_MAX_FORM_BYTES = 8192
_FORM_TIMEOUT_S = 10.0
_HEADERS = {
    "cache-control": "no-store",
    "x-frame-options": "DENY",
    "content-security-policy": "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
    "frame-ancestors 'none'",
    "referrer-policy": "no-referrer",
}

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>keyroute admin login</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body {{ font-family: system-ui, sans-serif; margin: 0; display: flex; justify-content: center; }}
form {{ margin-top: 15vh; display: flex; flex-direction: column; gap: .6em; min-width: 18em; }}
input, button {{ font: inherit; padding: .4em; }}
.error {{ color: #b00020; }}
</style></head>
<body><form method="post" action="{action}">
<h1>keyroute admin</h1>
{error}<label for="token">Admin token</label>
<input id="token" name="token" type="password" autocomplete="current-password" required autofocus>
<button type="submit">Log in</button>
</form></body></html>
"""


def _page(error: str = "", status: int = 200) -> HTMLResponse:
    shown = f'<p class="error" role="alert">{html.escape(error)}</p>\n' if error else ""
    return HTMLResponse(_PAGE.format(action=LOGIN_PATH, error=shown), status_code=status, headers=_HEADERS)


def _auth(request: Request) -> BearerAuth:
    auth: BearerAuth = request.app.state.admission.admin
    return auth


def _over_tls(request: Request) -> bool:
    # Behind a TLS-terminating proxy the request arrives as http; the proxy says what the browser used.
    forwarded = request.headers.get("x-forwarded-proto", "").split(",")[0].strip().lower()
    return request.url.scheme == "https" or forwarded == "https"


def _wants_html(request: Request) -> bool:
    return "text/html" in request.headers.get("accept", "")


def _after_login(request: Request) -> RedirectResponse:
    where = getattr(request.app.state, "after_login", AFTER_LOGIN)
    return RedirectResponse(where, status_code=303, headers={"cache-control": "no-store"})


def _callers(request: Request) -> Any:
    """The access check (keyroute.http.authn.Callers) when access control is on, else None."""
    return getattr(request.app.state.admission, "callers", None)


async def login_form(request: Request) -> Response:
    if not _auth(request).enabled and _callers(request) is None:  # /admin is open: nothing to log in to
        return _after_login(request)
    return _page()


async def login(request: Request) -> Response:
    auth, callers = _auth(request), _callers(request)
    body = await read_body(request, _MAX_FORM_BYTES, _FORM_TIMEOUT_S)
    # The field is read from the urlencoded form whatever the content type says (a browser sends that one).
    tokens = parse_qs(body.decode("latin-1"), keep_blank_values=True).get("token")
    if tokens is None:  # not the login form (whose field a browser always sends, empty or not)
        raise BadRequest("the login form has no `token` field")
    if not auth.enabled and callers is None:
        return _after_login(request)
    token = tokens[0]
    presented = token.strip().encode("latin-1", "replace")
    session = auth.session() if token and auth.enabled and auth.accepts(presented) else None
    if session is None and token and callers is not None:
        session = callers.login(presented)  # a token-file caller with `admin`
    if session is None:
        what = "the admin token" if callers is None else "the admin token or an admin caller's token"
        if _wants_html(request):
            return _page(f"That is not {what}.", status=401)
        return JSONResponse(
            {"error": "unauthorized", "message": f"the form's `token` is not {what}"},
            status_code=401,
            headers={"cache-control": "no-store"},
        )
    response = _after_login(request)
    response.set_cookie(
        SESSION_COOKIE,
        session,
        max_age=SESSION_LIFETIME_S,
        path=COOKIE_PATH,
        secure=_over_tls(request),
        httponly=True,
        samesite="strict",
    )
    return response


async def logout(request: Request) -> Response:
    response = RedirectResponse(LOGIN_PATH, status_code=303, headers={"cache-control": "no-store"})
    secure = _over_tls(request)
    response.delete_cookie(SESSION_COOKIE, path=COOKIE_PATH, secure=secure, httponly=True, samesite="strict")
    return response


def login_routes(after_login: str = AFTER_LOGIN) -> list[ApiRoute]:
    """The login, the form and the logout, for an app whose `state.admission` holds its admission checks;
    a login leads to `state.after_login` (default /admin/ui, the router's page; `after_login` says it in
    the API document)."""
    return [
        ApiRoute(LOGIN_PATH, _login_page, openapi.login_form(after_login), openapi.login(after_login)),
        ApiRoute(LOGOUT_PATH, logout, openapi.LOGOUT),
    ]


async def _login_page(request: Request) -> Response:
    return await (login(request) if request.method == "POST" else login_form(request))
