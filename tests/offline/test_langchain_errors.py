"""Errors a LangChain user meets are LangChain's own types (``langchain_core.exceptions``), on both
transports and on the OpenAI wire; connection errors name the URL and say what to do; a
``base_url`` ending in ``/v1`` (the ChatOpenAI habit) reaches the same routes."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import threading
import time
import warnings

import httpx
import pytest
import uvicorn
from langchain_core.exceptions import (ContextOverflowError, ModelAuthenticationError, ModelConnectionError,
                                       ModelError, ModelInvalidRequestError, ModelRateLimitError, ModelTimeoutError)
from starlette.testclient import TestClient

from opencoti.client import (APIConnectionError, APITimeoutError, ContextLengthError, PolyKVClient, PoolSaturatedError,
                             error_from_response)
from opencoti.langgraph import OpencotiChatModel
from opencoti.server import create_app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(engine):
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    t.join(10)


def test_engine_and_client_errors_are_langchain_types():
    assert issubclass(ContextLengthError, ContextOverflowError) and issubclass(ContextLengthError, ValueError)
    assert issubclass(PoolSaturatedError, ModelRateLimitError) and PoolSaturatedError("x").is_retryable
    assert not ContextLengthError("x").is_retryable  # LangChain's retry wrappers do not resend it
    refused = APIConnectionError("refused", retryable=True)
    assert isinstance(refused, ModelConnectionError) and refused.is_retryable
    assert not APIConnectionError("reset mid-request").is_retryable  # may have been applied: not resent
    assert isinstance(APITimeoutError("slow"), ModelTimeoutError) and isinstance(APITimeoutError("slow"), ModelError)
    auth = error_from_response(401, {"error": {"code": 401, "message": "Invalid API Key", "type": "a"}})
    assert isinstance(auth, ModelAuthenticationError)
    bad = error_from_response(400, {"error": {"code": 400, "message": "bad", "type": "invalid_request_error"}})
    assert isinstance(bad, ModelInvalidRequestError) and not isinstance(bad, ContextOverflowError)


def test_openai_context_error_code_is_mapped():
    # OpenAI's own shape: code is a name, not the status
    err = error_from_response(400, {"error": {"code": "context_length_exceeded", "message": "too long",
                                              "type": "invalid_request_error", "param": "messages"}})
    assert isinstance(err, ContextLengthError) and isinstance(err, ContextOverflowError) and err.status_code == 400
    ours = error_from_response(400, {"error": {"code": 400, "message": "too long", "type": "exceed_context_size_error",
                                               "n_prompt_tokens": 900, "n_ctx": 512}})
    assert isinstance(ours, ContextOverflowError) and (ours.n_prompt_tokens, ours.n_ctx) == (900, 512)


@pytest.mark.parametrize("transport", ["engine", "http"])
def test_chat_model_context_overflow_is_a_context_overflow_error(engine, transport):
    if transport == "engine":
        model = OpencotiChatModel(engine=engine, max_tokens=4)
        long = "a b " * engine.max_context
        with pytest.raises(ContextOverflowError):
            model.invoke(long)
    else:
        with TestClient(create_app(engine), raise_server_exceptions=False) as tc:
            model = OpencotiChatModel(base_url="http://testserver", http_client=tc, max_tokens=4)
            with pytest.raises(ContextOverflowError) as exc:
                model.invoke("a b " * engine.max_context)
            assert exc.value.n_ctx == engine.max_context


def test_connection_refused_names_the_url_and_what_to_do():
    port = _free_port()  # nothing listens there
    url = f"http://127.0.0.1:{port}"
    c = PolyKVClient(url, max_retries=0)
    with pytest.raises(APIConnectionError) as exc:
        c.health()
    msg = str(exc.value)
    assert f"{url}/health" in msg and "opencoti serve" in msg and "engine=" in msg, msg
    assert exc.value.url == f"{url}/health" and isinstance(exc.value, ModelConnectionError)
    c.close()
    model = OpencotiChatModel(base_url=url, max_retries=0)
    with pytest.raises(ModelConnectionError) as exc:
        model.invoke("hi")
    assert f"{url}/v1/chat/completions" in str(exc.value) and "opencoti serve" in str(exc.value)


def test_timeout_names_the_url():
    def slow(request):
        raise httpx.ReadTimeout("timed out", request=request)

    c = PolyKVClient("http://x", max_retries=0, http_client=httpx.Client(transport=httpx.MockTransport(slow)))
    with pytest.raises(APITimeoutError) as exc:
        c.pools()
    assert "GET http://x/polykv/pools" in str(exc.value) and isinstance(exc.value, ModelTimeoutError)


def test_base_url_with_v1_reaches_the_routes(server):
    for base in (server + "/v1", server + "/v1/", server + "/"):
        with PolyKVClient(base) as c:
            assert c.base_url == server
            assert c.health()
    model = OpencotiChatModel(base_url=server + "/v1", temperature=0, max_tokens=3)
    assert model.invoke("Hi").response_metadata["finish_reason"] in ("stop", "length")


def _assert_no_resource_warning(use) -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        use()
        gc.collect()
    leaked = [w for w in seen if issubclass(w.category, ResourceWarning)]
    assert not leaked, [str(w.message) for w in leaked]


def test_a_dropped_model_leaves_no_open_socket(server):
    def use() -> None:
        model = OpencotiChatModel(base_url=server, temperature=0, max_tokens=2)
        model.invoke("Hi")

    _assert_no_resource_warning(use)


def _open_sockets() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def test_async_calls_in_successive_loops_leave_no_open_socket(server):
    """ainvoke under asyncio.run, several times, then the model is dropped: every connection the
    async clients (one per event loop) opened is closed, with no ResourceWarning."""
    def use() -> None:
        model = OpencotiChatModel(base_url=server, temperature=0, max_tokens=2)
        for _ in range(3):
            asyncio.run(model.ainvoke("Hi"))

    gc.collect()
    before = _open_sockets()
    _assert_no_resource_warning(use)
    deadline = time.monotonic() + 10  # the server (in this process) closes its end once ours is closed
    while _open_sockets() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _open_sockets() <= before


def test_loop_clients_close_with_the_loop_or_when_dropped():
    from opencoti.client.loop_clients import LoopClients

    closed: list[int] = []

    class Recording(httpx.AsyncClient):
        async def aclose(self) -> None:
            closed.append(id(self))
            await super().aclose()

    clients = LoopClients(Recording)

    async def use() -> httpx.AsyncClient:
        a = clients.current()
        assert clients.current() is a  # one client per loop
        return a

    first = asyncio.run(use())
    second = asyncio.run(use())
    assert first is not second and first.is_closed and second.is_closed  # closed as asyncio.run shut down
    assert len(clients) == 0  # no finished loop kept

    async def dropped_while_running() -> None:
        owner = LoopClients(Recording)
        c = owner.current()
        del owner
        gc.collect()
        for _ in range(3):
            await asyncio.sleep(0)
        assert c.is_closed  # the loop ran the close while still running

    asyncio.run(dropped_while_running())

    async def explicit() -> None:
        c = clients.current()
        await clients.aclose()
        assert c.is_closed and len(clients) == 0
        assert clients.current() is not c  # a fresh one after an explicit close

    asyncio.run(explicit())
    assert len(closed) == 5
