"""Where the engine keeps its files: the cache root (converted GGUF configs and tokenizers, the
native kernels' build, kernel timings, the attention self-check's verdicts, a server's default
state directory). Imports nothing of the engine, so every layer may use it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache directory: ``cache_dir``, else ``$OPENCOTI_CACHE``, else the user cache dir."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get("OPENCOTI_CACHE")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("opencoti"))
