"""Python's cyclic garbage collector, held back while a burst of allocation builds long-lived structures."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def without_cyclic_collection() -> Iterator[None]:
    """Python's cyclic garbage collector held back for a while (as it was before, after).

    The controller's placement and a whole read of the partition map allocate hundreds of thousands of small
    objects that form no cycles; meanwhile the collector would walk the whole heap again and again for
    nothing (a quarter of a recomputation at 1,000 nodes). Reference counting still frees everything that
    is dropped. Process-wide: a thread that enters while another is inside leaves it as it found it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
