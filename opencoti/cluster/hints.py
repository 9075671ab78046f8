"""What the cluster router needs to know about a request: its routing hint.

The ingress reads each HTTP request once and derives a :class:`Hint`:

- ``pool_id``: the request names a pool (``/polykv/pools/{id}/...`` or ``"pool_id"`` in the body);
- ``session_id``: the request names a session (``/polykv/sessions/{id}/...``, ``"session_id"``
  in a generation body, ``"from_session"`` in a pool body);
- ``prefix``: a canonical text of the prompt (chat messages, completion prompt, or a pool's
  prefix) for prefix-affine placement of everything else;
- ``tag``: an explicit replica (the ingress's own fan-out calls).

The canonical prefix keeps message order and boundaries, so a pool created from ``messages`` is a
prefix of every chat request that starts with the same messages, and each turn of a conversation
is a prefix of the next one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

GENERATION_PATHS = frozenset({"/completion", "/completions", "/v1/completions", "/chat/completions",
                              "/v1/chat/completions"})
# GET routes answered by asking every replica and merging (see aggregate.py)
FANOUT_PATHS = frozenset({"/polykv/pools", "/polykv/tps", "/polykv/tps/history", "/polykv/events",
                          "/polykv/integrity", "/metrics", "/slots"})


@dataclass
class Hint:
    pool_id: int | None = None
    session_id: str | None = None
    prefix: str | None = None
    tag: int | None = None

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict | None) -> "Hint":
        d = d or {}
        return cls(pool_id=d.get("pool_id"), session_id=d.get("session_id"), prefix=d.get("prefix"),
                   tag=d.get("tag"))


def _text_of(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        out = []
        for part in content:
            if isinstance(part, dict):
                out.append(str(part.get("text", "")) if part.get("type", "text") == "text" else json.dumps(part))
            else:
                out.append(str(part))
        return "".join(out)
    return json.dumps(content, sort_keys=True)


def messages_key(messages, tools=None) -> str | None:
    """Canonical text of a chat prompt (None when ``messages`` is not a list of messages)."""
    if not isinstance(messages, list):
        return None
    parts = []
    if tools:
        parts.append("\x1dtools:" + json.dumps(tools, sort_keys=True) + "\x1d")
    for m in messages:
        if not isinstance(m, dict):
            return None
        extra = ""
        if m.get("tool_calls"):
            extra = json.dumps(m["tool_calls"], sort_keys=True)
        parts.append(f"{m.get('role', '')}\x1f{_text_of(m.get('content'))}{extra}\x1e")
    return "".join(parts)


def prompt_key(prompt) -> str | None:
    """Canonical text of a completion prompt: a string, token ids, or a one-element list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return "\x00" + ",".join(map(str, prompt)) + ","
    return None


def body_prefix(body: dict) -> str | None:
    """The canonical prefix of a generation body or a pool body."""
    if "messages" in body:
        return messages_key(body.get("messages"), body.get("tools"))
    for name in ("prompt", "text"):
        if name in body:
            return prompt_key(body[name])
    if "tokens" in body:
        return prompt_key(body["tokens"])
    return None


def _int_or_none(v) -> int | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, str) and v.isdigit():
        return int(v)
    return None


def parse_json(body: bytes) -> dict | None:
    if not body:
        return None
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def hint_for(method: str, path: str, body: bytes) -> Hint:
    """The routing hint of one HTTP request (path without the query string)."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 3 and parts[0] == "polykv" and parts[1] == "pools":
        pid = _int_or_none(parts[2])
        return Hint(pool_id=pid) if pid is not None else Hint()
    if len(parts) >= 3 and parts[0] == "polykv" and parts[1] == "sessions":
        return Hint(session_id=parts[2])
    if method != "POST":
        return Hint()
    obj = parse_json(body)
    if obj is None:
        return Hint()
    if path == "/polykv/pools":
        sid = obj.get("from_session")
        if isinstance(sid, str) and sid:
            return Hint(session_id=sid)
        return Hint(prefix=body_prefix(obj))
    if path in GENERATION_PATHS:
        sid = obj.get("session_id")
        pid = obj.get("pool_id") if obj.get("pool_id") is not None else obj.get("shared_pool_slot")  # legacy name
        return Hint(pool_id=_int_or_none(pid),
                    session_id=sid if isinstance(sid, str) and sid else None,
                    prefix=body_prefix(obj))
    return Hint()
