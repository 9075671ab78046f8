"""HTTP API over one Engine: llama.cpp- and OpenAI-compatible routes plus the /polykv control plane.

    from opencoti.server import create_app, ServerConfig
    app = create_app(engine)      # any ASGI server; `opencoti serve` runs it with uvicorn

Imports are lazy so `opencoti --help` does not load the web stack or torch.
"""

__all__ = ["create_app", "ServerConfig", "ServerState"]


def __getattr__(name):
    if name in __all__:
        from . import app
        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
