"""Generation requests, transport-neutral: request body -> (tokens, SamplingParams, engine kwargs),
and the finished result -> the answer's shape. The HTTP routes and the in-process client both
use these; only the framing (SSE / JSON / Python objects) differs per transport.

``sampling_params`` is the one place a request body becomes ``SamplingParams``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from ..engine import SamplingParams
from ..engine.chat import ChatPrompt, normalize_tools
from ..engine.constraints import ConstraintSpec
from ..engine.errors import InvalidRequestError
from ..engine.persist.slots import generation_session_id, slot_number
from ..engine.results import GenerationResult, RequestInfo
from ..engine.chat.tool_calls import ToolCall, ToolStreamFilter, distinct_calls, resolve_tool_output
from .chat_continue import chat_prompt
from .constraints_request import constraint_from_request, logit_bias_from_request, penalty_kwargs
from .context import Context
from .schemas import MAX_CHOICES, ChatCompletionRequest, CompletionRequest, OpenAICompletionRequest, PolyKVFields, SamplingFields

FINISH_OPENAI = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}
STOP_TYPE_LLAMA = {"eos": "eos", "stop": "word", "length": "limit", "cancelled": "none"}


def sampling_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    default_max_tokens: int | None = None, *, openai: bool = False,
                    tokenize: Callable[[str], list[int]] | None = None,
                    constraint: ConstraintSpec | None = None, default_seed: int | None = None) -> SamplingParams:
    """Map request fields onto SamplingParams (unset fields keep the engine's llama.cpp-like defaults).

    ``max_tokens``: the body's limit (None: ``default_max_tokens``; -1: until EOS / context).
    ``openai``: OpenAI semantics for penalties and logit_bias ranges (the /v1 routes).
    ``tokenize``: for llama.cpp's text keys in ``logit_bias``. ``constraint``: the output constraint.
    ``default_seed``: the seed when the body gives none: the server's ``--seed`` (-1: a fresh seed)."""
    kw: dict[str, Any] = penalty_kwargs(repeat_penalty=body.repeat_penalty, repeat_last_n=body.repeat_last_n,
                                        presence_penalty=body.presence_penalty,
                                        frequency_penalty=body.frequency_penalty, openai=openai)
    if body.logit_bias:
        kw["logit_bias"] = logit_bias_from_request(body.logit_bias, tokenize or _no_text_keys, openai=openai)
    for name in ("temperature", "top_k", "top_p", "min_p"):
        v = getattr(body, name)
        if v is not None:
            kw[name] = v
    if body.seed is None:
        if default_seed is not None:
            kw["seed"] = default_seed
    elif body.seed != -1:  # -1: a fresh seed, also under --seed (llama.cpp's LLAMA_DEFAULT_SEED)
        kw["seed"] = body.seed
    if body.speculative_n_max is not None:
        kw["speculative_max"] = body.speculative_n_max
    if body.stop is not None:
        kw["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif max_tokens == -1:
        max_tokens = None
    return SamplingParams(max_tokens=max_tokens, ignore_eos=body.ignore_eos, logprobs=logprobs,
                          post_sampling_probs=body.post_sampling_probs, constraint=constraint, **kw)


def fit_context(ctx: Context, tokens: list[int], params: SamplingParams, stop_at_context: bool,
                extra: dict | None = None) -> SamplingParams:
    """llama.cpp's rule for a prompt that fits the context but not with ``max_tokens`` more: it is not
    refused, it generates until the context is full (``truncated: true``, llama.cpp's ``stop_type:
    limit``). ``stop_at_context``: where that rule applies — every limit on llama.cpp's own routes
    (``/completion``, ``/infill``); on the OpenAI routes only the server's default limit (``--n-predict``),
    as OpenAI's APIs give a request without ``max_tokens`` the rest of the context and refuse one whose
    explicit ``max_tokens`` does not fit (the Anthropic route's ``max_tokens`` is always explicit). A prompt
    longer than the context is refused everywhere, as llama.cpp does. ``extra`` (``Prepared.extra``)
    keeps the limit asked for under ``n_predict`` (what ``generation_settings`` echoes)."""
    n, limit = len(tokens), params.max_tokens
    if not stop_at_context or limit is None or n > ctx.engine.max_context or n + limit <= ctx.engine.max_context:
        return params
    if extra is not None:
        extra["n_predict"] = limit
    return dataclasses.replace(params, max_tokens=None)


def check_choices(n: int) -> None:
    """OpenAI ``n``: 1..MAX_CHOICES choices (``n > 1`` runs through ``server.choices``)."""
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidRequestError(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}")


def _no_text_keys(text: str) -> list[int]:
    raise InvalidRequestError(f"logit_bias keys must be token ids, got {text!r}")


def body_constraint(body: SamplingFields, **tool_fields: Any) -> ConstraintSpec | None:
    """The output constraint of a request: ``response_format`` / ``json_schema`` / ``grammar`` and,
    for chat, the tool-call constraint (``tool_fields``: see ``constraint_from_request``)."""
    return constraint_from_request(response_format=getattr(body, "response_format", None),
                                   json_schema=body.json_schema, grammar=body.grammar, **tool_fields)


def engine_kwargs(body: PolyKVFields) -> dict:
    """The PolyKV fields of a body as ``Engine.stream`` keyword arguments (validated)."""
    sid = generation_session_id(body.session_id, body.id_slot)  # llama.cpp's slot N is the session "N"
    if sid is not None and (not sid or not sid.isascii() or not sid.isprintable()):
        raise InvalidRequestError("session_id must be a non-empty string of printable ASCII characters "
                                  "(it is echoed in the x-session-id header)")
    pool_id = body.pool_id
    if body.shared_pool_slot is not None:  # the design's legacy name of pool_id
        if pool_id is not None and pool_id != body.shared_pool_slot:
            raise InvalidRequestError(f"shared_pool_slot ({body.shared_pool_slot}) is the legacy name of pool_id "
                                      f"({pool_id}); give one, or the same value in both")
        pool_id = body.shared_pool_slot
    return dict(session_id=sid, pool_id=pool_id, shared_prefix_n_tokens=body.shared_prefix_n_tokens,
                overcommit=body.overcommit, cache_salt=body.cache_salt)


@dataclass
class Prepared:
    """A generation ready to submit: ``engine.stream(tokens, params=params, **kwargs)``."""

    tokens: list[int]
    params: SamplingParams
    kwargs: dict
    prompt_text: str | None = None  # completion prompts given as text (or echoed)
    chat: ChatPrompt | None = None
    single_call: bool = False  # chat: parallel_tool_calls false
    extra: dict = field(default_factory=dict)


def _is_mixed(prompt) -> bool:
    """A list of token ids and texts (llama.cpp's ``[12, "text", 34]``): one prompt."""
    return (isinstance(prompt, list) and any(type(p) is int for p in prompt)
            and any(isinstance(p, str) for p in prompt))


def _completion_prompt(ctx: Context, prompt) -> tuple[list[int], str | None]:
    """(tokens, text) of a completion prompt: a string, token ids, ids and texts mixed (each text
    tokenized where it stands, as llama.cpp does), or a one-element list of any of them."""
    if isinstance(prompt, list) and len(prompt) == 1 and _is_mixed(prompt[0]):
        prompt = prompt[0]
    if _is_mixed(prompt):
        tokens: list[int] = []
        for p in prompt:
            tokens.extend(ctx.engine.tokenize(p) if isinstance(p, str) else (p,))
        return tokens, None
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise InvalidRequestError(f"one prompt per request is supported, got {len(prompt)}; "
                                      "send one request per prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        return ctx.engine.tokenize(prompt), prompt
    return (prompt if type(prompt) is list else list(prompt)), None  # not copied: the engine checks and copies


def prepare_completion(ctx: Context, body: CompletionRequest) -> Prepared:
    """llama.cpp ``/completion``."""
    kwargs = engine_kwargs(body)
    n_predict = body.n_predict if body.n_predict is not None else body.max_tokens
    params = sampling_params(body, n_predict, body.n_probs or None, ctx.default_max_tokens,
                             default_seed=ctx.default_seed,
                             tokenize=ctx.engine.tokenize, constraint=body_constraint(body))
    tokens, text = _completion_prompt(ctx, body.prompt)
    extra: dict = {}
    params = fit_context(ctx, tokens, params, True, extra)  # llama.cpp's route: stops at the context
    return Prepared(tokens, params, kwargs, prompt_text=text, extra=extra)


def prepare_openai_completion(ctx: Context, body: OpenAICompletionRequest) -> Prepared:
    """OpenAI ``/v1/completions``."""
    check_choices(body.n)
    if body.best_of not in (None, 1):
        raise InvalidRequestError("best_of must be 1")
    if body.suffix:
        raise InvalidRequestError("suffix (insertion) is not supported")
    kwargs = engine_kwargs(body)
    params = sampling_params(body, body.max_tokens, body.logprobs, ctx.default_max_tokens,
                             default_seed=ctx.default_seed, openai=True,
                             tokenize=ctx.engine.tokenize, constraint=body_constraint(body))
    tokens, text = _completion_prompt(ctx, body.prompt)
    params = fit_context(ctx, tokens, params, body.max_tokens is None)  # OpenAI: only the server's default
    if body.echo and text is None:
        text = ctx.engine.detokenize(tokens)
    return Prepared(tokens, params, kwargs, prompt_text=text)


def prepare_chat_request(ctx: Context, body: ChatCompletionRequest) -> Prepared:
    """OpenAI ``/v1/chat/completions``: render (``engine.chat.prepare_chat``), tokenize, sampling."""
    check_choices(body.n)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true")
    kwargs = engine_kwargs(body)
    if body.n > 1 and body.session_id is None:
        # llama.cpp's id_slot with several choices: the choices decode side by side in sessions of their own
        kwargs["session_id"] = None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    prompt = chat_prompt(ctx.engine.tokenizer, body.messages, body.tools, body.tool_choice,
                         body.add_generation_prompt, body.continue_final_message)
    constraint = body_constraint(body, tool_mode=prompt.choice.mode, tool_name=prompt.choice.name,
                                 tools=normalize_tools(body.tools), prefill=prompt.prefill,
                                 parallel_tool_calls=body.parallel_tool_calls is not False)
    params = sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                             ctx.default_max_tokens, default_seed=ctx.default_seed, openai=True,
                             tokenize=ctx.engine.tokenize, constraint=constraint)
    tokens = ctx.engine.tokenize(prompt.full_text)
    params = fit_context(ctx, tokens, params, max_tokens is None)  # OpenAI: only the server's default
    return Prepared(tokens, params, kwargs, chat=prompt, single_call=body.parallel_tool_calls is False)


class ChatTurn:
    """The assistant turn of a chat generation: ``feed`` each delta's text (returns the content to
    send now; tool-call text is held back), then ``finish`` (content still to send, tool calls,
    finish reason)."""

    def __init__(self, prepared: Prepared):
        chat = prepared.chat
        self.prompt = chat
        self.single_call = prepared.single_call
        self.filter = ToolStreamFilter(chat.choice, set(chat.names), chat.prefill)

    def feed(self, text: str) -> str:
        return self.filter.feed(text)

    def finish(self, result: GenerationResult) -> tuple[str, list[ToolCall], str]:
        content, calls = self.filter.finish()
        return (content, *self._calls_and_reason(calls, result))

    def whole(self, result: GenerationResult) -> tuple[str, list[ToolCall], str]:
        """For a non-streamed answer: the whole text at once."""
        p = self.prompt
        content, calls = resolve_tool_output(result.text, p.prefill, p.choice, set(p.names))
        return (content, *self._calls_and_reason(calls, result))

    def _calls_and_reason(self, calls, result) -> tuple[list[ToolCall], str]:
        # the same call (name and arguments) written twice in one turn is one call, whatever tool_choice and
        # parallel_tool_calls say: a small model repeating itself is not making parallel calls
        calls = distinct_calls(calls)
        if self.single_call:
            calls = calls[:1]
        if calls and result.stop_reason != "length":
            return calls, "tool_calls"
        return calls, FINISH_OPENAI.get(result.stop_reason, "stop")


def usage(info: RequestInfo, result: GenerationResult) -> dict:
    n = len(result.token_ids)
    return {"prompt_tokens": info.prompt_tokens, "completion_tokens": n, "total_tokens": info.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": info.cached_prefix_tokens}}


def opencoti_block(info: RequestInfo) -> dict:
    out = {"session_id": info.session_id, "pool_id": info.pool_id, "cached_prefix_tokens": info.cached_prefix_tokens}
    if info.admission is not None:
        out["admission"] = info.admission
    return out


def generation_settings(ctx: Context, params: SamplingParams, stream: bool = False,
                        n_predict: int | None = None) -> dict:
    """llama.cpp's ``generation_settings`` (``n_predict``: the limit asked for, when ``fit_context`` let
    the generation run to the context instead)."""
    if n_predict is None:
        n_predict = -1 if params.max_tokens is None else params.max_tokens
    return {"n_ctx": ctx.engine.max_context, "model": ctx.model_name, "n_predict": n_predict,
            "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p,
            "seed": params.seed if params.seed is not None else -1, "stop": list(params.stop),
            "ignore_eos": params.ignore_eos, "n_probs": params.logprobs or 0, "stream": stream,
            "logit_bias": settings_logit_bias(ctx, params)}


def settings_logit_bias(ctx: Context, params: SamplingParams) -> list[dict]:
    """llama.cpp's ``generation_settings.logit_bias``: ``[{"token", "bias"}]`` with null for -inf (a ban);
    ``ignore_eos`` shows as a ban of every end-of-generation token, as llama.cpp applies it."""
    bias = dict(params.logit_bias or {})
    if params.ignore_eos:
        bias.update({t: float("-inf") for t in ctx.engine.tokenizer.eos_token_ids})
    return [{"token": t, "bias": None if b == float("-inf") else b} for t, b in bias.items()]


def llama_final(ctx: Context, body: CompletionRequest, prepared: Prepared, info: RequestInfo,
                result: GenerationResult, content: str) -> dict:
    """llama.cpp's final ``/completion`` answer (``content`` is empty on the last event of a stream)."""
    return {
        "index": 0, "content": content, "tokens": list(result.token_ids) if body.return_tokens else [],
        "id_slot": slot_number(info.session_id), "stop": True, "model": ctx.model_name,
        "tokens_predicted": len(result.token_ids), "tokens_evaluated": info.prompt_tokens,
        "generation_settings": generation_settings(ctx, prepared.params, body.stream, prepared.extra.get("n_predict")),
        "prompt": prepared.prompt_text or "",
        "has_new_line": "\n" in result.text, "truncated": result.truncated,
        "stop_type": STOP_TYPE_LLAMA.get(result.stop_reason, "none"), "stopping_word": result.stopping_word,
        "tokens_cached": info.cached_prefix_tokens, "timings": result.timings,
        "session_id": info.session_id, "pool_id": info.pool_id, "opencoti": opencoti_block(info),
    }


def run_completion(ctx: Context, body: CompletionRequest) -> dict:
    """A whole (non-streamed) ``/completion`` in the calling thread (the in-process transport)."""
    prepared = prepare_completion(ctx, body)
    result = ctx.require_open().generate(prepared.tokens, params=prepared.params, **prepared.kwargs)
    return llama_final(ctx, body, prepared, result.info, result, result.text)
