"""Operation inputs (pydantic, strict: a wrong JSON type is a 400, never coerced): request bodies
and query parameters, validated the same way whether they come over HTTP or in-process.

Unknown fields are ignored (OpenAI and llama.cpp clients send fields we don't use), except in
the control-plane bodies, where a misspelt field would silently change nothing and is rejected.
Every generation body accepts the PolyKV fields ``pool_id``, ``session_id``,
``shared_prefix_n_tokens`` and ``overcommit``.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

StopField = Union[str, list[str], None]
PromptField = Union[str, list[int], list[str], list[list[int]]]


class _Lenient(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class PolyKVFields(_Lenient):
    pool_id: int | None = Field(None, description="attach to this pool (the shared prefix P is found automatically)")
    session_id: str | None = Field(None, description="the session whose KV cache outlives the request "
                                                     "(a new one is made when absent; returned in x-session-id)")
    shared_prefix_n_tokens: int | None = Field(None, description="explicit P (validated against the pool)")
    overcommit: bool = Field(False, description="bypass an enforced admission floor for this request")


class SamplingFields(_Lenient):
    temperature: float | None = Field(None, description="0 = greedy (default 0.8)")
    top_k: int | None = Field(None, description="0 or -1 = off (default 40)")
    top_p: float | None = Field(None, description="nucleus sampling (default 0.95)")
    min_p: float | None = Field(None, description="min-p sampling (default 0.05)")
    seed: int | None = Field(None, description="per-request seed (-1 or null = random)")
    stop: StopField = Field(None, description="strings that end generation")
    ignore_eos: bool = Field(False, description="keep generating past end-of-sequence")
    presence_penalty: float | None = Field(None, description="subtracted from the logit of every token already in "
                                                             "the penalty window (0 = off)")
    frequency_penalty: float | None = Field(None, description="subtracted per occurrence of a token in the penalty "
                                                              "window (0 = off)")
    repeat_penalty: float | None = Field(None, description="llama.cpp repetition penalty (1 = off)")
    repeat_last_n: int | None = Field(None, description="penalty window in tokens (-1 = whole context, 0 = off; "
                                                        "/completion: last 64 of prompt + output; OpenAI routes: "
                                                        "all generated tokens)")
    logit_bias: Any = Field(None, description="{\"token id\": bias} (OpenAI) or [[token id or text, bias or false]] "
                                              "(llama.cpp); false bans the token")
    post_sampling_probs: bool = Field(False, description="report probabilities after the sampling filters")
    json_schema: Any = Field(None, description="constrain the output to this JSON Schema (llama.cpp)")
    grammar: str | None = Field(None, description="constrain the output to this GBNF (llama.cpp) or Lark grammar")


class CompletionRequest(SamplingFields, PolyKVFields):
    """llama.cpp's ``POST /completion``."""

    prompt: PromptField = Field(..., description="text, token ids, or a one-element list of either")
    n_predict: int | None = Field(None, description="tokens to generate at most (-1 = until EOS / context)")
    max_tokens: int | None = Field(None, description="alias of n_predict")
    stream: bool = False
    n_probs: int = Field(0, description="top alternatives to report per token (completion_probabilities)")
    cache_prompt: bool = Field(True, description="accepted for compatibility; sessions always cache")
    return_tokens: bool = Field(False, description="include the generated token ids")
    id_slot: int | None = Field(None, description="accepted for compatibility; use session_id")
    response_format: dict[str, Any] | None = Field(None, description="{\"type\": \"json_object\", \"schema\": {...}} "
                                                                     "or OpenAI's json_schema form")


class StreamOptions(_Lenient):
    include_usage: bool = False


class OpenAICompletionRequest(SamplingFields, PolyKVFields):
    """OpenAI's legacy ``POST /v1/completions``."""

    model: str | None = None
    prompt: PromptField
    max_tokens: int | None = Field(None, description="tokens to generate at most (null = until EOS / context)")
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, description="top alternatives per token (0..20)")
    echo: bool = False
    suffix: str | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None


class ChatCompletionRequest(SamplingFields, PolyKVFields):
    """OpenAI's ``POST /v1/chat/completions``."""

    model: str | None = None
    messages: list[Any] = Field(..., description="OpenAI chat messages")
    tools: list[Any] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None


class TokenizeRequest(_Lenient):
    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(_Lenient):
    tokens: list[int]


class ApplyTemplateRequest(_Lenient):
    messages: list[Any]
    tools: list[Any] | None = None
    add_generation_prompt: bool = True


class _PrefixSource(_Strict):
    tokens: list[int] | None = Field(None, description="the full prefix [0, L) as token ids")
    text: str | None = Field(None, description="the full prefix as raw text (tokenized without specials)")
    messages: list[Any] | None = Field(None, description="chat messages rendered with the chat template")
    tools: list[Any] | None = Field(None, description="tools rendered with the messages (as a chat request would)")
    add_generation_prompt: bool = Field(False, description="end the rendered messages with the assistant header")
    from_session: str | None = Field(None, description="snapshot this idle session's cached context")


class CreatePoolRequest(_PrefixSource):
    pinned: bool = False
    label: str = ""


class ForkPoolRequest(_PrefixSource):
    branch_pos: int | None = Field(None, description="D: == parent prefix_len extends, < branches (default: extend)")
    pinned: bool = False
    label: str = ""


class AdmissionRequest(_Strict):
    target_tps_per_session: float | None = None
    mode: Literal["advisory", "enforced"] | None = None
    on_saturation: Literal["reject", "warn", "queue"] | None = None
    guarantee_min_sessions: int | None = None
    settle_tokens: int | None = None
    settle_max_ms: float | None = None
    queue_timeout_ms: float | None = None


class CompactRequest(_Strict):
    ancestor_pool_id: int
    tokens: list[int] | None = None
    text: str | None = None
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    branch_pos: int | None = None
    release_old: bool = True


class _Query(BaseModel):
    # query strings are text: numbers are parsed (lax), unknown parameters ignored
    model_config = ConfigDict(extra="ignore")


class CapacityQuery(_Query):
    expected_tokens: int | None = Field(None, ge=0, description="tokens the new session expects to use")
    session_id: str | None = Field(None, description="ask for this (existing) session")


class EventsQuery(_Query):
    pool_id: int | None = Field(None, description="only this pool's events")
    since: float | None = Field(None, description="only events after this wall-clock time")


class TpsHistoryQuery(_Query):
    session_id: str | None = Field(None, description="only this session's series")
    since: float | None = Field(None, description="only samples after this wall-clock time")
