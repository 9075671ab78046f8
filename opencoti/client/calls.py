"""Request bodies built from the client's keyword arguments (shared by the sync and async shells)."""

from __future__ import annotations

from typing import Any, Sequence

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


def sampling(temperature, max_tokens, top_p, top_k, min_p, seed, stop, ignore_eos) -> dict:
    return {"temperature": temperature, "max_tokens": max_tokens, "top_p": top_p, "top_k": top_k, "min_p": min_p,
            "seed": seed, "stop": list(stop) if stop else None, "ignore_eos": ignore_eos or None}


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
