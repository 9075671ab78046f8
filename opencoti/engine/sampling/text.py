"""Streaming text helpers used around the sampler.

- `StopStringMatcher`: incremental stop-string detection for streamed text.
- `IncrementalDetokenizer`: token-by-token text with UTF-8 hold-back and an O(1) decode window.
- `TextOutput`: the two together, a request's generated text as the core emits it.
"""

from __future__ import annotations

from typing import Callable, Sequence

__all__ = ["StopStringMatcher", "IncrementalDetokenizer", "TextOutput"]


class StopStringMatcher:
    """Incremental stop-string detection for streamed text.

    `feed` returns the text that is safe to emit now, holding back any suffix that could be the
    start of a stop string. A stop is reported at the first point where some stop string has
    appeared in full (so the result is the same however the text is chunked, as if fed one
    character at a time); if several complete at the same point, the longest one (which starts
    earliest) wins. The emitted text then ends right before the stop string and nothing after it
    is ever emitted.
    """

    def __init__(self, stop: Sequence[str]):
        if isinstance(stop, str):
            stop = (stop,)
        self._stops = tuple(s for s in stop if s)
        self._max_hold = max((len(s) - 1 for s in self._stops), default=0)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended generation

    def feed(self, new_text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self._stops:
            return new_text, False
        text = self._held + new_text
        best_end = best_start = -1
        for s in self._stops:
            start = text.find(s)
            if start < 0:
                continue
            end = start + len(s)
            if best_end < 0 or end < best_end or (end == best_end and start < best_start):
                best_end, best_start, self.matched = end, start, s
        if best_end >= 0:
            self.stopped = True
            self._held = ""
            return text[:best_start], True
        hold = self._hold_length(text)
        self._held = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold], False

    def flush(self) -> str:
        """The held-back text, at the end of generation (empty once a stop string was hit)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _hold_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text, like vLLM / TGI.

    Each step decodes only a small window: the tokens from `prefix_offset` (a few tokens of
    context, so decoders that drop a leading space or merge across tokens see their neighbours)
    to the end, and emits what that decode adds over the decode of the context alone. A token
    whose text ends in an incomplete UTF-8 sequence (the decoder returns a trailing U+FFFD) is
    held back until a later token completes it.

    decode: ids -> text (e.g. `lambda ids: tokenizer.decode(ids, skip_special_tokens=True)`).
    prompt_ids: the tokens before the first pushed one (only the last `context_tokens` are used).
    """

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        prompt_ids: Sequence[int] = (),
        context_tokens: int = 5,
    ):
        self._decode = decode
        # Only ids from prefix_offset on are kept: memory and decode cost stay O(window).
        self._ids: list[int] = list(prompt_ids[-context_tokens:]) if context_tokens > 0 else []
        self._prefix_offset = 0  # start of the context window in self._ids
        self._read_offset = len(self._ids)  # first id whose text has not been emitted

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly "")."""
        self._ids.append(token_id)
        window = self._ids[self._prefix_offset:]
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(window)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            out = new_text[len(prefix_text):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._trim()
            return out
        return ""

    def flush(self) -> str:
        """The text of held-back tokens (an incomplete sequence decodes as U+FFFD)."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._trim()
        return new_text[len(prefix_text):]

    def _trim(self) -> None:
        if self._prefix_offset:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0


class TextOutput:
    """A request's generated text: each token decoded (``IncrementalDetokenizer``) and fed through
    its stop strings (``StopStringMatcher``), text that may start a stop string held back."""

    __slots__ = ("detok", "stopper")

    def __init__(self, decode: Callable[..., str], stop: Sequence[str]):
        self.detok = IncrementalDetokenizer(decode)
        self.stopper = StopStringMatcher(stop)

    def push(self, token: int) -> tuple[str, bool]:
        """The text ``token`` adds that can be emitted now, and whether a stop string was hit."""
        return self.stopper.feed(self.detok.push(token))

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text (None: none did)."""
        return self.stopper.matched

    def finish(self, reason: str) -> str:
        """The text still held back when generation ends for ``reason`` (not ``"stop"``): at
        ``"length"`` the detokenizer's held-back bytes too; at ``"eos"`` and the like only what the
        stop strings held (the end token's own text is never emitted)."""
        text = self.stopper.feed(self.detok.flush())[0] if reason == "length" else ""
        return text + self.stopper.flush()
