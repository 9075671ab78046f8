"""Tokenizer: the one text <-> token-id interface the engine uses.

Two implementations behind one class:

* ``Tokenizer.from_hf(hf_tokenizer, vocab_size)`` wraps a transformers tokenizer
  (HF model directories and converted GGUF files); chat templates are rendered
  by transformers itself so every template feature it supports works.
* ``Tokenizer.byte_level(vocab_size)`` is a self-contained byte tokenizer for the
  tiny random-weight test models: ids 0..255 are bytes, then ChatML specials.

The tokenizer only encodes and decodes; it carries its chat template as data
(``chat_template``, ``template_vars``), and :mod:`opencoti.engine.chat` renders it.

Long texts are encoded in pieces so that no single call holds the GIL for long (a server's event
loop keeps answering while a worker thread tokenizes megabytes): the Rust tokenizer releases the
GIL while it works, but turning one piece's ids into a Python list does not; pieces are cut only
where the tokenizer is shown (at load, on probe texts) to give the same ids as the whole text.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

from ..errors import InvalidRequestError

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
# calls render as <tool_call>{json}</tool_call> so the output parser
# (chat/tool_calls.py) has one well-known format to recognise.
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
        template_vars: extra variables the template sees (``bos_token``, ``eos_token``).
        hf_tokenizer: the wrapped transformers tokenizer (None for the byte-level one);
            its templates are rendered by transformers.
        special_token_ids: ids of special/control tokens (skipped by ``decode``
            with ``skip_special_tokens=True``).
    """

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    chat_template: str | None
    special_token_ids: frozenset[int]
    template_vars: dict[str, str] = {}
    hf_tokenizer: Any = None

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

    def is_eos(self, token_id: int) -> bool:
        """Whether ``token_id`` ends generation."""
        return token_id in self.eos_token_ids

    # -- helpers for subclasses --------------------------------------------

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        if type(ids) is list and first_bad_id(ids, self.vocab_size) is None:
            return ids  # checked a slice at a time, not copied (a copy of millions of ids is one long call)
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


def first_bad_id(ids: list, vocab_size: int) -> int | None:
    """The index of the first element of ``ids`` that is not an ``int`` (bools are not) in
    ``[0, vocab_size)``, or None. Checked ``CHECK_SLICE`` ids per call (set / min / max): each call
    holds the GIL briefly, where one call over millions of ids would hold it for tens of ms."""
    for a in range(0, len(ids), CHECK_SLICE):
        chunk = ids[a:a + CHECK_SLICE]
        if set(map(type, chunk)) == {int} and min(chunk) >= 0 and max(chunk) < vocab_size:
            continue
        for j, t in enumerate(chunk):
            if type(t) is not int or not 0 <= t < vocab_size:
                return a + j
    return None


CHECK_SLICE = 1 << 14  # ids per call of first_bad_id
SHARED_IDS = 1 << 18  # ids below this are shared objects in long lists (shared_ids)
_shared: list[int] | None = None


def shared_ids(values: list) -> list:
    """``values`` with every element one shared object per id, when all are ``int`` in
    ``[0, SHARED_IDS)`` (else ``values`` itself). Parsed from JSON or made by the tokenizer, a list
    of ids holds a new object per element: freeing, copying or garbage-collecting 3 M of them is one
    call of 40-55 ms that touches each object (and ~100 MB); with shared objects it is 5-10 ms."""
    global _shared
    if not values or set(map(type, values)) != {int} or min(values) < 0 or max(values) >= SHARED_IDS:
        return values
    if _shared is None:
        _shared = list(range(SHARED_IDS))
    return list(map(_shared.__getitem__, values))


DECODE_PIECE = 1 << 12  # long id lists are decoded this many ids at a time
PIECE_CHARS = 1 << 14  # a long text is cut into pieces of about this many characters ...
BATCH_PIECES = 16  # ... encoded this many at a time (one GIL-free call into the Rust tokenizer)
_SEPARATORS = (" ", "\n")  # a piece starts at one of these, between two non-space characters
_PROBES = (("hello", "world"), ("Hello,", "World!"), ("x1", "23"), ("d\u00e9j\u00e0", "vu"), ("end.", "Next"),
           ("(a)", "[b]"), ("tab\t", "x"), ("\u4f60\u597d", "\u4e16\u754c"), ("it's", "'s"), ("emoji\U0001f600", "ok"),
           ("<|im_start|>user", "hi<|im_end|>"), ("don't", "stop"))


