"""JSON in bounded steps.

``json.dumps`` and ``json.loads`` each handle a whole document in one C call that holds the GIL
throughout: for millions of token ids (a 15 MB body of ids, the answer of ``/tokenize`` on a 15 MB
text) that is a few hundred milliseconds in which no other thread runs - the event loop included,
even when the call happens in a worker thread. ``dumps`` and ``loads`` do the same work a slice at
a time (each slice one short C call, the GIL free for others in between) and give exactly what the
one-call functions give. Small documents take the one-call path. ``dumps_bytes`` gives the UTF-8 of
``dumps`` (each slice encoded on its own: one ``str.encode`` of a 15 MB answer is itself ~40 ms).
"""

from __future__ import annotations

import json
import re
from json.decoder import JSONDecodeError, scanstring
from typing import Any

from ..engine.chat.tokenizer import shared_ids

SLICE = 4096  # list elements per encoder call
STR_SLICE = 1 << 16  # characters of a long string per encoder call
_FEW = 64  # lists up to this long are walked element by element (an element may be large itself)
_DEPTH = 4  # how deep ``is_large`` looks for a long list

_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
_ASCII_ENCODER = json.JSONEncoder(ensure_ascii=True, allow_nan=False, separators=(",", ":"))


def is_large(obj: Any, depth: int = 0) -> bool:
    """Whether ``obj`` holds a list longer than ``SLICE`` or a string longer than ``STR_SLICE``
    within the first levels (cheap: it looks at dict values and short lists only)."""
    if isinstance(obj, str):
        return len(obj) > STR_SLICE
    if isinstance(obj, (list, tuple)):
        if len(obj) > SLICE:
            return True
        return depth < _DEPTH and len(obj) <= _FEW and any(is_large(x, depth + 1) for x in obj)
    if isinstance(obj, dict):
        return depth < _DEPTH and any(is_large(v, depth + 1) for v in obj.values())
    return False


def dumps(obj: Any, ensure_ascii: bool = False) -> str:
    """``json.dumps(obj, ensure_ascii=ensure_ascii, allow_nan=False, separators=(",", ":"))``, in
    steps when ``obj`` is large."""
    encoder = _ASCII_ENCODER if ensure_ascii else _ENCODER
    if not is_large(obj):
        return encoder.encode(obj)
    out: list[str] = []
    _emit(obj, out, encoder)
    return "".join(out)


def dumps_bytes(obj: Any) -> bytes:
    """``dumps(obj).encode("utf-8")``, each slice encoded on its own when ``obj`` is large. Text that
    is not valid Unicode (a lone surrogate) is sent ``\\u``-escaped: ``dumps(obj, ensure_ascii=True)``."""
    if not is_large(obj):
        try:
            return _ENCODER.encode(obj).encode("utf-8")
        except UnicodeEncodeError:
            return _ASCII_ENCODER.encode(obj).encode("ascii")
    out: list[str] = []
    _emit(obj, out, _ENCODER)
    try:
        return b"".join([part.encode("utf-8") for part in out])
    except UnicodeEncodeError:
        out.clear()
        _emit(obj, out, _ASCII_ENCODER)
        return b"".join([part.encode("ascii") for part in out])


def _key(k: Any, encoder: json.JSONEncoder) -> str:
    if isinstance(k, str):
        return encoder.encode(k)
    return encoder.encode({k: None})[1:-len(":null}")]  # json's own key conversion (int, float, bool, None)


def _emit(obj: Any, out: list[str], encoder: json.JSONEncoder) -> None:
    if isinstance(obj, dict):
        out.append("{")
        for i, (k, v) in enumerate(obj.items()):
            out.append("," if i else "")
            out.append(_key(k, encoder))
            out.append(":")
            _emit(v, out, encoder)
        out.append("}")
    elif isinstance(obj, (list, tuple)):
        out.append("[")
        if len(obj) <= _FEW:
            for i, v in enumerate(obj):
                out.append("," if i else "")
                _emit(v, out, encoder)
        else:
            for i in range(0, len(obj), SLICE):  # the GIL is free for other threads between slices
                out.append("," if i else "")
                out.append(encoder.encode(list(obj[i:i + SLICE]))[1:-1])
        out.append("]")
    elif isinstance(obj, str) and len(obj) > STR_SLICE:  # escapes are per character: slices join
        out.append('"')
        out += [encoder.encode(obj[i:i + STR_SLICE])[1:-1] for i in range(0, len(obj), STR_SLICE)]
        out.append('"')
    else:
        out.append(encoder.encode(obj))


# ============================================================================ loads
_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")
STEP_BYTES = 1 << 16  # smaller documents are parsed in one call
WINDOW = 1 << 15  # characters of array elements parsed per call
STRING_PIECE = 1 << 16  # characters of a long string decoded per call


