"""OpenAI's strict mode (Structured Outputs): the rules a JSON Schema must follow when a request
sets ``"strict": true`` on a ``json_schema`` response format or on a tool function.

OpenAI refuses a strict schema that breaks them (400, ``invalid_request_error``) rather than
loosening or fixing it, and so does this server, with OpenAI's messages::

    Invalid schema for response_format 'joke': In context=('properties', 'author'),
    'additionalProperties' is required to be supplied and to be false.

The rules: the root is an object (not ``anyOf``); every object sets ``additionalProperties:
false`` and lists every property in ``required`` (an optional field is a union with ``null``);
the composition and object / array keywords OpenAI does not support (``allOf``, ``not``,
``if``/``then``/``else``, ``dependentRequired``, ``dependentSchemas``, ``patternProperties``,
``unevaluatedProperties``, ``propertyNames``, ``minProperties``, ``maxProperties``,
``unevaluatedItems``, ``contains``, ``minContains``, ``maxContains``, ``uniqueItems``) are
refused; at most 10 levels of object nesting, 5000 object properties and 1000 enum values.
A schema that passes compiles to a grammar that admits exactly the documents it describes (no
extra keys, no missing keys), which is what strict mode promises.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidRequestError

__all__ = ["check_strict_schema", "NOT_PERMITTED"]

NOT_PERMITTED = ("allOf", "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "patternProperties",
                 "unevaluatedProperties", "propertyNames", "minProperties", "maxProperties", "unevaluatedItems",
                 "contains", "minContains", "maxContains", "uniqueItems")
MAX_DEPTH = 10
MAX_PROPERTIES = 5000
MAX_ENUM_VALUES = 1000


class _Walk:
    def __init__(self, where: str):
        self.where = where
        self.properties = 0
        self.enum_values = 0

    def fail(self, ctx: tuple, problem: str) -> None:
        raise InvalidRequestError(f"Invalid schema for {self.where}: In context={ctx!r}, {problem}")

    def node(self, schema: Any, ctx: tuple, depth: int) -> None:
        if not isinstance(schema, dict):
            self.fail(ctx, f"schema must be a JSON object, got {type(schema).__name__} {schema!r}.")
        for key in NOT_PERMITTED:
            if key in schema:
                self.fail(ctx, f"'{key}' is not permitted.")
        if isinstance(schema.get("enum"), list):
            self.enum_values += len(schema["enum"])
            if self.enum_values > MAX_ENUM_VALUES:
                self.fail(ctx, f"the schema has more than {MAX_ENUM_VALUES} enum values in all.")
        types = schema.get("type")
        types = types if isinstance(types, list) else [types]
        if "object" in types or "properties" in schema:
            self.object(schema, ctx, depth + 1)
        if "items" in schema:
            items = schema["items"]
            if isinstance(items, list):
                self.fail(ctx, "'items' must be a schema, not a list (use 'prefixItems').")
            if items is not False:
                self.node(items, ctx + ("items",), depth)
        for i, sub in enumerate(schema.get("prefixItems") or ()):
            self.node(sub, ctx + ("prefixItems", i), depth)
        if "anyOf" in schema:
            options = schema["anyOf"]
            if not isinstance(options, list) or not options:
                self.fail(ctx, "'anyOf' must be a non-empty list of schemas.")
            for i, sub in enumerate(options):
                self.node(sub, ctx + ("anyOf", i), depth)
        for defs in ("$defs", "definitions"):
            if isinstance(schema.get(defs), dict):
                for name, sub in schema[defs].items():
                    self.node(sub, ctx + (defs, name), depth)

    def object(self, schema: dict, ctx: tuple, depth: int) -> None:
        if depth > MAX_DEPTH:
            self.fail(ctx, f"the schema nests objects more than {MAX_DEPTH} levels deep.")
        if schema.get("additionalProperties") is not False:
            self.fail(ctx, "'additionalProperties' is required to be supplied and to be false.")
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            self.fail(ctx, "'properties' must be an object.")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            self.fail(ctx, "'required' must be an array of property names.")
        missing = [k for k in props if k not in required]
        if missing:
            self.fail(ctx, "'required' is required to be supplied and to be an array including every key in "
                           f"properties. Missing '{missing[0]}'.")
        extra = [k for k in required if k not in props]
        if extra:
            self.fail(ctx, f"Extra required key '{extra[0]}' supplied.")
        self.properties += len(props)
        if self.properties > MAX_PROPERTIES:
            self.fail(ctx, f"the schema has more than {MAX_PROPERTIES} object properties in all.")
        for name, sub in props.items():
            self.node(sub, ctx + ("properties", name), depth)


def check_strict_schema(schema: Any, where: str) -> None:
    """Raise InvalidRequestError (OpenAI's message) if ``schema`` breaks strict mode's rules.
    ``where``: what the schema belongs to, e.g. ``"response_format 'joke'"`` or ``"function 'f'"``."""
    walk = _Walk(where)
    if not isinstance(schema, dict):
        walk.fail((), f"schema must be a JSON object, got {type(schema).__name__}.")
    if "anyOf" in schema and "type" not in schema:
        raise InvalidRequestError(f"Invalid schema for {where}: schema must be a JSON Schema of 'type: \"object\"', "
                                  "got 'anyOf' at the root (wrap the alternatives in a property).")
    if schema.get("type") != "object":
        raise InvalidRequestError(f"Invalid schema for {where}: schema must be a JSON Schema of 'type: \"object\"', "
                                  f"got 'type: \"{schema.get('type')}\"'.")
    walk.node(schema, (), 0)
