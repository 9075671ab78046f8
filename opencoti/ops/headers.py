"""The backpressure and tps a generation reports besides its body, in one place: the HTTP routes
write them as headers, the client's in-process transport reads the same values from the engine's
``RequestInfo`` (docs/http-api.md, "Sessions and pools on every generation route").

* ``X-Sessions-Remaining``: an enforced pool's ``sessions_remaining`` when it admitted this new
  session: how many new sessions fit at that moment, this one included (0: none fit, this one
  came in by the guarantee, ``warn`` or ``overcommit``; ``unknown``: a floor and nothing measured).
* ``x-admission-warning``: admitted past a full pool (``warn``, ``overcommit``).
* ``x-admission-retry-after``: when no other new session fits after this one, whole seconds until
  one is likely to (the estimate a 429 carries in ``Retry-After``). Not ``Retry-After`` itself:
  that one tells a client to wait before *any* follow-up, and a continuation of this session is
  never gated.
* ``x-session-tps``: the session's experienced decode tps. On an answer sent whole, this
  request's own rate (``timings.predicted_per_second``: its generated tokens after the first over
  the time between the first and the last); on a stream, whose headers leave before its first
  token, the rate the session was decoding at before this request (its ``tps_ewma`` when the
  request was accepted); absent when there is no measurement (fewer than two tokens, a new
  session's stream).
"""

from __future__ import annotations

import math
from typing import Any

from ..engine.results import RequestInfo


def whole_seconds(seconds: float | None) -> int | None:
    """A wait in whole seconds, rounded up, at least 1 (``Retry-After``'s form); None stays None."""
    if seconds is None or not math.isfinite(seconds):
        return None
    return max(1, math.ceil(seconds))


def admission_retry_after(admission: dict | None) -> int | None:
    return whole_seconds((admission or {}).get("retry_after"))


def tps_value(info: RequestInfo, timings: dict | None = None) -> float | None:
    """``x-session-tps``: this request's decode tps when it is done (``timings``), else the session's
    rate before it (``info.session_tps``); None without a measurement."""
    if timings is not None:
        v = timings.get("predicted_per_second")
        return float(v) if isinstance(v, (int, float)) and v > 0 else None
    v = info.session_tps
    return float(v) if v is not None and v > 0 else None


def sessions_remaining_header(v) -> str:
    """``X-Sessions-Remaining``: new sessions the pool could take when the gate decided, the
    request's own included, or ``unknown`` (a floor and nothing measured to project from)."""
    return v if v == "unknown" else str(int(v or 0))


def generation_headers(info: RequestInfo, timings: dict | None = None) -> dict[str, str]:
    """The headers of a generation answer: ``timings`` given for an answer sent whole (after the
    request ended), None for a stream (before its first token)."""
    h = {"x-session-id": info.session_id, "x-cached-prefix-tokens": str(info.cached_prefix_tokens)}
    if info.pool_id is not None:
        h["x-pool-id"] = str(info.pool_id)
    adm: dict[str, Any] | None = info.admission
    if adm is not None:
        if adm.get("sessions_remaining") is not None:
            h["X-Sessions-Remaining"] = sessions_remaining_header(adm["sessions_remaining"])
        if adm.get("warning"):
            h["x-admission-warning"] = str(adm["warning"]).encode("ascii", "replace").decode()
        retry = admission_retry_after(adm)
        if retry is not None:
            h["x-admission-retry-after"] = str(retry)
    tps = tps_value(info, timings)
    if tps is not None:
        h["x-session-tps"] = f"{tps:.2f}"
    return h
