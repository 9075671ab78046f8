"""Ray Serve's own ``PrefixCacheAffinityRouter`` on this deployment (``router="ray-prefix"``), to
compare our router with.

Ray's router reads the prompt from an argument of the handle call that has a ``messages`` or
``prompt`` attribute (Ray Serve LLM's ingress passes its ``ChatCompletionRequest`` objects). The
cluster's ingress passes the raw HTTP request instead (a dict: method, path, headers, body bytes),
in which Ray's router finds neither and raises ``ValueError`` on every request. This subclass only
changes where the text comes from: the JSON body's ``messages`` (chat), ``prompt`` (completions)
or ``content`` (llama.cpp's /completion), normalized by Ray's own code; requests without one (pool
and admin calls) carry no text, which Ray's router routes as power-of-two choices. The routing rule
(prefix tree of what was sent where, match-rate threshold, load-imbalance fallback) is Ray's,
unchanged.
"""

from __future__ import annotations

import json
from typing import Any

try:
    from ray.serve.llm.request_router import PrefixCacheAffinityRouter
except ImportError:  # ray.serve.llm's package imports pyarrow (ray[llm]); the router itself does not need it
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (  # noqa: F401
        PrefixCacheAffinityRouter,
    )


def request_prompt(args: Any) -> Any:
    """The ``messages`` / ``prompt`` / ``content`` of the first argument that has one: an object
    with the attribute (as Ray Serve LLM passes), a dict with the key, or a forwarded HTTP request
    (a dict whose ``body`` is JSON bytes). None when there is none."""
    for arg in args or ():
        obj = arg
        if isinstance(arg, dict) and isinstance(arg.get("body"), (bytes, bytearray, str)):
            try:
                obj = json.loads(arg["body"] or b"null")
            except (ValueError, UnicodeDecodeError):
                continue
        for key in ("messages", "prompt", "content"):
            value = obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)
            if value:
                return value
    return None


class RayPrefixAffinityRouter(PrefixCacheAffinityRouter):
    """``PrefixCacheAffinityRouter`` reading the prompt from the cluster's forwarded requests."""

    def _extract_text_from_request(self, pending_request) -> str | None:
        prompt = request_prompt(pending_request.args)
        if prompt is None:
            return None
        return self._normalize_prompt_to_string(prompt) or None
