"""GET /dashboard: the operator's live page (pool tree, KV by owner, capacity, tps, events, actions).

One static HTML file shipped inside the package (no build step, no external scripts: the charts are
drawn on a canvas by the page's own code). The page itself is public, like /health: it holds no
data and asks for the API key, which it then sends on every API call it makes (kept in the tab's
sessionStorage only).
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()

# served without an API key (the data routes it calls still need one)
DASHBOARD_PATHS = frozenset({"/dashboard", "/dashboard/"})


@lru_cache(maxsize=1)
def _page() -> str:
    return resources.files("opencoti.server").joinpath("dashboard/index.html").read_text(encoding="utf-8")


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
@router.get("/dashboard/", response_class=HTMLResponse, include_in_schema=False)
def dashboard() -> HTMLResponse:
    # the page must never be framed by another site, and runs only its own inline script
    return HTMLResponse(_page(), headers={
        "x-frame-options": "DENY", "cache-control": "no-cache",
        "content-security-policy": "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                   "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'"})
