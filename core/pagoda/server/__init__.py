"""The OpenAI- and Ollama-compatible HTTP server (FastAPI + uvicorn) over an AsyncEngine.

    from pagoda.server import ServerConfig, build_app, run_server
    run_server(build_app(engine_config, ServerConfig(port=8000)), ServerConfig(port=8000))
"""

from pagoda.server.config import ServerConfig, load_server_config

__all__ = ["ServerConfig", "build_app", "create_app", "load_server_config", "run_server", "ServerThread"]


def __getattr__(name):
    # the app pulls in FastAPI, uvicorn and torch: import on first use
    if name == "create_app":
        from pagoda.server.app import create_app

        return create_app
    if name in ("build_app", "run_server", "ServerThread"):
        from pagoda.server import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'pagoda.server' has no attribute {name!r}")
