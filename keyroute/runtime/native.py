"""What the compiled build (setup.py: `KEYROUTE_COMPILE=1`, mypyc) needs said in the source; nothing in the
pure build.

`@mypyc_attr(allow_interpreted_subclasses=True)` on a class that code left interpreted subclasses (the node's
data plane, tests' fakes): mypyc refuses interpreted subclasses of a compiled class unless told so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mypy_extensions import mypyc_attr
else:
    try:
        from mypy_extensions import mypyc_attr
    except ImportError:  # mypyc reads the decorator when it compiles; at run time it does nothing

        def mypyc_attr(*_names: str, **_flags: Any) -> Any:
            return lambda cls: cls


__all__ = ["caused", "mypyc_attr"]


def caused(error: BaseException, cause: BaseException) -> BaseException:
    """`error` with `cause` as its `__cause__`: `raise caused(error, exc)` for `raise error from exc`, whose
    cause the compiled build (mypyc) drops."""
    error.__cause__ = cause
    return error
