"""LangChain's ``ChatOpenAI`` against a real ``opencoti serve`` (bundled model): structured output
with the default method (OpenAI ``response_format`` json_schema, decoded under the constraint)
and with ``method="function_calling"`` (a forced tool call, its arguments constrained to the
schema), at temperature 1.0 over several seeds; tool calls from ``bind_tools(tool_choice=...)``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.bundled

import langchain_openai  # noqa: E402 - the dev extra

API_KEY = "structured-key"


class Person(BaseModel):
    """A person."""

    name: str = Field(description="the person's name", min_length=1, max_length=24)
    age: int = Field(description="age in years", ge=0, le=130)
    city: str = Field(description="where they live", min_length=1, max_length=24)


class Add(BaseModel):
    """Add two integers."""

    a: int = Field(ge=-1000, le=1000)
    b: int = Field(ge=-1000, le=1000)


@pytest.fixture(scope="module")
def base_url(opencoti_cache, bundled_model):
    env = {**os.environ, "OPENCOTI_CACHE": str(opencoti_cache), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "opencoti", "serve", "--port", "0", "--api-key", API_KEY,
                             "--page-size", "16", "--kv-budget-tokens", "16384", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines, base = [], None
    deadline = time.monotonic() + 300
    while base is None:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, "server exited:\n" + "".join(lines)
        lines.append(line)
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        base = m.group(1) if m else None
        assert time.monotonic() < deadline, "".join(lines)
    import threading

    import httpx
    threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout], daemon=True).start()
    while httpx.get(base + "/health").status_code != 200:
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.2)
    yield base + "/v1"
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def chat(base_url, seed: int, **kw):
    return langchain_openai.ChatOpenAI(base_url=base_url, api_key=API_KEY, model="smollm2", temperature=1.0,
                                       seed=seed, max_tokens=120, max_retries=0, timeout=300, **kw)


@pytest.mark.parametrize("method", [None, "function_calling"])
def test_chatopenai_with_structured_output(base_url, method):
    kw = {} if method is None else {"method": method}
    for seed in range(4):
        llm = chat(base_url, seed).with_structured_output(Person, **kw)
        p = llm.invoke("Invent a person: give their name, age and city.")
        assert isinstance(p, Person) and 0 <= p.age <= 130 and 1 <= len(p.name) <= 24 and 1 <= len(p.city) <= 24


def test_chatopenai_bind_tools_required_and_named(base_url):
    for seed, choice in ((0, "any"), (1, "Add"), (2, "required")):
        msg = chat(base_url, seed).bind_tools([Add], tool_choice=choice).invoke("What is 17 plus 25?")
        (call,) = msg.tool_calls[:1]
        assert call["name"] == "Add" and set(call["args"]) == {"a", "b"}
        assert all(isinstance(call["args"][k], int) for k in "ab")
