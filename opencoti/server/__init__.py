"""HTTP API over one Engine: llama.cpp- and OpenAI-compatible routes plus the /polykv control plane.

    from opencoti.server import create_app, ServerConfig
    app = create_app(engine)      # any ASGI server; `opencoti serve` runs it with uvicorn

Imports are lazy so `opencoti --help` does not load the web stack or torch.
"""

__all__ = ["create_app", "ServerConfig", "ServerState"]


_HOMES = {"create_app": "app", "ServerConfig": "config", "ServerState": "state"}


def __getattr__(name):
    if name in _HOMES:
        import importlib
        return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
