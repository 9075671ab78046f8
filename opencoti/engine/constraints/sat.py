"""Schemas that no JSON value satisfies: ``{"$ref": "#"}``, a ``$ref`` loop, an object whose required
property can only hold itself. A constraint built from one would end every generation at once
(an empty answer, a tool call without arguments), so the request is refused (400) instead.

The check is the productivity test of a grammar: a schema is satisfiable when a finite value fits
it. It starts from "no ``$ref`` target is satisfiable" and repeats until nothing changes, so a
target counts only once a finite value was found for it (a loop never finds one). Keywords are
read as far as they decide that question: ``anyOf``/``oneOf`` need one satisfiable branch,
``allOf`` every part, an object its required properties, an array its first ``minItems`` items;
contradictions between keywords (``"type": "string"`` with ``"minimum"``) are left to the grammar
compiler, which reports its own.
"""

from __future__ import annotations

from typing import Any

from ..checks import MAX_SCHEMA_DEPTH
from ..errors import InvalidRequestError

_MAX_PASSES = 64


def _pointer(root: Any, ref: str) -> Any:
    """The local target of ``ref`` (``#`` or ``#/json/pointer``), or ``...`` when it is not local."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return ...
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return ...
    return node


class _Sat:
    def __init__(self, root: Any):
        self.root = root
        self.known: dict[str, bool] = {}  # $ref -> satisfiable (this pass's assumption)
        self.refs: set[str] = set()

    def check(self, schema: Any, depth: int = 0) -> bool:
        if depth > MAX_SCHEMA_DEPTH or schema is True or not isinstance(schema, (dict, bool)):
            return True  # (too deep to judge: the grammar compiler has its own limits)
        if not isinstance(schema, dict):  # False
            return False
        ok = True
        ref = schema.get("$ref")
        if isinstance(ref, str):
            self.refs.add(ref)
            ok = self.known.get(ref, False) if _pointer(self.root, ref) is not ... else True
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list):
                ok = ok and any(self.check(s, depth + 1) for s in schema[key])
        if isinstance(schema.get("allOf"), list):
            ok = ok and all(self.check(s, depth + 1) for s in schema["allOf"])
        if isinstance(schema.get("enum"), list) and not schema["enum"]:
            ok = False
        return ok and self._object(schema, depth) and self._array(schema, depth)

    def _object(self, schema: dict, depth: int) -> bool:
        required = schema.get("required")
        if not isinstance(required, list):
            return True
        given = schema.get("properties")
        props = given if isinstance(given, dict) else {}
        extra = schema.get("additionalProperties", True)
        return all(self.check(props[name] if name in props else extra, depth + 1)
                   for name in required if isinstance(name, str))

    def _array(self, schema: dict, depth: int) -> bool:
        n = schema.get("minItems", 0)
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            return True
        given = schema.get("prefixItems")
        prefix = given if isinstance(given, list) else []
        items = schema.get("items", True)
        firsts = prefix[:n] + ([items] if n > len(prefix) else [])
        return all(self.check(s, depth + 1) for s in firsts)


def satisfiable(schema: Any) -> bool:
    """Whether some finite JSON value fits ``schema`` (as far as the keywords above decide)."""
    sat = _Sat(schema)
    sat.check(schema)
    for _ in range(_MAX_PASSES):
        before = dict(sat.known)
        for ref in sorted(sat.refs):
            target = _pointer(schema, ref)
            if target is not ...:
                sat.known[ref] = sat.check(target)
        if sat.known == before:
            break
    return sat.check(schema)


def check_satisfiable(schema: Any, what: str) -> None:
    """InvalidRequestError (400) when no JSON value satisfies ``schema``."""
    if not satisfiable(schema):
        raise InvalidRequestError(f"invalid {what}: no JSON value satisfies it (a $ref that only refers to "
                                  "itself, a required property that cannot hold any value, or a false schema)")
