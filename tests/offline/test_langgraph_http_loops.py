"""Over real HTTP (uvicorn on a free port, tiny model): async calls in successive event loops
(asyncio.run twice: the HTTP client is bound to the running loop, no "Event loop is closed"),
default_headers on the wire, and extra request fields reaching the server."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvicorn

from opencoti.client import AsyncPolyKVClient
from opencoti.langgraph import OpencotiChatModel
from opencoti.server import create_app


@pytest.fixture
def server(engine):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    seen: list[dict] = []
    app = create_app(engine)

    @app.middleware("http")
    async def record(request, call_next):
        seen.append(dict(request.headers))
        return await call_next(request)

    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", seen
    srv.should_exit = True
    t.join(10)


def test_async_calls_in_successive_event_loops(server):
    url, _ = server
    model = OpencotiChatModel(base_url=url, temperature=0, max_tokens=2)
    first = asyncio.run(model.ainvoke("hi"))
    assert first.response_metadata["finish_reason"] in ("stop", "length")
    batch = asyncio.run(model.abatch(["a", "b"]))  # a new loop: the first loop's connections are not reused
    assert len(batch) == 2
    client = AsyncPolyKVClient(url)
    assert asyncio.run(client.health())["status"] == "ok"
    assert asyncio.run(client.health())["status"] == "ok"


def test_default_headers_and_extra_fields_over_http(server):
    url, seen = server
    model = OpencotiChatModel(base_url=url, temperature=0, max_tokens=2, default_headers={"X-Team": "blue"})
    model.invoke("hi", extra_body={"repeat_penalty": 1.0})
    assert seen and seen[-1].get("x-team") == "blue"
    asyncio.run(model.ainvoke("hi"))
    assert seen[-1].get("x-team") == "blue"
    with pytest.raises(Exception, match="penalty"):  # the server validates what was passed through
        model.invoke("hi", extra_body={"repeat_penalty": -3.0})
