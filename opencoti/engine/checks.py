"""Type checks shared by the validated settings dataclasses (config, tps windows, admission policy),
and the one bound on how deeply a JSON schema may nest (every walk over a schema stays within it)."""

from __future__ import annotations

import math
from typing import Any, Iterable

from .errors import InvalidRequestError

# Levels of objects and arrays a JSON schema from a request may nest (a tool's parameters, a
# response format, a JSON schema constraint). Every walk over a schema (closing its objects,
# re-rooting its $refs, the satisfiability and strict-mode checks) recurses once per level: a
# request nested deeper is refused (400) before anything walks it, instead of running out of stack
# (a 500). The grammar compiler (llguidance) refuses JSON nested deeper than about 124 levels
# itself; this limit stays below it with room for the levels a tool call wraps around the
# parameters. Real schemas stay far below it (OpenAI's strict mode allows 10 levels of objects,
# each two levels here: "properties" and the property's schema).
MAX_SCHEMA_DEPTH = 100


def is_number(x) -> bool:
    """A finite int or float (a bool is not a number here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def is_int(x) -> bool:
    """An int that is not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def json_depth(value: Any, limit: int = MAX_SCHEMA_DEPTH) -> int:
    """How many levels of objects and arrays ``value`` nests (a scalar 0, ``{}`` 1, ``{"a": []}`` 2),
    counted without recursion and only up to ``limit + 1`` (deeper reads as ``limit + 1``)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, (dict, list, tuple)):
            continue
        children: Iterable[Any] = node.values() if isinstance(node, dict) else node
        deepest = max(deepest, depth)
        if depth > limit:
            return limit + 1
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, tuple)))
    return deepest


def schema_too_deep(what: str) -> InvalidRequestError:
    """The 400 of a schema nested deeper than ``MAX_SCHEMA_DEPTH`` (``what``: whose schema it is)."""
    return InvalidRequestError(f"invalid {what}: it nests objects and arrays more than {MAX_SCHEMA_DEPTH} levels "
                               "deep (MAX_SCHEMA_DEPTH, the limit on the nesting of a JSON schema)")


def check_schema_depth(schema: Any, what: str) -> None:
    """InvalidRequestError (400) when ``schema`` nests deeper than ``MAX_SCHEMA_DEPTH``."""
    if json_depth(schema) > MAX_SCHEMA_DEPTH:
        raise schema_too_deep(what)
