"""Structured output for ``OpencotiChatModel.with_structured_output``: the bound model and its parser.

``json_schema`` (the default, as ChatOpenAI's) and ``json_mode`` constrain the answer where the server
decodes under constraints (``params.STRUCTURED_OUTPUT``); otherwise ``json_schema`` and
``function_calling`` force a call of a tool made from the schema.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.output_parsers import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.runnables import Runnable, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel

from . import params
from .convert import parse_json_answer


def structured_output(model: BaseChatModel, schema: dict | type, method: str, include_raw: bool,
                      strict: bool | None) -> Runnable[LanguageModelInput, dict | BaseModel]:
    """``model`` (an ``OpencotiChatModel``) bound for ``schema`` by ``method``, piped into the parser of its answer (with the raw
    message and any parsing error beside it where ``include_raw``)."""
    is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
    pyd: Any = schema if is_pydantic else None  # the class answers are validated into (None: a dict)

    def parse_answer(msg: Any) -> Any:
        return parse_json_answer(msg, pyd)

    llm: Runnable
    parser: Runnable
    constrained = params.STRUCTURED_OUTPUT and method in ("json_schema", "json_mode")
    if constrained:
        fmt: dict[str, Any] = {"type": "json_object"}
        if method == "json_schema":
            fn = convert_to_openai_tool(schema, strict=strict)["function"]
            fmt = {"type": "json_schema", "json_schema": {"name": fn["name"], "schema": fn["parameters"],
                                                          **({"strict": True} if strict else {})}}
        llm = model.bind(response_format=fmt, ls_structured_output_format={
            "kwargs": {"method": method, "strict": strict}, "schema": schema})
        parser = RunnableLambda(parse_answer)
    elif method in ("function_calling", "json_schema"):
        tool = convert_to_openai_tool(schema, strict=strict)
        name = tool["function"]["name"]
        llm = model.bind_tools([schema], tool_choice=name, strict=strict,
                              ls_structured_output_format={"kwargs": {"method": method, "strict": strict},
                                                           "schema": tool})
        parser = (PydanticToolsParser(tools=[pyd], first_tool_only=True) if is_pydantic
                  else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
    elif method == "json_mode":
        llm = model.bind(ls_structured_output_format={"kwargs": {"method": method}, "schema": schema})
        parser = RunnableLambda(parse_answer)
    else:
        raise ValueError(f"method must be function_calling | json_schema | json_mode, got {method!r}")
    if not include_raw:
        return llm | parser
    parser_assign = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    parser_none = RunnablePassthrough.assign(parsed=lambda _: None)
    with_fallback = parser_assign.with_fallbacks([parser_none], exception_key="parsing_error")
    return RunnableMap(raw=llm) | with_fallback

