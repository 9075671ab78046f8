"""``add_generation_prompt`` and ``continue_final_message`` for chat requests (vLLM's fields;
llama.cpp continues a trailing assistant message by itself).

* A trailing assistant message is continued (its text is the start of the answer, the reply
  carries only what follows) when ``continue_final_message`` is true, or when it is unset (the
  llama.cpp behaviour); ``continue_final_message: false`` with a trailing assistant message and
  ``add_generation_prompt`` true starts a new assistant turn after it.
* ``add_generation_prompt: false`` renders the conversation without opening an assistant turn.
* A conversation of one assistant message is continued from the assistant turn's opening.
* 400: both true at once; ``continue_final_message`` without a trailing assistant message; two or
  more assistant messages at the end; continuing a message while forcing a tool call.
"""

from __future__ import annotations

from typing import Any

from ..engine.chat import ChatPrompt, normalize_messages, normalize_tools, prepare_chat, render_chat
from ..engine.errors import InvalidRequestError
from ..engine.chat.tool_calls import parse_tool_choice, tool_choice_prefill, tool_names

__all__ = ["chat_prompt"]


_MARK = "OpencotiContinueHere7f3a"  # stands for the message's text while its turn is rendered


def _opening(tokenizer, last: dict, tools: Any) -> str:
    """What the template writes before an assistant message's text when that message is the whole
    conversation (rendered with a mark for its text, cut at the mark)."""
    text = render_chat(tokenizer, [{**last, "content": _MARK}], tools, add_generation_prompt=False)
    at = text.find(_MARK)
    if at < 0:
        raise InvalidRequestError("the chat template does not render an assistant message given alone: give the "
                                  "conversation before it")
    return text[:at]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # normalized content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def chat_prompt(tokenizer, messages: Any, tools: Any = None, tool_choice: Any = None,
                add_generation_prompt: bool | None = None, continue_final_message: bool | None = None) -> ChatPrompt:
    if add_generation_prompt is None and continue_final_message is None:
        msgs = normalize_messages(messages)
        if msgs[-1]["role"] != "assistant":
            return prepare_chat(tokenizer, messages, tools, tool_choice)
    msgs = normalize_messages(messages)
    trailing = 0
    for m in reversed(msgs):
        if m["role"] != "assistant":
            break
        trailing += 1
    if trailing >= 2:
        raise InvalidRequestError("the conversation ends with two or more assistant messages; merge them into one "
                                  "(only the final one can be continued)")
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true: continue "
                                  "the final assistant message, or open a new assistant turn")
    if continue_final_message and not trailing:
        raise InvalidRequestError("continue_final_message needs the conversation to end with an assistant message")
    cont = bool(trailing) and continue_final_message is not False and (
        continue_final_message or add_generation_prompt is not True)
    tool_list = normalize_tools(tools)
    choice = parse_tool_choice(tool_choice, tool_list)
    names = frozenset(tool_names(tool_list))
    if cont:
        last = msgs[-1]
        if last.get("tool_calls"):
            raise InvalidRequestError("a final assistant message with tool_calls cannot be continued")
        if choice.mode == "required":
            raise InvalidRequestError("continuing the final assistant message cannot be combined with a forced "
                                      "tool_choice")
        if len(msgs) > 1:
            text = render_chat(tokenizer, msgs[:-1], tool_list, add_generation_prompt=True)
        else:  # the assistant's message alone (a prefill without a question): its turn as the template opens it
            text = _opening(tokenizer, last, tool_list)
        return ChatPrompt(text + _text(last.get("content")), "", choice, names)
    agp = add_generation_prompt is not False
    if not agp and choice.mode == "required":
        raise InvalidRequestError("add_generation_prompt false cannot be combined with a forced tool_choice")
    text = render_chat(tokenizer, msgs, tool_list, add_generation_prompt=agp)
    return ChatPrompt(text, tool_choice_prefill(choice) if agp else "", choice, names)
