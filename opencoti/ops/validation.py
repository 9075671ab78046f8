"""Input validation shared by every transport: pydantic errors -> one readable InvalidRequestError."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from ..engine.errors import InvalidRequestError
from .schemas import SURROGATE_MESSAGE, lone_surrogate_path

M = TypeVar("M", bound=BaseModel)


def validate_json(model: type[M], data: Any) -> M:
    """Validate ``data`` exactly as a JSON body of an HTTP request is validated (a JSON round trip,
    so in-process callers get the same rules and messages as HTTP ones)."""
    where = lone_surrogate_path(data)
    if where is not None:
        raise InvalidRequestError(SURROGATE_MESSAGE.format(where=where))
    try:
        text = json.dumps(data)
    except (TypeError, ValueError, RecursionError) as e:
        raise InvalidRequestError(f"the request is not JSON-serializable: {e}") from None
    try:
        return model.model_validate_json(text)
    except ValidationError as e:
        raise InvalidRequestError(validation_message(e.errors())) from None


def validate_query(model: type[M], data: dict | None) -> M:
    try:
        return model.model_validate(data or {})
    except ValidationError as e:
        raise InvalidRequestError(validation_message(e.errors())) from None


def validation_message(errors: list[dict]) -> str:
    """One message for pydantic / FastAPI validation errors (``where: problem (got value)``; joined)."""
    parts: list[str] = []
    unions: dict[str, tuple[list[str], object]] = {}
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x not in ("body", "query", "path")]
        etype = err.get("type")
        if etype == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            parts.append(f"the request body is not valid JSON{': ' + str(detail) if detail else ''}")
            continue
        if etype == "invalid_unicode":
            parts.append(err.get("msg", "invalid Unicode text"))
            continue
        if etype == "missing" and not loc:
            parts.append("a JSON request body is required")
            continue
        if len(loc) >= 2 and ("[" in loc[-1] or loc[-1] in ("str", "int", "float", "bool", "dict", "list")):
            # one error per member of a union type: report them as one "expected one of"
            field = ".".join(loc[:-1])
            kinds, given = unions.setdefault(field, ([], err.get("input")))
            kinds.append(loc[-1])
            continue
        where = ".".join(loc) if loc else "request body"
        text = f"{where}: {err.get('msg', 'invalid value')}"
        given = err.get("input")
        if etype not in ("missing", "extra_forbidden") and not isinstance(given, (dict, list)):
            text += f" (got {short_repr(given)})"
        parts.append(text)
    for field, (kinds, given) in unions.items():
        parts.append(f"{field}: expected one of {' | '.join(kinds)} (got {short_repr(given)})")
    return "; ".join(parts) or "invalid request"


def short_repr(value: Any) -> str:
    try:
        s = json.dumps(value)
    except (TypeError, ValueError):
        s = repr(value)
    return s if len(s) <= 60 else s[:57] + "..."
