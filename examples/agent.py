"""A ReAct agent (``create_agent``) with two ordinary tools, on opencoti.

``PolyKVMiddleware`` puts the system prompt + tools in a shared pool and runs each thread's model
calls in one session, so the second turn of a thread reuses the KV of the first: its
``usage_metadata["input_token_details"]["cache_read"]`` covers the whole first turn, not only the
system prompt.

    langgraph dev                       # serves `agent` (and the other examples) from this folder
    python agent.py                     # two turns on one thread, with a checkpointer

    input:  {"messages": [{"role": "user", "content": "What is the weather in Paris?"}]}

The agent binds only the tools it needs: every bound tool's schema is part of every prompt (the
six pool tools of ``polykv_tools`` add ~1,100 tokens). Add them (``TOOLS + polykv_tools(model)``)
for an agent that manages pools itself.
"""

from langchain.agents import create_agent
from langchain.agents.middleware import ModelCallLimitMiddleware
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from opencoti.langgraph import PolyKVMiddleware, model_from_env

SYSTEM = "You are a helpful assistant. Use a tool when it helps, then answer in one sentence."

model = model_from_env(temperature=0, max_tokens=96)  # in-process engine, loaded in the background


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"It is sunny and 22 degrees Celsius in {city}."


@tool
def add(a: float, b: float) -> float:
    """Add two numbers."""
    return a + b


TOOLS = [get_weather, add]


def build(checkpointer=None):
    """The agent; ``langgraph dev`` brings its own checkpointer, a script passes one."""
    # a small model may keep calling tools: at most 4 model calls per turn
    return create_agent(model, tools=TOOLS, system_prompt=SYSTEM, checkpointer=checkpointer,
                        middleware=[PolyKVMiddleware(), ModelCallLimitMiddleware(run_limit=4, exit_behavior="end")])


graph = build()


def main() -> None:
    agent = build(InMemorySaver())
    config = {"configurable": {"thread_id": "demo"}}
    for question in ("What is the weather in Paris?", "And in Rome?"):
        out = agent.invoke({"messages": [{"role": "user", "content": question}]}, config)
        last_call = next(m for m in reversed(out["messages"]) if isinstance(m, AIMessage) and m.usage_metadata)
        usage = last_call.usage_metadata
        print(f"> {question}\n{out['messages'][-1].text}\n  input tokens {usage['input_tokens']}, read from the KV "
              f"cache {usage['input_token_details']['cache_read']} (pool {out.get('pool_id')}, "
              f"session {out.get('session_id')})")


if __name__ == "__main__":
    main()
