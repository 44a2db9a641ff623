"""Running the app under uvicorn: in the foreground (``pagoda serve``) or in a background
thread (``ServerThread``: tests and embedding).

Shutdown (SIGTERM, SIGINT or ``ServerThread.stop``): stop accepting connections and new
requests, let in-flight responses finish for up to ``shutdown_timeout`` seconds, abort the
rest, stop the engine loop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time

import uvicorn

from pagoda.config import EngineConfig
from pagoda.engine.async_engine import AsyncEngine
from pagoda.errors import ConfigError
from pagoda.server.config import ServerConfig

logger = logging.getLogger("pagoda.server")


# seconds uvicorn waits, after the engine aborted what was left, for those responses to end
ABORT_GRACE = 2.0
# seconds the server keeps answering (503, /health naming the failure) after the engine loop died,
# before it shuts down and exits non-zero so that a supervisor restarts it
ENGINE_FAILURE_GRACE = 1.0


class _Server(uvicorn.Server):
    """uvicorn's server; from the moment shutdown begins new requests are refused (503), and
    requests still running after ``shutdown_timeout`` are aborted so that their responses
    end properly (an error event, or a 503) before uvicorn closes the connections.

    If the engine loop dies, the server shuts down by itself ``ENGINE_FAILURE_GRACE`` seconds
    later and ``run_server`` returns 1."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, shutdown_timeout: float):
        super().__init__(config)
        self.async_engine = async_engine
        self.shutdown_timeout = shutdown_timeout
        self.engine_failed = False
        async_engine.on_failure = self._on_engine_failure

    def _on_engine_failure(self, exc: BaseException) -> None:  # on the engine thread
        self.engine_failed = True
        logger.critical("the engine failed (%s: %s); the server exits with status 1 in %.0f s", type(exc).__name__,
                        exc, ENGINE_FAILURE_GRACE)
        timer = threading.Timer(ENGINE_FAILURE_GRACE, self._request_exit)
        timer.daemon = True
        timer.start()

    def _request_exit(self) -> None:
        self.should_exit = True  # uvicorn's main loop polls it

    async def shutdown(self, sockets=None) -> None:
        self.async_engine.stop_accepting()
        drain = asyncio.ensure_future(self.async_engine.drain(self.shutdown_timeout))
        try:
            await super().shutdown(sockets=sockets)
        finally:
            drain.cancel()


def build_app(engine_config: EngineConfig, server_config: ServerConfig):
    """Load the model (the slow part) and build the app; errors surface before any port is bound."""
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.server.app import create_app

    if engines_own_process(engine_config, server_config):
        # replicas in their own processes behind this front (pagoda.distributed.data_parallel); engine_process:
        # one replica, so that the HTTP server and the engine do not share a GIL
        from pagoda.distributed.data_parallel import DataParallelEngine

        engine = DataParallelEngine(engine_config, finished_only=False)
    else:
        engine = LLMEngine(engine_config)
    try:
        engine.controls.structured_outputs.warm_up()
        async_engine = AsyncEngine(engine, max_queued_requests=server_config.max_queued_requests)
        app = create_app(async_engine, server_config)
    except BaseException:  # (a server key refused after the engine started: its processes end now)
        engine.shutdown()
        raise
    app.state.owns_engine = True  # built here: its processes end with the server (ServerThread.stop)
    return app


def engines_own_process(engine_config: EngineConfig, server_config: ServerConfig) -> bool:
    """Whether the engine runs in processes of its own: data parallelism, or ``engine_process`` (the default)."""
    return engine_config.data_parallel_size > 1 or server_config.engine_process


def _uvicorn_server(app, config: ServerConfig, port: int | None = None) -> _Server:
    uv_config = uvicorn.Config(app, host=config.host, port=config.port if port is None else port,
                               log_level=logging.getLogger().getEffectiveLevel(), access_log=config.access_log,
                               timeout_graceful_shutdown=config.shutdown_timeout + ABORT_GRACE, lifespan="on")
    return _Server(uv_config, app.state.async_engine, config.shutdown_timeout)


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on host:port (port 0: a free one)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} (server.host / server.port): {exc}") from exc
    return sock


def run_server(app, config: ServerConfig, announce=None, sock: socket.socket | None = None) -> int:
    """Serve in the foreground until SIGTERM/SIGINT; return 0 after a graceful shutdown, 1 if
    the engine loop died (or the server never started).
    ``sock``: a socket from ``bind`` (else config.host:config.port is bound here).
    ``announce(url)`` is called once the port is bound (with the real port when port is 0)."""
    sock = sock or bind(config.host, config.port)
    port = sock.getsockname()[1]
    server = _uvicorn_server(app, config, port=port)
    if announce is not None:
        announce(f"http://{config.host}:{port}")
    # uvicorn re-raises the signal it caught once it has shut down; no-op SIGTERM and SIGINT handlers make
    # that a clean exit (status 0) instead of death by signal, or for Ctrl-C a KeyboardInterrupt raised
    # through asyncio, whose cancelled lifespan task printed a traceback after the graceful shutdown.
    previous = {sig: signal.signal(sig, lambda signum, frame: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    return 0 if server.started and not server.engine_failed else 1


class ServerThread:
    """Run an app in a background thread on a free (or given) port of ``config.host``.

        with ServerThread(app) as server:
            httpx.get(server.url + "/health")
    """

    def __init__(self, app, config: ServerConfig | None = None, port: int = 0):
        self.app = app
        self.config = config or app.state.config
        self.sock = bind(self.config.host, port)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{self.config.host}:{self.port}"
        self.server = _uvicorn_server(app, self.config, port=self.port)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="pagoda-server", daemon=True)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()
        engine = self.app.state.async_engine.engine
        # an engine build_app made in processes of its own ends with the server (one given to create_app
        # stays with its owner)
        if getattr(self.app.state, "owns_engine", False) and getattr(engine, "replicas", None):
            engine.shutdown()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
