"""Request bodies built from the client's keyword arguments (shared by the sync and async shells)."""

from __future__ import annotations

from typing import Any, Sequence, TypedDict

from ..engine.errors import InvalidRequestError


def prefix_body(tokens, text, messages, tools, from_session, add_generation_prompt: bool, **extra) -> dict:
    body: dict[str, Any] = {k: v for k, v in (("tokens", list(tokens) if tokens is not None else None),
                                               ("text", text), ("messages", messages), ("tools", tools),
                                               ("from_session", from_session)) if v is not None}
    if add_generation_prompt:
        body["add_generation_prompt"] = True
    body.update({k: v for k, v in extra.items() if v is not None})
    return body


def release_query(immediate: bool, cascade_sessions: bool = False) -> dict | None:
    for name, v in (("immediate", immediate), ("cascade_sessions", cascade_sessions)):
        if not isinstance(v, bool):
            raise InvalidRequestError(f"{name} must be a boolean, got {v!r}")
    q = {**({"immediate": "true"} if immediate else {}), **({"cascade": "sessions"} if cascade_sessions else {})}
    return q or None


class SamplingArgs(TypedDict, total=False):
    """How a generation request samples (each left out or None: the server's default)."""

    temperature: float | None
    max_tokens: int | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    seed: int | None
    stop: Sequence[str] | None
    ignore_eos: bool


class CompletionArgs(SamplingArgs, total=False):
    """The keyword arguments of the clients' ``complete``: where it runs (``pool_id``, ``session_id``,
    ``overcommit``, ``shared_prefix_n_tokens``), how it samples, and ``extra_body``: more request
    fields (any field of the route's body, e.g. penalties), sent as given."""

    pool_id: int | None
    session_id: str | None
    overcommit: bool
    shared_prefix_n_tokens: int | None
    extra_body: dict | None


class ChatArgs(CompletionArgs, total=False):
    """The keyword arguments of the clients' ``chat_stream`` and ``chat``: ``complete``'s, and the tools."""

    tools: list[dict] | None
    tool_choice: Any
    parallel_tool_calls: bool | None


def _known(kw: dict, args: type, method: str) -> None:
    """A keyword argument ``args`` does not name is a TypeError, as it is for a declared signature."""
    for k in kw:
        if k not in args.__annotations__:
            raise TypeError(f"{method}() got an unexpected keyword argument {k!r}")


def sampling(kw: SamplingArgs) -> dict:
    stop = kw.get("stop")
    return {"temperature": kw.get("temperature"), "max_tokens": kw.get("max_tokens"), "top_p": kw.get("top_p"),
            "top_k": kw.get("top_k"), "min_p": kw.get("min_p"), "seed": kw.get("seed"),
            "stop": list(stop) if stop else None, "ignore_eos": kw.get("ignore_eos") or None}


def chat_request(messages: list[dict], kw: ChatArgs) -> dict:
    """The body of a chat completion request (``chat_stream``'s arguments)."""
    _known(dict(kw), ChatArgs, "chat_stream")
    return chat_body(messages, kw.get("tools"), kw.get("tool_choice"), kw.get("pool_id"), kw.get("session_id"),
                     kw.get("overcommit", False), kw.get("shared_prefix_n_tokens"), kw.get("parallel_tool_calls"),
                     sampling(kw), kw.get("extra_body"))


def completion_request(prompt: str | Sequence[int], kw: CompletionArgs) -> dict:
    """The body of a raw-text completion request (``complete``'s arguments)."""
    _known(dict(kw), CompletionArgs, "complete")
    return completion_body(prompt, kw.get("pool_id"), kw.get("session_id"), kw.get("overcommit", False),
                           kw.get("shared_prefix_n_tokens"), sampling(kw), kw.get("extra_body"))


def chat_body(messages, tools, tool_choice, pool_id, session_id, overcommit, shared_prefix_n_tokens,
              parallel_tool_calls, sampling_fields: dict, extra_body: dict | None = None) -> dict:
    body: dict[str, Any] = {"messages": messages}
    for k, v in (("tools", tools), ("tool_choice", tool_choice), ("pool_id", pool_id), ("session_id", session_id),
                 ("shared_prefix_n_tokens", shared_prefix_n_tokens), ("parallel_tool_calls", parallel_tool_calls)):
        if v is not None:
            body[k] = v
    if overcommit:
        body["overcommit"] = True
    body.update({k: v for k, v in sampling_fields.items() if v is not None})
    if extra_body:
        if not isinstance(extra_body, dict):
            raise InvalidRequestError("extra_body must be a dict of request fields")
        body.update(extra_body)
    return body


def completion_body(prompt: str | Sequence[int], pool_id, session_id, overcommit, shared_prefix_n_tokens,
                    sampling_fields: dict, extra_body: dict | None = None) -> dict:
    body = chat_body(None, None, None, pool_id, session_id, overcommit, shared_prefix_n_tokens, None, sampling_fields,
                     extra_body)
    del body["messages"]
    body["prompt"] = prompt if isinstance(prompt, str) else list(prompt)
    if "max_tokens" in body:
        body["n_predict"] = body.pop("max_tokens")
    return body


def checked_str(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{name} must be a non-empty string")
    return value
