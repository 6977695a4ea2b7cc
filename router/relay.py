"""What of a node's reply the router passes on to its client: the reply's headers without the hop-by-hop ones
(`keyroute.http.forwarding.passthrough_headers`, in one pass over the pairs as they came), and the
X-Keyroute-Hops value found on the way, which tells a misrouted read."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from keyroute.api import HEADER_HOPS
from keyroute.http.forwarding import HOP_BY_HOP

_HOPS: Final = HEADER_HOPS.encode("ascii")
# Imported names a read uses, held where the compiled build (setup.py) reads them from C statics.
_HOP_BY_HOP: Final = HOP_BY_HOP
_HOP_LENGTHS: Final = sum(1 << n for n in {len(name) for name in HOP_BY_HOP})  # bit n: a hop-by-hop name has n bytes


def relayed(pairs: Sequence[Any]) -> tuple[list[Any], bytes | None]:
    """A node's reply headers as they are passed on (`passthrough_headers`: without the hop-by-hop ones and
    those its `connection` names), and its first X-Keyroute-Hops value, in one pass (lower-case names:
    FastUpstream's, or `NodeRequest.fetched` made them so). Each pair is relayed as the same tuple."""
    passed: list[Any] = []
    hops = None
    named: set[bytes] | None = None
    for pair in pairs:
        name: bytes = pair[0]
        # Only a name as long as a hop-by-hop one can be one: most are never looked up in the set.
        if not (_HOP_LENGTHS >> len(name)) & 1 or name not in _HOP_BY_HOP:
            passed.append(pair)
            if name == _HOPS and hops is None:
                hops = pair[1]
        elif name == b"connection":
            named = (named or set()) | {token.strip().lower() for token in pair[1].split(b",")}
    if named:
        passed = [(name, value) for name, value in passed if name not in named]
    return passed, hops
