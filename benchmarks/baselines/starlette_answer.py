"""A Starlette app answering every key read with one fixed JSON body: what the machine charges for the
framework alone (uvicorn, httptools, uvloop), for benchmarks/router.py to compare this machine with the one
where keyroute's targets were set. `python benchmarks/baselines/starlette_answer.py PORT`."""

from __future__ import annotations

import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

BODY = b'{"store":"bench","key":"customer-00000001","partition":3,"version":1,"value":{"v":1,"name":"x"}}'


async def read(request: Request) -> Response:
    return Response(BODY, media_type="application/json")


app = Starlette(routes=[Route("/stores/{store}/keys/{key:path}", read)])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), http="httptools", loop="uvloop", log_level="warning")
