"""Tokenizer: the one text <-> token-id interface the engine uses.

Two implementations behind one class:

* ``Tokenizer.from_hf(hf_tokenizer, vocab_size)`` wraps a transformers tokenizer
  (HF model directories and converted GGUF files); chat templates are rendered
  by transformers itself so every template feature it supports works.
* ``Tokenizer.byte_level(vocab_size)`` is a self-contained byte tokenizer for the
  tiny random-weight test models: ids 0..255 are bytes, then ChatML specials.

Message validation (roles, content shapes, tool calls) lives in
:mod:`opencoti.engine.chat`; ``apply_chat_template`` runs it first, so bad input
always surfaces as :class:`~opencoti.engine.errors.InvalidRequestError`.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any, Iterable, Sequence

from .chat import normalize_messages, normalize_tools
from .errors import InvalidRequestError

# Tokens that end a turn or a document in the model families we serve. Like
# llama.cpp's "end of generation" set: any of them that the tokenizer defines as
# a special token stops generation, even when the config names only one EOS.
END_OF_GENERATION_TOKENS = (
    "<|im_end|>",  # ChatML: SmolLM2, Qwen2/3
    "<|endoftext|>",  # SmolLM2, Qwen2/3, GPT-2 style documents
    "<|eot_id|>",  # Llama 3
    "<|end_of_text|>",  # Llama 3 base
    "<|eom_id|>",  # Llama 3.1 tool-call end of message
    "</s>",  # Llama 2 / Mistral
)

# ChatML with Hermes/Qwen-style tools, for the byte-level test tokenizer. Tool
# calls render as <tool_call>{json}</tool_call> so the output parser (chat.py)
# has one well-known format to recognise.
BYTE_LEVEL_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Function signatures:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, return <tool_call>{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- if not loop.first %}{{- raise_exception('the system message must be the first message') }}{%- endif %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>tool\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content }}"
    "{%- if message.tool_calls %}"
    "{%- for call in message.tool_calls %}"
    "{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>{\"name\": ' + (call.function.name | tojson) + ', \"arguments\": ' "
    "+ (call.function.arguments | tojson) + '}</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class Tokenizer:
    """Text <-> token ids, EOS ids and chat templates for one model.

    Attributes:
        vocab_size: rows of the model's embedding matrix; ids outside
            ``[0, vocab_size)`` are rejected. May exceed the tokenizer's own
            vocabulary (models pad their embeddings).
        eos_token_ids: every id that ends generation (tokenizer EOS, config and
            generation-config EOS ids, and known end-of-turn specials).
        bos_token_id: the BOS id, or None. Never added implicitly by
            ``encode(add_special_tokens=False)``.
        chat_template: the model's Jinja chat template, or None.
        special_token_ids: ids of special/control tokens (skipped by ``decode``
            with ``skip_special_tokens=True``).
    """

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    chat_template: str | None
    special_token_ids: frozenset[int]

    # -- constructors -------------------------------------------------------

    @staticmethod
    def from_hf(hf_tokenizer: Any, vocab_size: int, extra_eos: Iterable[int] = ()) -> "Tokenizer":
        """Wrap a transformers tokenizer.

        ``extra_eos`` adds EOS ids found elsewhere (config.json,
        generation_config.json); ids that are not below ``vocab_size`` are dropped.
        """
        return _HFTokenizer(hf_tokenizer, vocab_size, extra_eos)

    @staticmethod
    def byte_level(vocab_size: int = 320) -> "Tokenizer":
        """A built-in byte tokenizer: ids 0..255 are bytes, then ChatML specials.

        ``256 = <|endoftext|>``, ``257 = <|im_start|>`` (also BOS), ``258 = <|im_end|>``;
        ids 259..vocab_size-1 are reserved specials that decode to ``<|reserved_N|>``.
        EOS ids are ``(258, 256)``.
        """
        return _ByteTokenizer(vocab_size)

    # -- the interface ------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special-token strings in the text become their ids."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 decodes to U+FFFD. Raises on out-of-range ids."""
        raise NotImplementedError

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """Render OpenAI-style ``messages`` (and ``tools``) to prompt text.

        Raises InvalidRequestError when the model has no chat template, when a
        message is malformed, or when the template itself rejects the
        conversation (e.g. roles that don't alternate).
        """
        if not self.chat_template:
            raise InvalidRequestError(
                "this model has no chat template; use the completion endpoint with raw text"
            )
        normalized = normalize_messages(messages)
        normalized_tools = normalize_tools(tools)
        import jinja2  # a transformers dependency; imported late to keep imports cheap

        try:
            return self._render_chat(normalized, normalized_tools, bool(add_generation_prompt))
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}") from exc
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}") from exc

    def is_eos(self, token_id: int) -> bool:
        """Whether ``token_id`` ends generation."""
        return token_id in self.eos_token_ids

    # -- helpers for subclasses --------------------------------------------

    def _render_chat(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        raise NotImplementedError

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        out = []
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int):
                try:
                    i = int(i)  # numpy / torch integer scalars
                except (TypeError, ValueError):
                    raise InvalidRequestError(f"token ids must be integers, got {i!r}") from None
            if not 0 <= i < self.vocab_size:
                raise InvalidRequestError(f"token id {i} is out of range [0, {self.vocab_size})")
            out.append(i)
        return out


