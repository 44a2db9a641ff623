"""AsyncEngine: one background thread steps an ``LLMEngine``; asyncio callers get per-request streams.

The LLMEngine is not thread-safe, so only the engine thread touches it. Callers on an
asyncio loop send it commands (add, abort, run a function) through a locked list; the
thread applies them between two steps, steps while any request is unfinished, and hands
each ``RequestOutput`` to its request's stream with ``loop.call_soon_threadsafe``.

Outputs are cumulative (text and token ids so far), so a reader that falls behind only
needs the newest one: ``RequestStream`` coalesces what piled up. A stream that is
closed before its request finished (client gone, timeout, cancellation) aborts the
request, which frees its KV blocks at the next step boundary. The stream and the errors
a request can end with are in ``pagoda.engine.request_stream``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagoda.engine.executor.failures import WorkerError
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.request_stream import (
    _FINISHED,
    EngineFailedError,
    EngineStoppedError,
    QueueFullError,
    RequestAbortedError,
    RequestFailedError,
    RequestStream,
    _deliver,
)
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger("pagoda")


class AsyncEngine:
    """Serve an ``LLMEngine`` to asyncio code.

    ``max_queued_requests``: most requests waiting for a seat (added but not yet running);
    one more raises ``QueueFullError``. None: no limit.
    """

    def __init__(self, engine: LLMEngine, max_queued_requests: int | None = None):
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self._cond = threading.Condition()
        self._commands: list[Callable[[], None]] = []
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._pending_adds = 0  # submitted, not yet applied by the engine thread
        self._waiting_requests = 0  # requests with no running sequence (engine thread writes)
        self._free_seats = engine.scheduler.max_num_seqs  # running-set seats left (engine thread writes)
        self._thread: threading.Thread | None = None
        self._stop = False
        self._closed = False  # the engine thread ended or is ending: adds are refused
        self._thread_done = False  # no command submitted from now on would be run by the thread
        self.accepting = True
        self.error: BaseException | None = None  # set when the engine loop failed
        # called once, on the engine thread, when the loop dies (the server begins its exit)
        self.on_failure: Callable[[BaseException], None] | None = None
        self._ids = itertools.count()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop = self._closed = self._thread_done = False
        self.accepting = True
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def stop_accepting(self) -> None:
        self.accepting = False

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Refuse new requests, let running ones finish for up to ``drain_timeout`` seconds,
        abort the rest (their streams raise ``RequestAbortedError``) and stop the thread."""
        self.accepting = False
        if self._thread is None:
            return
        await self.drain(drain_timeout)
        with self._cond:
            self._stop = True
            self._cond.notify()
        thread, self._thread = self._thread, None
        await asyncio.to_thread(thread.join)

    async def drain(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for in-flight requests to finish, then abort the rest:
        their streams raise ``RequestAbortedError``, so responses can end cleanly."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.num_unfinished() > 0:
            await asyncio.sleep(0.05)
        if self.num_unfinished() > 0 and self._thread is not None and self._thread.is_alive():
            await self.call(lambda engine: self._abort_streams(
                RequestAbortedError("the server shut down before the request finished")))

    def num_unfinished(self) -> int:
        return len(self._streams) + self._pending_adds

    @property
    def num_waiting(self) -> int:
        """Requests that will have to wait for a seat: those submitted or waiting in the
        engine, less the seats (``max_num_seqs``) still free in the running batch."""
        return max(0, self._pending_adds + self._waiting_requests - self._free_seats)

    # ------------------------------------------------------------------ commands (any thread)
    def _submit(self, command: Callable[[], None]) -> None:
        with self._cond:
            if self._thread_done:  # nobody will run it: run it here (it only resolves futures)
                run_now = True
            else:
                run_now = False
                self._commands.append(command)
                self._cond.notify()
        if run_now:
            command()

    def _check_open(self) -> None:
        if self.error is not None:
            raise EngineStoppedError(f"the engine failed and serves no more requests "
                                     f"({type(self.error).__name__}: {self.error}); the server is exiting")
        if not self.accepting or self._thread is None:
            raise EngineStoppedError("the server is shutting down and takes no new requests")

    async def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                          request_id: str | None = None, prompt: str | None = None,
                          timeout: float | None = None, mm_inputs=None,
                          lora_request=None) -> RequestStream:
        """Queue a request; return its stream once the engine accepted it. Raises the
        engine's ``RequestError`` for a bad request, ``QueueFullError``, ``EngineStoppedError``."""
        self._check_open()
        if self.max_queued_requests is not None and self.num_waiting >= self.max_queued_requests:
            raise QueueFullError(f"the server's queue is full ({self.num_waiting} requests waiting, "
                                 f"max_queued_requests={self.max_queued_requests}); retry later")
        loop = asyncio.get_running_loop()
        rid = request_id or f"req-{next(self._ids)}"
        deadline = None if timeout is None else time.monotonic() + timeout
        stream = RequestStream(self, rid, loop, deadline)
        accepted: asyncio.Future = loop.create_future()
        arrival = time.time()

        def add() -> None:
            with self._cond:
                self._pending_adds -= 1
            if self._closed:
                _resolve(loop, accepted, exc=EngineStoppedError("the server is shutting down and takes no new "
                                                                "requests"))
                return
            try:
                self.engine.add_request(rid, prompt, params, prompt_token_ids=prompt_token_ids,
                                        arrival_time=arrival, mm_inputs=mm_inputs,
                                        lora_request=lora_request)
            except WorkerError as exc:  # the engine itself is gone (a rank, an engine process): it stops
                _resolve(loop, accepted, exc=EngineFailedError(f"the engine failed: {type(exc).__name__}: {exc}"))
                raise
            except BaseException as exc:  # a bad request: refuse it, change nothing else
                _resolve(loop, accepted, exc=exc)
                return
            self._streams[rid] = stream
            self._count_waiting()
            _resolve(loop, accepted, result=None)

        with self._cond:
            self._pending_adds += 1
        self._submit(add)
        try:
            await accepted
        except asyncio.CancelledError:
            stream.close()
            raise
        return stream

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, timeout: float | None = None) -> AsyncIterator[RequestOutput]:
        """Convenience: add a request and iterate over its outputs."""
        stream = await self.add_request(prompt_token_ids, params, request_id, timeout=timeout)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished). Safe from any thread."""
        def do_abort() -> None:
            stream = self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)
            if stream is not None:
                stream._push(_FINISHED)

        self._submit(do_abort)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result."""
        if self._thread is None or not self._thread.is_alive():
            return fn(self.engine)  # no loop running: nothing can race with us
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                _resolve(loop, future, result=fn(self.engine))
            except BaseException as exc:
                _resolve(loop, future, exc=exc)

        self._submit(run)
        return await future

    def call_sync(self, fn: Callable[[LLMEngine], Any], timeout: float | None = 30.0) -> Any:
        """``call`` for threads without an event loop (tests, admin code)."""
        if self._thread is None or not self._thread.is_alive():
            return fn(self.engine)
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn(self.engine))
            except BaseException as exc:
                future.set_exception(exc)

        self._submit(run)
        return future.result(timeout)

    async def get_stats(self) -> dict[str, Any]:
        return await self.call(lambda engine: engine.get_stats())

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: B036 - a bug or a device failure: nothing can be pinned to a request
            self._fail(exc)

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not self._commands and not self._stop and not engine.has_unfinished_requests():
                    self._cond.wait()
                commands, self._commands = self._commands, []
                stop = self._stop
            for command in commands:
                try:
                    command()
                except WorkerError:  # the engine is gone: the loop stops (_run)
                    raise
                except Exception:  # commands resolve their own futures; a bug here must not kill the loop
                    logger.exception("an engine command failed")
            if stop:
                self._abort_all(RequestAbortedError("the server shut down before the request finished"))
                return
            if not engine.has_unfinished_requests():
                self._count_waiting()  # aborts may have emptied the queue without a step
                continue
            # A failure pinned to one request ends that request inside the step (its output carries
            # the error); an exception out of step() cannot be pinned and stops the engine.
            deliveries: dict[asyncio.AbstractEventLoop, list] = {}
            for out in engine.step():
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                deliveries.setdefault(stream.loop, []).append((stream.queue, out if out.error is None else
                                                               RequestFailedError(
                    f"request {out.request_id} failed inside the engine and was ended ({out.error}); "
                    f"the other requests were not affected")))
            for loop, items in deliveries.items():  # one wake-up of each event loop per step, not one per request
                try:
                    loop.call_soon_threadsafe(_deliver, items)
                except RuntimeError:  # the loop is closed: nobody is listening any more
                    pass
            self._count_waiting()

    def _fail(self, exc: BaseException) -> None:
        """The engine loop died: fail every request, refuse new ones, and tell ``on_failure``
        (the server exits non-zero so that a supervisor restarts it)."""
        logger.critical("the engine loop failed; no request can be served from now on", exc_info=exc)
        self.error = exc
        self.accepting = False
        self._abort_all(EngineFailedError(f"the engine failed: {type(exc).__name__}: {exc}"))
        if self.on_failure is not None:
            try:
                self.on_failure(exc)
            except Exception:
                logger.exception("the engine failure callback failed")

    def _count_waiting(self) -> None:
        """Snapshot for ``num_waiting`` (engine thread). A request with a running sequence has a seat."""
        scheduler = self.engine.scheduler
        waiting = {s.request_id for s in scheduler.waiting}
        if waiting:
            waiting -= {s.request_id for s in scheduler.running}
        self._waiting_requests = len(waiting)
        self._free_seats = max(0, scheduler.max_num_seqs - len(scheduler.running))

    def _abort_streams(self, exc: BaseException) -> None:
        """Abort every request in flight; its stream raises ``exc``. Engine thread only."""
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:  # the engine may be broken; the stream still has to end
                logger.exception("aborting %s failed", rid)
            stream._push(exc)
        self._streams.clear()
        self._count_waiting()

    def _abort_all(self, exc: BaseException) -> None:
        """End every stream with ``exc``; answer commands that arrive until the thread exits."""
        self._closed = True
        self._abort_streams(exc)
        with self._cond:
            commands, self._commands = self._commands, []
            self._thread_done = True
        for command in commands:  # late adds are refused (self._closed), calls still run
            command()


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: Any = None,
             exc: BaseException | None = None) -> None:
    def set_it() -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    try:
        loop.call_soon_threadsafe(set_it)
    except RuntimeError:  # loop closed
        pass
