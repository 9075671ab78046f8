"""Tool calling (pure functions): the template capability probe and tool injection of the chat
chain (engine/chat/) for templates that ignore tools, tool_choice, and the tool-call parser
(engine/chat/tool_calls.py: whole output and streaming)."""

from __future__ import annotations

import json

import pytest

from opencoti.engine.errors import InvalidRequestError
from opencoti.engine.chat import (TemplateCaps, inject_tools, normalize_messages, normalize_tools,
                                  probe_template_caps, render_chat, template_caps)
from opencoti.engine.chat.tokenizer import Tokenizer
from opencoti.engine.chat.tool_calls import (ToolChoice, ToolStreamFilter, forced_call_fallback, parse_tool_calls,
                                        parse_tool_choice, resolve_tool_output, tool_choice_prefill)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NAMES = {"get_weather", "get_time"}


# A template like SmolLM2's: roles and content only; tools and tool_calls are ignored.
PLAIN_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def plain_template(messages, tools=None, add_generation_prompt=True):
    out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def plain_tokenizer() -> Tokenizer:
    tok = Tokenizer.byte_level(320)
    tok.chat_template = PLAIN_TEMPLATE
    return tok


PLAIN = plain_tokenizer()


def prepare_messages(messages, tools, caps):
    return inject_tools(normalize_messages(messages), normalize_tools(tools), caps)


# ============================================================================ capabilities & rendering
def test_probe_plain_template_supports_nothing():
    assert probe_template_caps(plain_template) == TemplateCaps(False, False)


def test_probe_tool_aware_template(engine):
    # the tiny models' byte-level template renders tools and tool calls itself
    assert template_caps(engine.tokenizer) == TemplateCaps(True, True)
    assert template_caps(PLAIN) == TemplateCaps(False, False)
    assert render_chat(PLAIN, [{"role": "user", "content": "x"}]) == plain_template([{"role": "user", "content": "x"}])


def test_probe_template_that_raises_is_unsupported():
    def strict(messages, tools=None, add_generation_prompt=True):
        if tools or any(m.get("tool_calls") for m in messages):
            raise ValueError("no tools here")
        return plain_template(messages, tools, add_generation_prompt)

    assert probe_template_caps(strict) == TemplateCaps(False, False)


def test_tools_go_into_the_existing_system_message():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    text = render_chat(PLAIN, msgs, [WEATHER, TIME])
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER) in system and json.dumps(TIME) in system
    assert "<tool_call>" in system and text.endswith("<|im_start|>assistant\n")
    assert text.count("<|im_start|>system") == 1


def test_tools_without_a_system_message_get_one():
    text = render_chat(PLAIN, [{"role": "user", "content": "hi"}], [WEATHER])
    assert text.startswith("<|im_start|>system\n# Tools") and "get_weather" in text


