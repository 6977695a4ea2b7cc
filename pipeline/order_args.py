"""Where a store's aggregations order rows: the ordering argument (the second) of every `max_by` and `min_by`
call in their Spark SQL text, found without Spark, so a spec can be checked and the build can type what
those calls compare (keyroute.pipeline.ordering).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# A call of max_by or min_by: the name not part of a longer name (`my_max_by(`) or a qualified one.
_CALL = re.compile(r"(?<![A-Za-z0-9_.$])(max_by|min_by)\s*\(", re.IGNORECASE | re.ASCII)
_IDENT = re.compile(r"\s*(?:`([^`]+)`|([A-Za-z_][A-Za-z0-9_]*))\s*", re.ASCII)


def _masked(expression: str) -> str:
    """The expression with the inside of its string literals and quoted names blanked out (same length), so
    that parentheses, commas and call names are only found in the SQL itself."""
    out = list(expression)
    quote: str | None = None
    escaped = False
    for i, char in enumerate(expression):
        if quote is None:
            if char in "'\"`":
                quote = char
            continue
        if escaped:
            escaped = False
        elif char == "\\" and quote != "`":
            escaped = True
        elif char == quote:
            quote = None
            continue
        out[i] = "_"
    return "".join(out)


def ordering_spans(expression: str) -> list[tuple[int, int]]:
    """(start, end) of the ordering argument of every max_by/min_by call in `expression`, as written
    (spaces around it included), in order."""
    masked = _masked(expression)
    spans = []
    for call in _CALL.finditer(masked):
        depth, comma, end = 0, -1, -1
        for j in range(call.end(), len(masked)):
            char = masked[j]
            if char == "(":
                depth += 1
            elif char == ")":
                if depth == 0:
                    end = j
                    break
                depth -= 1
            elif char == "," and depth == 0:
                if comma >= 0:
                    end = j  # a third argument: the ordering is the second
                    break
                comma = j
        if comma >= 0 and end > comma:
            spans.append((comma + 1, end))
    return spans


def ordering_column(argument: str) -> str | None:
    """The column an ordering argument names (`ts`, `` `event time` ``), or None for an expression."""
    match = _IDENT.fullmatch(argument)
    if match is None:
        return None
    return match[1] if match[1] is not None else match[2]


def ordering_arguments(expressions: Iterable[str]) -> list[str]:
    """The ordering arguments of every max_by/min_by call in `expressions`, stripped, in order."""
    return [expr[start:end].strip() for expr in expressions for start, end in ordering_spans(expr)]


def replace_orderings(expression: str, replacement: dict[str, str]) -> str:
    """`expression` with each ordering argument that `replacement` has (by its stripped text) replaced."""
    for start, end in reversed(ordering_spans(expression)):
        new = replacement.get(expression[start:end].strip())
        if new is not None:
            expression = f"{expression[:start]} {new}{expression[end:]}"
    return expression
