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
        raise InvalidRequestError(validation_message([{**err, "loc": ("query", *err.get("loc", ()))}
                                                      for err in e.errors()])) from None


MAX_PROBLEMS = 8  # problems named in one message (the rest are counted)


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
        if etype == "extra_forbidden" and tuple(err.get("loc", ()))[:1] == ("query",) and loc:
            parts.append(f"unknown query parameter {loc[-1]!r}")
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
    if len(parts) > MAX_PROBLEMS:  # an error message stays short, whatever the body
        parts[MAX_PROBLEMS:] = [f"and {len(parts) - MAX_PROBLEMS} more problems"]
    return "; ".join(parts) or "invalid request"


def short_repr(value: Any, limit: int = 60) -> str:
    """``value`` as JSON (its repr if it is not JSON), cut to ``limit`` characters. Only what the
    cut keeps is rendered: a message never encodes megabytes of input."""
    try:
        value = _clip(value, [limit + 2], limit)
        s = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        s = repr(value)
    return s if len(s) <= limit else s[:limit - 3] + "..."


def _clip(value: Any, left: list[int], limit: int) -> Any:
    """``value`` without what its JSON would show after the first ``limit`` characters: each value
    visited renders at least one character, so once ``left`` runs out the rest is dropped, and a
    string is cut to ``limit`` characters."""
    left[0] -= 1
    if isinstance(value, str):
        return value[:limit + 1]
    if isinstance(value, (list, tuple)):
        out = []
        for x in value:
            if left[0] <= 0:
                break
            out.append(_clip(x, left, limit))
        return out
    if isinstance(value, dict):
        clipped = {}
        for k, x in value.items():
            if left[0] <= 0:
                break
            clipped[k[:limit + 1] if isinstance(k, str) else k] = _clip(x, left, limit)
        return clipped
    return value