def test_tool_calls_and_results_are_rendered_as_text():
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    out, tools = prepare_messages(msgs, [WEATHER], TemplateCaps())
    assert tools is None  # the template gets none: they are in the system text
    assert out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert out[2] == {"role": "assistant",
                      "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'}
    assert out[3] == {"role": "tool", "content": "<tool_response>\n-3 C\n</tool_response>"}


def test_native_templates_get_tools_untouched():
    msgs = [{"role": "user", "content": "hi"}]
    out, tools = prepare_messages(msgs, [WEATHER], TemplateCaps(True, True))
    assert out == msgs and tools[0]["function"]["name"] == "get_weather"


def test_rendering_is_a_prefix_of_the_longer_conversation():
    """A pool made from [system] + tools must be a text prefix of a request that continues it."""
    system = [{"role": "system", "content": "S"}]
    pool = render_chat(PLAIN, system, [WEATHER], add_generation_prompt=False)
    req = render_chat(PLAIN, system + [{"role": "user", "content": "u"}], [WEATHER])
    assert req.startswith(pool)


@pytest.mark.parametrize("bad", [
    [{"role": "user"}],
    [{"role": "robot", "content": "x"}],
    "not a list",
])
def test_bad_messages_are_invalid_requests(bad):
    with pytest.raises(InvalidRequestError):
        render_chat(PLAIN, bad, None)


def test_bad_tools_are_invalid_requests():
    with pytest.raises(InvalidRequestError, match=r"tools\[0\].function.name"):
        render_chat(PLAIN, [{"role": "user", "content": "x"}],
                           [{"type": "function", "function": {"description": "no name"}}])


# ============================================================================ tool_choice
def test_tool_choice_values():
    assert parse_tool_choice(None, [WEATHER]) == ToolChoice("auto")
    assert parse_tool_choice(None, None) == ToolChoice("none")
    assert parse_tool_choice("none", [WEATHER]) == ToolChoice("none")
    assert parse_tool_choice("auto", None) == ToolChoice("none")  # nothing to call
    assert parse_tool_choice("required", [WEATHER, TIME]) == ToolChoice("required")
    assert parse_tool_choice("required", [WEATHER]) == ToolChoice("required", "get_weather")  # the only tool
    named = {"type": "function", "function": {"name": "get_time"}}
    assert parse_tool_choice(named, [WEATHER, TIME]) == ToolChoice("required", "get_time")
    for bad, tools in (("always", [WEATHER]), ("required", None), ({"type": "function", "function": {"name": "nope"}},
                                                                     [WEATHER]), ({"function": 3}, [WEATHER]), (7, [WEATHER])):
        with pytest.raises(InvalidRequestError):
            parse_tool_choice(bad, tools)


def test_prefill_forces_the_call_format():
    assert tool_choice_prefill(ToolChoice("auto")) == ""
    assert tool_choice_prefill(ToolChoice("required")) == '<tool_call>\n{"name": "'
    assert tool_choice_prefill(ToolChoice("required", "get_time")) == '<tool_call>\n{"name": "get_time", "arguments": '


# ============================================================================ parsing
def test_tagged_call():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                                      NAMES)
    assert content == "" and len(calls) == 1
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}
    assert calls[0].id.startswith("call_")
    d = calls[0].as_openai(index=0)
    assert d["index"] == 0 and d["type"] == "function" and d["function"]["name"] == "get_weather"


def test_several_tagged_calls_content_and_unterminated_last():
    text = ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}')
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert calls[1].arguments == "{}"


def test_a_closing_tag_inside_a_string_of_the_call_does_not_cut_it():
    # what the bundled model wrote, forced to call Person at temperature 1 (the grammar allows any
    # string): the name holds "</tool_call>"; the call is read as JSON first, then its closing tag
    args = {"name": "}}</tool_call>  # This <", "age": 28}
    text = '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(args) + '}\n</tool_call> after'
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "after" and len(calls) == 1 and json.loads(calls[0].arguments) == args
    f = ToolStreamFilter(ToolChoice("required", "get_weather"), NAMES, prefill='<tool_call>\n{"name": "get_weather", '
                         '"arguments": ')
    assert f.feed(json.dumps(args)[:20]) == "" and f.feed(json.dumps(args)[20:] + "}\n</tool_call>") == ""
    content, calls = f.finish()
    assert content == "" and json.loads(calls[0].arguments) == args
    # JSON followed by something other than the closing tag: the old reading (up to the first tag)
    content, calls = parse_tool_calls('<tool_call>{"name": "get_time", "arguments": {}} junk</tool_call>', NAMES)
    assert [c.name for c in calls] == ["get_time"] and content == ""


def test_list_inside_the_tags_and_parameters_key():
    # SmolLM2's own function-calling format is a JSON list inside <tool_call>
    text = '<tool_call>[{"name": "get_weather", "arguments": {"city": "B"}}, {"name": "get_time", "parameters": {}}]</tool_call>'
    _, calls = parse_tool_calls(text, NAMES)
    assert [c.name for c in calls] == ["get_weather", "get_time"]