def loads(data: bytes | str) -> Any:
    """``json.loads(data)``, in steps when ``data`` is large: containers are walked here, runs of
    numbers parsed ``WINDOW`` characters at a time, strings and other scalars by json's own scanner.
    Runs of token ids come out as shared objects (``engine.chat.tokenizer.shared_ids``). Raises
    ``json.JSONDecodeError`` (and ``RecursionError`` for absurd nesting) like ``json.loads``."""
    if isinstance(data, (bytes, bytearray)):
        if len(data) <= STEP_BYTES:
            return json.loads(data)
        data = data.decode(json.detect_encoding(data), "surrogatepass")
    if len(data) <= STEP_BYTES:
        return json.loads(data)
    if data.startswith("\ufeff"):
        raise JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", data, 0)
    value, end = _value(data, _WS.match(data, 0).end())
    end = _WS.match(data, end).end()
    if end != len(data):
        raise JSONDecodeError("Extra data", data, end)
    return value


def _value(s: str, i: int) -> tuple[Any, int]:
    c = s[i:i + 1]
    if c == "{":
        return _object(s, i + 1)
    if c == "[":
        return _array(s, i + 1)
    if c == '"':
        return _string(s, i + 1)
    try:
        return _DECODER.scan_once(s, i)  # a number, true, false, null (and json's NaN / Infinity)
    except StopIteration as e:
        raise JSONDecodeError("Expecting value", s, e.value) from None


def _object(s: str, i: int) -> tuple[dict, int]:
    out: dict = {}
    i = _WS.match(s, i).end()
    if s[i:i + 1] == "}":
        return out, i + 1
    while True:
        if s[i:i + 1] != '"':
            raise JSONDecodeError("Expecting property name enclosed in double quotes", s, i)
        key, i = scanstring(s, i + 1)
        i = _WS.match(s, i).end()
        if s[i:i + 1] != ":":
            raise JSONDecodeError("Expecting ':' delimiter", s, i)
        out[key], i = _value(s, _WS.match(s, i + 1).end())
        i = _WS.match(s, i).end()
        c = s[i:i + 1]
        if c == "}":
            return out, i + 1
        if c != ",":
            raise JSONDecodeError("Expecting ',' delimiter", s, i)
        i = _WS.match(s, i + 1).end()


def _array(s: str, i: int) -> tuple[list, int]:
    out: list = []
    i = _WS.match(s, i).end()
    if s[i:i + 1] == "]":
        return out, i + 1
    while True:
        # the elements up to the last comma of the next WINDOW characters, in one call: when that
        # text parses as a list it is exactly those elements (a cut inside a string, number or
        # container never parses); otherwise one element is parsed on its own
        k = s.rfind(",", i, i + WINDOW)
        if k > i:
            try:
                out.extend(shared_ids(json.loads("[" + s[i:k] + "]")))
            except (JSONDecodeError, RecursionError):
                pass
            else:
                i = _WS.match(s, k + 1).end()
                continue
        value, i = _value(s, i)
        out.append(value)
        i = _WS.match(s, i).end()
        c = s[i:i + 1]
        if c == "]":
            return out, i + 1
        if c != ",":
            raise JSONDecodeError("Expecting ',' delimiter", s, i)
        i = _WS.match(s, i + 1).end()


def _string(s: str, i: int) -> tuple[str, int]:
    """The string starting after the quote at ``i - 1``: a long one is decoded a piece at a time,
    cut where no escape sequence (nor a surrogate pair of them) can span the cut."""
    end = _string_end(s, i)
    if end < 0 or end - i <= STRING_PIECE:
        return scanstring(s, i)
    parts = []
    a = i
    while a < end:
        b = min(a + STRING_PIECE, end)
        while b < end and not _safe_cut(s, b):
            b += 1
        parts.append(scanstring('"' + s[a:b] + '"', 1)[0])
        a = b
    return "".join(parts), end + 1


def _safe_cut(s: str, b: int) -> bool:
    """Whether a string's text may be cut before ``b``: no escape sequence (at most 6 characters)
    spans it, and what follows is not the low half of a surrogate pair (kept with its high half)."""
    if s.rfind("\\", b - 5, b) != -1:
        return False
    h = s[b + 2:b + 4]
    return not (s.startswith("\\u", b) and len(h) == 2 and h[0] in "dD" and h[1] in "cdefCDEF")


def _string_end(s: str, i: int) -> int:
    """The index of the quote that closes the string starting at ``i`` (-1: none)."""
    j = s.find('"', i)
    while j != -1:
        k = j
        while s[k - 1] == "\\":
            k -= 1
        if (j - k) % 2 == 0:  # an even number of backslashes: the quote is not escaped
            return j
        j = s.find('"', j + 1)
    return -1
