"""The prefix of a pool body (create, fork, compact): exactly one of tokens / text / messages
(+ tools, rendered by the same chain as a chat request) / from_session."""

from __future__ import annotations

from ..engine.chat import render_chat
from ..engine.errors import InvalidRequestError
from .context import Context


def prefix_tokens(ctx: Context, body, from_session: str | None = None,
                  add_generation_prompt: bool = False) -> tuple[list[int] | None, str | None]:
    """(tokens, from_session) from exactly one prefix source of a pool body (``tokens`` / ``text`` /
    ``messages`` + ``tools``, or the body's ``from_session`` given by the caller)."""
    given = [name for name in ("tokens", "text", "messages") if getattr(body, name) is not None]
    if from_session is not None:
        given.append("from_session")
    if len(given) != 1:
        raise InvalidRequestError("give exactly one of tokens / text / messages / from_session"
                                  + (f" (got {', '.join(given)})" if given else ""))
    if body.tools is not None and body.messages is None:
        raise InvalidRequestError("tools are rendered with messages; give messages too")
    eng = ctx.engine
    if body.tokens is not None:
        return list(body.tokens), None
    if body.text is not None:
        if not body.text:
            raise InvalidRequestError("text must be a non-empty string")
        return eng.tokenize(body.text), None
    if body.messages is not None:
        text = render_chat(eng.tokenizer, body.messages, body.tools, add_generation_prompt=add_generation_prompt)
        return eng.tokenize(text), None
    return None, from_session