def test_bare_json_object_and_fenced_list():
    _, calls = parse_tool_calls('  {"name": "get_weather", "arguments": "{\\"city\\": \\"C\\"}"}  ', NAMES)
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "C"}
    _, calls = parse_tool_calls('```json\n[{"name": "get_time", "arguments": {}}]\n```', NAMES)
    assert calls[0].name == "get_time"


@pytest.mark.parametrize("text", [
    "The weather is nice.",
    '{"city": "Paris"}',  # JSON, but not a call
    '{"name": "unknown_fn", "arguments": {}}',  # a function the request did not offer
    '{"name": "get_weather", "arguments": {}} and then some text',
    "<tool_call>not json</tool_call>",
    '<tool_call>{"name": "get_weather", "arguments": 5}</tool_call>',
    "[]",
])
def test_non_calls_stay_content(text):
    content, calls = parse_tool_calls(text, NAMES)
    assert calls == [] and content == text


def test_forced_function_fallbacks():
    # the prefill carries the name: the model only wrote the arguments
    content, calls = resolve_tool_output('{"city": "Rome"}}\n</tool_call>', tool_choice_prefill(
        ToolChoice("required", "get_weather")), ToolChoice("required", "get_weather"), NAMES)
    assert content == "" and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Rome"}
    assert forced_call_fallback("get_weather", '{"city": "X"} trailing').arguments == '{"city": "X"}'
    assert forced_call_fallback("get_weather", "Rome}</tool_call>").arguments == "Rome"  # raw text, as OpenAI warns
    # tool_choice none: never parsed
    assert resolve_tool_output('{"name": "get_time", "arguments": {}}', "", ToolChoice("none"), NAMES)[1] == []


# ============================================================================ streaming
def feed_all(filt: ToolStreamFilter, pieces):
    sent = "".join(filt.feed(p) for p in pieces)
    rest, calls = filt.finish()
    return sent + rest, calls


def test_stream_plain_content_passes_through_at_once():
    filt = ToolStreamFilter(ToolChoice("auto"), NAMES)
    assert filt.feed("Hello") == "Hello"
    assert filt.feed(" world") == " world"
    assert filt.finish() == ("", [])


def test_stream_holds_a_partial_tag_then_releases_it():
    filt = ToolStreamFilter(ToolChoice("auto"), NAMES)
    assert filt.feed("a <tool") == "a "
    assert filt.feed("box> b") == "<toolbox> b"
    assert filt.finish() == ("", [])


def test_stream_tagged_call_after_content():
    pieces = ["Checking", ". <tool_", 'call>{"name": "get_time",', ' "arguments": {}}</tool_call>']
    filt = ToolStreamFilter(ToolChoice("auto"), NAMES)
    sent = [filt.feed(p) for p in pieces]
    assert "".join(sent) == "Checking. "
    rest, calls = filt.finish()
    assert rest == "" and [c.name for c in calls] == ["get_time"]


def test_stream_bare_json_is_held_and_parsed():
    text, calls = feed_all(ToolStreamFilter(ToolChoice("auto"), NAMES),
                           ['{"name": "get_weather", ', '"arguments": {"city": "D"}}'])
    assert text == "" and calls[0].name == "get_weather"
    # JSON that is not a call comes out as content at the end
    text, calls = feed_all(ToolStreamFilter(ToolChoice("auto"), NAMES), ['{"a": ', "1}"])
    assert text == '{"a": 1}' and calls == []


def test_stream_with_prefill_and_tool_choice_none():
    prefill = tool_choice_prefill(ToolChoice("required", "get_time"))
    text, calls = feed_all(ToolStreamFilter(ToolChoice("required", "get_time"), NAMES, prefill), ["{}", "}</tool_call>"])
    assert text == "" and calls[0].name == "get_time" and calls[0].arguments == "{}"
    text, calls = feed_all(ToolStreamFilter(ToolChoice("none"), NAMES), ["<tool_call>", "x"])
    assert text == "<tool_call>x" and calls == []
