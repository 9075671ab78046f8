"""What an operation runs against: one engine plus the serving settings."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..engine.errors import EngineClosedError

if TYPE_CHECKING:
    from ..engine import Engine


class Context:
    """An engine and the settings operations read.

    default_max_tokens: max tokens of a generation that gives none (None: until EOS / context).
    model_alias: the model id reported to clients (default: the engine's model name).
    tps_interval_ms: the default period of the live tps stream (reported by ``props``).
    default_seed: the sampling seed of a generation that gives none (None: a fresh seed each).
    """

    def __init__(self, engine: "Engine", *, default_max_tokens: int | None = None, model_alias: str | None = None,
                 tps_interval_ms: float = 500.0, started: float = 0.0, default_seed: int | None = None):
        self.engine = engine
        self.default_max_tokens = default_max_tokens
        self.model_alias = model_alias
        self.tps_interval_ms = tps_interval_ms
        self.started = started
        self.default_seed = default_seed
        self._pieces: dict[int, str] = {}

    @property
    def model_name(self) -> str:
        return self.model_alias or self.engine.model_name

    def require_open(self) -> "Engine":
        if self.engine.is_closed:
            raise EngineClosedError("the server is shutting down")
        return self.engine

    def piece(self, token_id: int) -> str:
        """The text of one token with specials kept (cached: logprob answers ask for many)."""
        s = self._pieces.get(token_id)
        if s is None:
            s = self.engine.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._pieces) < 200_000:
                self._pieces[token_id] = s
        return s
