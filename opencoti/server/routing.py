"""``JsonRoute``: every route's JSON body is parsed, and checked for lone surrogates, in a worker
thread before FastAPI validates it, so a large body never stalls the event loop (``/health`` and
live streams keep answering while a 15 MB request is read). A large body is also validated against
the route's body model there: FastAPI then gets the model instance, which it accepts as it is,
instead of validating megabytes on the event loop."""

from __future__ import annotations

import json
from types import UnionType
from typing import Annotated, Any, Callable, Union, get_args, get_origin

import anyio
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel

from ..ops.schemas import SURROGATE_MESSAGE, lone_surrogate_path, surrogates_checked
from . import json_steps

INLINE_BYTES = 64 * 1024  # smaller bodies are parsed on the loop: a thread hop costs more than they do


def _parse(body: bytes, field=None) -> Any:
    """The body parsed (in steps when large: ``json_steps``), checked for lone surrogates and, with
    ``field``, validated against the route's body model."""
    try:
        data = json.loads(body) if len(body) <= INLINE_BYTES else json_steps.loads(body)
    except json.JSONDecodeError as e:
        if len(body) <= INLINE_BYTES:
            return _Invalid  # FastAPI parses it again and reports the error in its usual shape
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg}}]) from None  # FastAPI's shape
    except UnicodeDecodeError:
        if len(body) <= INLINE_BYTES:
            return _Invalid
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": "the body is not UTF-8"}}]) from None
    except RecursionError:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "input": None,
                                       "ctx": {"error": "nested too deeply"}}]) from None
    where = lone_surrogate_path(data) if len(body) <= INLINE_BYTES else _surrogate_path(body, data)
    if where is not None:
        raise RequestValidationError([{"type": "invalid_unicode", "loc": ("body",), "input": None,
                                       "msg": SURROGATE_MESSAGE.format(where=where)}])
    if field is None:
        return data
    token = surrogates_checked.set(True)
    try:
        return _validate(field, data)
    finally:
        surrogates_checked.reset(token)


def _surrogate_path(body: bytes, data: Any) -> str | None:
    """``lone_surrogate_path(data)`` in bounded steps. A UTF-8 body with neither a ``\\u`` escape
    nor a byte 0xED (how UTF-8 would spell a surrogate) holds none."""
    if b"\\u" not in body and b"\xed" not in body and json.detect_encoding(body).startswith("utf-8"):
        return None

    def bad(v) -> bool:
        try:
            if isinstance(v, str):
                for i in range(0, len(v), 1 << 20):
                    v[i:i + (1 << 20)].encode("utf-8")
            else:
                json_steps.dumps(v).encode("utf-8")
            return False
        except UnicodeEncodeError:
            return True
        except (TypeError, ValueError):
            return False

    def walk(v, where: str) -> str | None:
        if isinstance(v, dict):
            for k, x in v.items():
                if isinstance(k, str) and bad(k):
                    return f"{where}.{k!r}" if where else repr(k)
                found = walk(x, f"{where}.{k}")
                if found is not None:
                    return found.lstrip(".")
            return None
        if isinstance(v, list) and len(v) > json_steps.SLICE:
            for i in range(0, len(v), json_steps.SLICE):
                if bad(v[i:i + json_steps.SLICE]):
                    for j in range(i, min(i + json_steps.SLICE, len(v))):
                        if bad(v[j]):
                            return lone_surrogate_path(v[j], f"{where}[{j}]").lstrip(".")
            return None
        return lone_surrogate_path(v, where) if bad(v) else None

    return walk(data, "")


def _validate(field, data: Any) -> Any:
    """``field.validate(data)`` as FastAPI calls it, raising its RequestValidationError. Long lists of
    integers (token ids) are checked here a slice at a time and stand in as one element while
    pydantic validates the body (a list of millions of ids is one long call into pydantic): every
    element an integer, they take the same branch of any union; then they are put back. A long list
    of integers with an element that is not one stands in as its first element and that one: the
    lists of the unions fail fast (``ops.schemas``), so they fail where the whole list would, and
    the errors name the element's index in the list that was sent."""
    stand_ins = _stand_in_id_lists(data, field.field_info.annotation)
    value, errors = field.validate(data, {}, loc=("body",))
    if stand_ins:
        originals = {id(short): original for _, short, original, _ in stand_ins}
        for path, short, original, _ in stand_ins:  # the body as it was sent
            _set(data, path, original)
        if errors:
            for err in errors:  # what an error shows is the body that was sent
                if id(err.get("input")) in originals:
                    err["input"] = originals[id(err["input"])]
                for path, _, _, bad in stand_ins:
                    if bad >= 0:
                        err["loc"] = _remap_index(tuple(err.get("loc", ())), path, bad)
        elif any(bad >= 0 for *_, bad in stand_ins) or not _put_back(value, stand_ins):
            value, errors = field.validate(data, {}, loc=("body",))  # (not as expected: validate what was sent)
    if errors:
        raise RequestValidationError(errors, body=None)
    return value