def _cut_points(text: str, separators: tuple[str, ...], piece: int) -> list[int]:
    """Where to cut ``text`` into pieces of about ``piece`` characters: before a separator that sits
    between two non-whitespace characters (a pre-tokenizer boundary). Few cuts when there is none."""
    cuts = [0]
    n = len(text)
    pos = piece
    while pos < n - piece:
        best = -1
        for sep in separators:
            j = text.find(sep, pos, pos + piece)
            while j != -1 and not (0 < j < n - 1 and not text[j - 1].isspace() and not text[j + 1].isspace()):
                j = text.find(sep, j + 1, pos + piece)
            if j != -1 and (best == -1 or j < best):
                best = j
        if best == -1:  # no boundary in this window: the window stays in the current piece
            pos += piece
            continue
        cuts.append(best)
        pos = best + piece
    return cuts


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
        self._backend = getattr(hf_tokenizer, "backend_tokenizer", None)  # the Rust tokenizer, if any
        self.piece_separators = self._probe_separators()
        self.decode_in_pieces = self._probe_decode()

    def __repr__(self) -> str:
        return f"Tokenizer(hf={type(self.hf_tokenizer).__name__}, vocab_size={self.vocab_size})"

    def _probe_separators(self) -> tuple[str, ...]:
        """The separators before which this tokenizer may be cut: encoding ``a + sep + b`` must give
        the ids of ``a`` then those of ``sep + b`` for every probe (not so, e.g., for a normalizer
        that prepends a word marker to every input)."""
        if self._backend is None or not hasattr(self._backend, "encode_batch"):
            return ()
        ok = []
        for sep in _SEPARATORS:
            try:
                for a, b in _PROBES:
                    whole = list(self.hf_tokenizer.encode(a + sep + b, add_special_tokens=False))
                    parts = self._backend.encode_batch([a, sep + b], add_special_tokens=False)
                    if whole != [i for enc in parts for i in enc.ids]:
                        break
                else:
                    ok.append(sep)
            except Exception:  # noqa: BLE001 - a tokenizer that cannot be probed is never cut
                pass
        return tuple(ok)

    def _probe_decode(self) -> bool:
        """Whether decoding two runs of ids gives the text of both together wherever the cut passes
        ``_clean_cut`` (not so, e.g., for a decoder that drops the word marker of a text's first token)."""
        try:
            for a, b in _PROBES:
                ids = list(self.hf_tokenizer.encode(f"{a} {b}\n{b} {a}", add_special_tokens=False))
                whole = self.hf_tokenizer.decode(ids)
                cuts = [j for j in range(1, len(ids)) if self._clean_cut(ids, j, True)]
                if not cuts and len(ids) > 3:
                    return False
                if any(self.hf_tokenizer.decode(ids[:j]) + self.hf_tokenizer.decode(ids[j:]) != whole for j in cuts):
                    return False
            return True
        except Exception:  # noqa: BLE001 - a tokenizer that cannot be probed is never cut
            return False

    def _clean_cut(self, ids: Sequence[int], j: int, skip: bool) -> bool:
        """Whether the text of ``ids`` splits cleanly before ``j``: the ids around the cut decode to
        the same text together as apart (no character, nor a word marker, spans it)."""
        left, right = ids[max(0, j - 4):j], ids[j:j + 4]
        dec = self.hf_tokenizer.decode
        return dec(left, skip_special_tokens=skip) + dec(right, skip_special_tokens=skip) == \
            dec(list(left) + list(right), skip_special_tokens=skip)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to encode must be a string, got {type(text).__name__}")
        backend = self._backend
        if add_special_tokens or len(text) <= 2 * PIECE_CHARS or not self.piece_separators or backend is None:
            return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))
        cuts = _cut_points(text, self.piece_separators, PIECE_CHARS) + [len(text)]
        pieces = [text[a:b] for a, b in zip(cuts, cuts[1:])]
        ids: list[int] = []
        for i in range(0, len(pieces), BATCH_PIECES):  # other threads run between the calls
            for enc in backend.encode_batch(pieces[i:i + BATCH_PIECES], add_special_tokens=False):
                ids.extend(shared_ids(enc.ids))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = self._check_ids(ids)
        if len(ids) <= 2 * DECODE_PIECE or not self.decode_in_pieces:
            return self.hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        parts: list[str] = []
        a, n = 0, len(ids)
        while a < n:  # one piece per call: the Rust decoder holds the GIL while it works
            b = min(a + DECODE_PIECE, n)
            for _ in range(16):  # a cut no character spans (else the rest is decoded at once)
                if b >= n or self._clean_cut(ids, b, skip_special_tokens):
                    break
                b += 1
            else:
                b = n
            parts.append(self.hf_tokenizer.decode(ids[a:b], skip_special_tokens=skip_special_tokens))
            a = b
        return "".join(parts)


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
        self.template_vars = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}

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
                data = piece.encode("utf-8")
                for i in range(0, len(data), 1 << 16):  # in slices: other threads run in between
                    ids.extend(data[i:i + (1 << 16)])
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


def _unique_ids(candidates: Iterable[Any], vocab_size: int) -> tuple[int, ...]:
    """Flatten ints / lists of ints, drop None and out-of-range ids, keep first-seen order."""
    out: list[int] = []
    for c in candidates:
        for i in c if isinstance(c, (list, tuple)) else (c,):
            if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size and i not in out:
                out.append(i)
    return tuple(out)
