"""`pc-rag serve`: an OpenAI-compatible HTTP server over one Engine, for several apps and processes at once.

Needs the `serve` extra (FastAPI, uvicorn): `pip install "pc-rag[serve]"`. See docs/serve.md.
"""

from __future__ import annotations

from .app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app", "run"]


def run(engine, settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve `engine` until interrupted (uvicorn, one process: the model and its KV cache are loaded once)."""
    import uvicorn

    from .limits import head_deadline_h11

    # h11 with a deadline on each request's head (limits.py): uvicorn has none of its own.
    uvicorn.run(create_app(engine, settings), host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=5, http=head_deadline_h11(settings.read_timeout_s))
