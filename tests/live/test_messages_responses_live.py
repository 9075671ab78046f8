"""`opencoti serve` (bundled SmolLM2) through the clients of the Anthropic Messages and the OpenAI
Responses APIs: the official `anthropic` and `openai` SDKs, LangChain's ``ChatAnthropic`` and
``ChatOpenAI(use_responses_api=True)`` (invoke, stream, bind_tools with a forced tool,
with_structured_output), and a LangGraph ReAct agent on each that reuses its KV cache turn to turn."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.bundled

import anthropic  # noqa: E402 - the dev extra
import langchain_anthropic  # noqa: E402
import langchain_openai  # noqa: E402
import openai  # noqa: E402
from langchain_core.messages import HumanMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langgraph.checkpoint.memory import InMemorySaver  # noqa: E402
from langgraph.prebuilt import create_react_agent  # noqa: E402

API_KEY = "messages-key"
GREEDY = {"temperature": 0}  # the anthropic SDK leaves temperature to extra_body
WEATHER = {"name": "get_weather", "description": "Get the current weather for a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


class Person(BaseModel):
    """A person."""

    name: str = Field(description="the person's name", min_length=1, max_length=24)
    age: int = Field(description="age in years", ge=0, le=130)


@tool
def get_weather(city: str) -> str:
    """Get the current weather for a city."""
    return f"It is sunny and 21 C in {city}."


@pytest.fixture(scope="module")
def base(opencoti_cache, bundled_model):
    env = {**os.environ, "OPENCOTI_CACHE": str(opencoti_cache), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "opencoti", "serve", "--port", "0", "--api-key", API_KEY,
                             "--page-size", "16", "--kv-budget-tokens", "16384", "--weights", "int4",
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    lines, url = [], None
    deadline = time.monotonic() + 300
    while url is None:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, "server exited:\n" + "".join(lines)
        lines.append(line)
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        url = m.group(1) if m else None
        assert time.monotonic() < deadline, "".join(lines)
    threading.Thread(target=lambda: [lines.append(x) for x in proc.stdout], daemon=True).start()
    while httpx.get(url + "/health").status_code != 200:
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
        time.sleep(0.2)
    yield url
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


# ============================================================================ the SDKs
def test_anthropic_sdk(base):
    client = anthropic.Anthropic(base_url=base, api_key=API_KEY, max_retries=0)
    msgs = [{"role": "user", "content": "Say hello to Ada."}]
    msg = client.messages.create(model="smollm2", max_tokens=24, extra_body=GREEDY, system="Answer briefly.",
                                 messages=msgs)
    assert msg.type == "message" and msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.usage.output_tokens > 0
    with client.messages.stream(model="smollm2", max_tokens=24, extra_body=GREEDY, system="Answer briefly.",
                                messages=msgs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and text == final.content[0].text
    assert final.usage.cache_read_input_tokens > 0  # the same prompt, from the prefix cache
    n = client.messages.count_tokens(model="smollm2", system="Answer briefly.", messages=msgs).input_tokens
    assert n == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    forced = client.messages.create(model="smollm2", max_tokens=60, messages=[{"role": "user", "content": "Oslo?"}],
                                    tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
                                    extra_body=GREEDY)  # greedy, the model repeats its call: the repeat ends it
    (use,) = [b for b in forced.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input.get("city"), str) and forced.stop_reason == "tool_use"
    with pytest.raises(anthropic.BadRequestError, match="image input is not supported"):
        client.messages.create(model="smollm2", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
            model="smollm2", max_tokens=4, messages=msgs)


def test_openai_sdk_responses(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0)
    first = client.responses.create(model="smollm2", instructions="Answer briefly.", input="Name a color.",
                                    max_output_tokens=16, temperature=0)
    assert first.id.startswith("resp_") and first.output_text and first.output[0].id.startswith("msg_")
    second = client.responses.create(model="smollm2", instructions="Answer briefly.", input="Another one.",
                                     previous_response_id=first.id, max_output_tokens=16, temperature=0)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens  # turn 1 came from cache
    text, kinds = "", []
    with client.responses.stream(model="smollm2", input="Name a color.", instructions="Answer briefly.",
                                 max_output_tokens=16, temperature=0) as stream:
        for ev in stream:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                text += ev.delta
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert text and text == final.output_text
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 130}},
              "required": ["name", "age"], "additionalProperties": False}
    out = client.responses.create(model="smollm2", input="Invent a person.", max_output_tokens=60,
                                  text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                   "strict": True}})
    assert set(json.loads(out.output_text)) == {"name", "age"}
    tools = [{"type": "function", "name": "get_weather", "description": WEATHER["description"],
              "parameters": WEATHER["input_schema"]}]
    call = client.responses.create(model="smollm2", input="Weather in Oslo?", tools=tools, max_output_tokens=60,
                                   tool_choice={"type": "function", "name": "get_weather"}).output[0]
    assert call.type == "function_call" and call.name == "get_weather" and "city" in json.loads(call.arguments)
    answer = client.responses.create(model="smollm2", tools=tools, max_output_tokens=24, input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert answer.output_text
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model="smollm2", input="x", previous_response_id="resp_missing")


# ============================================================================ LangChain and LangGraph
def chat_anthropic(base, **kw):
    return langchain_anthropic.ChatAnthropic(base_url=base, api_key=API_KEY, model="smollm2", max_retries=0,
                                             **{"temperature": 0, "max_tokens": 60, **kw})


def chat_responses(base, **kw):
    return langchain_openai.ChatOpenAI(base_url=base + "/v1", api_key=API_KEY, model="smollm2", max_retries=0,
                                       use_responses_api=True, **{"temperature": 0, "max_tokens": 60, **kw})


@pytest.mark.parametrize("make", [chat_anthropic, chat_responses], ids=["ChatAnthropic", "ChatOpenAI-responses"])
def test_langchain_chat_models(base, make):
    llm = make(base)
    msg = llm.invoke("Say hello.")
    assert msg.text and msg.usage_metadata["output_tokens"] > 0
    again = llm.invoke("Say hello.")  # now from the prefix cache, as the stream's prompt is
    chunks = list(llm.stream("Say hello."))
    assert len(chunks) > 1 and "".join(c.text for c in chunks) == again.text
    streamed = sum(chunks[1:], chunks[0]).usage_metadata  # ChatAnthropic reads it from message_delta alone
    assert streamed["input_tokens"] == again.usage_metadata["input_tokens"] > 0, streamed
    if make is chat_anthropic:
        assert streamed["input_token_details"]["cache_read"] > 0, streamed  # the same prompt, from the cache
    for choice in ("get_weather", "any"):
        call = llm.bind_tools([get_weather], tool_choice=choice).invoke("What is the weather in Oslo?")
        assert call.tool_calls and call.tool_calls[0]["name"] == "get_weather"
        assert isinstance(call.tool_calls[0]["args"].get("city"), str)
    methods = ["function_calling", "json_schema"] if make is chat_anthropic else ["json_schema", "function_calling"]
    for method in methods:
        out = make(base, temperature=1.0).with_structured_output(Person, method=method, include_raw=True).invoke(
            "Invent a person: give their name and age.")
        if make is chat_anthropic and method == "json_schema":
            # the anthropic SDK moves the bounds Anthropic's structured outputs do not take (minLength,
            # maximum) into the descriptions before sending: the server is held to the schema it got
            value = json.loads(out["raw"].text)
            assert set(value) == {"name", "age"} and isinstance(value["name"], str) and type(value["age"]) is int
        else:
            assert out["parsing_error"] is None and isinstance(out["parsed"], Person) and out["parsed"].name


@pytest.mark.parametrize("make", [chat_anthropic, chat_responses], ids=["ChatAnthropic", "ChatOpenAI-responses"])
def test_langgraph_react_agent_reuses_its_kv_turn_to_turn(base, make):
    llm = make(base, max_tokens=40)
    forced, free = llm.bind_tools([get_weather], tool_choice="get_weather"), llm.bind_tools([get_weather])

    def model(state, runtime):  # a user turn starts with a weather lookup (the small model seldom calls one)
        return forced if state["messages"][-1].type == "human" else free

    agent = create_react_agent(model, [get_weather], checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "t1"}}
    agent.invoke({"messages": [HumanMessage("What is the weather in Oslo?")]}, config)
    state = agent.invoke({"messages": [HumanMessage("And in Rome?")]}, config)
    kinds = [m.type for m in state["messages"]]
    assert kinds[:4] == ["human", "ai", "tool", "ai"] and kinds.count("tool") >= 2, kinds
    assert "Rome" in [m for m in state["messages"] if m.type == "tool"][-1].text
    calls = [m.usage_metadata for m in state["messages"] if m.type == "ai"]
    assert len(calls) >= 4
    for before, after in zip(calls, calls[1:]):
        # each model call starts with the previous call's prompt: it comes from the KV cache
        assert after["input_token_details"]["cache_read"] >= 0.9 * before["input_tokens"], (before, after)
