"""A request's output stream on the asyncio side of ``AsyncEngine``, and the errors a request can end with.

``RequestStream`` is what ``AsyncEngine.add_request`` returns: an async iterator over one request's
cumulative outputs that skips to the newest one, ends at the request's deadline, and aborts the request
when closed early. The exceptions (``QueueFullError``, ``EngineStoppedError``, ``RequestTimeoutError``,
``RequestAbortedError``, ``EngineFailedError``, ``RequestFailedError``) are what adds and streams raise;
the server maps them to HTTP errors (``pagoda.server.errors``).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from pagoda.errors import PagodaError
from pagoda.outputs import RequestOutput

if TYPE_CHECKING:
    from pagoda.engine.async_engine import AsyncEngine


class QueueFullError(PagodaError):
    """The waiting queue holds ``max_queued_requests`` requests already."""


class EngineStoppedError(PagodaError):
    """The engine is shutting down (or failed) and takes no new requests."""


class RequestTimeoutError(PagodaError):
    """A request ran past its deadline and was aborted."""


class RequestAbortedError(PagodaError):
    """The engine aborted a request (shutdown, or the engine loop failed)."""


class EngineFailedError(RequestAbortedError):
    """The engine loop died (a bug or a device failure): every request in flight is ended."""


class RequestFailedError(PagodaError):
    """One request failed inside a step (its row could not be sampled or decoded); the engine
    and the other requests went on."""


_FINISHED = object()  # stream sentinel: no more outputs
_TIMED_OUT = object()  # stream sentinel: the request's deadline passed


def _deliver(items: list) -> None:
    """On the event loop: a step's outputs into their requests' queues."""
    for queue, item in items:
        queue.put_nowait(item)


class RequestStream:
    """Async iterator over one request's outputs (each cumulative). Closing it early aborts."""

    def __init__(self, engine: AsyncEngine, request_id: str, loop: asyncio.AbstractEventLoop,
                 deadline: float | None):
        self.engine = engine
        self.request_id = request_id
        self.loop = loop
        self.deadline = deadline  # time.monotonic() value, or None
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False  # the request reached a final output or an error
        self.last: RequestOutput | None = None
        # One timer per request puts _TIMED_OUT in the queue at the deadline (started at the first read):
        # a timeout around every read cost ~8% of the event loop's time with 64 streams of tokens.
        self._timer: asyncio.TimerHandle | None = None

    # called on the engine thread
    def _push(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        if self._timer is None and self.deadline is not None:
            self._timer = self.loop.call_later(max(0.0, self.deadline - time.monotonic()),
                                               self.queue.put_nowait, _TIMED_OUT)
        try:
            item = await self.queue.get()
        except BaseException:
            self.close()  # cancelled (client gone): abort the request
            raise
        # Outputs are cumulative: skip to the newest one that is already here.
        while isinstance(item, RequestOutput) and not item.finished and not self.queue.empty():
            item = self.queue.get_nowait()
        if item is _TIMED_OUT:
            self.close()
            raise RequestTimeoutError(f"request {self.request_id} did not finish within its timeout")
        if isinstance(item, BaseException):
            self._end()
            raise item
        if item is _FINISHED:
            self._end()
            raise StopAsyncIteration
        self.last = item
        if item.finished:
            self._end()
        return item

    def _end(self) -> None:
        self.finished = True
        if self._timer is not None:
            self._timer.cancel()

    def close(self) -> None:
        """Stop listening; abort the request if it has not finished."""
        if not self.finished:
            self._end()
            self.engine.abort(self.request_id)