def _remap_index(loc: tuple, path: tuple, bad: int) -> tuple:
    """``loc`` of an error in a body whose list at ``path`` stood in as [first, element ``bad``]:
    index 1 of that list becomes ``bad``. Union member tags (strings) may sit between the parts."""
    i, want = 1, list(path)  # loc[0] is "body"
    while i < len(loc) and want:
        if loc[i] == want[0] and type(loc[i]) is type(want[0]):
            want.pop(0)
        elif not isinstance(loc[i], str):
            return loc  # another place of the body
        i += 1
    while i < len(loc) and isinstance(loc[i], str):
        i += 1
    if want or i >= len(loc) or loc[i] != 1:
        return loc
    return loc[:i] + (bad,) + loc[i + 1:]


def _long_ids(v: Any) -> int | None:
    """For a long list that starts with an integer: -1 when every element is one, else the index of
    the first that is not (an integer's type is ``int``: a bool is not); None for anything else."""
    if type(v) is not list or len(v) <= json_steps.SLICE or type(v[0]) is not int:
        return None
    for i in range(0, len(v), json_steps.SLICE):
        chunk = v[i:i + json_steps.SLICE]
        if set(map(type, chunk)) != {int}:
            return i + next(j for j, x in enumerate(chunk) if type(x) is not int)
    return -1


def _admits_ids(tp: Any, depth: int) -> bool:
    """Whether the type ``tp`` accepts a list of ints (``depth`` 1) or a list of them (2)."""
    origin = get_origin(tp)
    if origin is Annotated:
        return _admits_ids(get_args(tp)[0], depth)
    if origin in (Union, UnionType):
        return any(_admits_ids(a, depth) for a in get_args(tp))
    if origin is list and len(get_args(tp)) == 1:
        arg = get_args(tp)[0]
        while get_origin(arg) is Annotated:
            arg = get_args(arg)[0]
        return arg is int if depth == 1 else _admits_ids(arg, depth - 1)
    return False


def _stand_in_id_lists(data: Any, model: Any) -> list[tuple[tuple, list, list, int]]:
    """Replace each long list of integers in ``data`` (a member of the body object, or an element
    of such a member) whose field accepts a list of integers by a short one: [first] when every
    element is an integer (the list validates exactly as its stand-in does), [first, element k]
    when element k is the first that is not; returns (path, stand-in, original, k or -1) of each."""
    out: list = []
    if not isinstance(data, dict) or not (isinstance(model, type) and issubclass(model, BaseModel)):
        return out
    fields = {(f.alias or name): f.annotation for name, f in model.model_fields.items()}

    def stand_in(path: tuple, v: Any) -> None:
        bad = _long_ids(v)
        if bad is not None:
            out.append((path, [v[0]] if bad < 0 else [v[0], v[bad]], v, bad))

    for k, v in data.items():
        if k not in fields:
            continue
        if _admits_ids(fields[k], 1):
            stand_in((k,), v)
        if type(v) is list and len(v) <= 1024 and _admits_ids(fields[k], 2):
            for j, x in enumerate(v):
                stand_in((k, j), x)
    for path, short, _, _ in out:
        _set(data, path, short)
    return out


def _set(root: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        root = root[key]
    root[path[-1]] = value


def _put_back(model: Any, stand_ins: list) -> bool:
    """Put the original lists into the validated model where their stand-ins came out (False, and
    nothing changed, when one is not found there as a one-element list)."""
    targets = []
    for path, short, original, _ in stand_ins:
        if not isinstance(model, BaseModel) or path[0] not in type(model).model_fields:
            return False
        holder, key = model.__dict__, path[0]
        if len(path) == 2:
            holder, key = holder[key], path[1]
            if type(holder) is not list or not 0 <= key < len(holder):
                return False
        if holder[key] != short:
            return False
        targets.append((holder, key, original))
    for holder, key, original in targets:
        holder[key] = original
    return True


class _Invalid:
    pass


def _is_model(field) -> bool:
    annotation = getattr(getattr(field, "field_info", None), "annotation", None)
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


class JsonRoute(APIRoute):
    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler
        # a single body model (FastAPI validates the whole body against it): validated in the thread
        field = self.body_field if not self._embed_body_fields and _is_model(self.body_field) else None

        async def parse_then_handle(request: Request):
            body = await request.body()
            if body:
                data = _parse(body) if len(body) <= INLINE_BYTES else \
                    await anyio.to_thread.run_sync(_parse, body, field)
                if data is not _Invalid:
                    request._json = data  # Starlette's cache: FastAPI's request.json() returns it
                    token = surrogates_checked.set(True)
                    try:
                        return await handler(request)
                    finally:
                        surrogates_checked.reset(token)
            return await handler(request)

        return parse_then_handle