class _HFTokenizer(Tokenizer):
    """A transformers tokenizer behind the Tokenizer interface."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, extra_eos: Iterable[int]):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = int(vocab_size)
        self.bos_token_id = hf_tokenizer.bos_token_id
        self.chat_template = getattr(hf_tokenizer, "chat_template", None) or None
        if isinstance(self.chat_template, dict):  # named templates: use the default one
            self.chat_template = self.chat_template.get("default")
        added = hf_tokenizer.get_added_vocab()
        candidates: list[int | None] = [hf_tokenizer.eos_token_id, *extra_eos]
        candidates += [added.get(t) for t in END_OF_GENERATION_TOKENS]
        self.eos_token_ids = _unique_ids(candidates, self.vocab_size)
        specials = set(getattr(hf_tokenizer, "all_special_ids", ()))
        # Added tokens like <|im_start|> are control tokens even when a tokenizer
        # converted from GGUF doesn't list them among its "special" tokens.
        specials.update(added.values())
        self.special_token_ids = frozenset(i for i in specials if i is not None)

    def __repr__(self) -> str:
        return f"Tokenizer(hf={type(self.hf_tokenizer).__name__}, vocab_size={self.vocab_size})"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to encode must be a string, got {type(text).__name__}")
        return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = self._check_ids(ids)
        return self.hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _render_chat(self, messages, tools, add_generation_prompt):
        return self.hf_tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=self.chat_template,
        )


class _ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens plus three ChatML specials (for tiny test models)."""

    SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

    def __init__(self, vocab_size: int):
        num_base = 256 + len(self.SPECIALS)
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < num_base:
            raise ValueError(f"byte-level vocab_size must be an int >= {num_base}, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self._special_to_id = {s: 256 + i for i, s in enumerate(self.SPECIALS)}
        self._id_to_special = {i: s for s, i in self._special_to_id.items()}
        self._split = re.compile("(" + "|".join(re.escape(s) for s in self.SPECIALS) + ")")
        self.bos_token_id = self._special_to_id["<|im_start|>"]
        self.eos_token_ids = (self._special_to_id["<|im_end|>"], self._special_to_id["<|endoftext|>"])
        self.special_token_ids = frozenset(range(256, vocab_size))
        self.chat_template = BYTE_LEVEL_CHAT_TEMPLATE

    def __repr__(self) -> str:
        return f"Tokenizer(byte_level, vocab_size={self.vocab_size})"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to encode must be a string, got {type(text).__name__}")
        ids: list[int] = []
        for piece in self._split.split(text):
            special = self._special_to_id.get(piece)
            if special is not None:
                ids.append(special)
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        parts: list[str] = []
        buf = bytearray()
        for i in self._check_ids(ids):
            if i < 256:
                buf.append(i)
                continue
            if skip_special_tokens:
                continue
            parts.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            parts.append(self._id_to_special.get(i, f"<|reserved_{i}|>"))
        parts.append(buf.decode("utf-8", errors="replace"))
        return "".join(parts)

    def _render_chat(self, messages, tools, add_generation_prompt):
        return _jinja_template(self.chat_template).render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token="<|im_start|>",
            eos_token="<|im_end|>",
        )


def _unique_ids(candidates: Iterable[Any], vocab_size: int) -> tuple[int, ...]:
    """Flatten ints / lists of ints, drop None and out-of-range ids, keep first-seen order."""
    out: list[int] = []
    for c in candidates:
        for i in c if isinstance(c, (list, tuple)) else (c,):
            if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size and i not in out:
                out.append(i)
    return tuple(out)


_TEMPLATE_CACHE: dict[str, Any] = {}


def _jinja_template(source: str):
    """Compile a chat template in a sandbox configured like transformers' own."""
    template = _TEMPLATE_CACHE.get(source)
    if template is None:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise InvalidRequestError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        template = _TEMPLATE_CACHE[source] = env.from_string(source)
    return template
