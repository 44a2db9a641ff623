"""StructuredOutputManager: one per engine. Chooses the backend (``structured_outputs_backend``:
auto | xgrammar | llguidance), compiles grammars off the engine loop in a thread pool with a cache
keyed by grammar, and hands out a matcher per sequence.

``auto`` compiles with xgrammar and falls back to llguidance for what xgrammar refuses (some JSON
Schema features and regex constructs), as vLLM does; a grammar neither compiles is the request's
error, with the first backend's message. Building a backend's view of the tokenizer takes seconds on
a large vocabulary: it happens on first use, or in the background from ``warm_up`` (pagoda serve).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
from collections import OrderedDict

from pagoda.errors import ConfigError, RequestError
from pagoda.structured_outputs.backends import BACKENDS, GrammarMatcher, StructuredOutputBackend
from pagoda.structured_outputs.params import GrammarSpec, StructuredOutputsParams

logger = logging.getLogger("pagoda")

CACHE_SIZE = 512  # compiled grammars kept (least recently used go first)


class CompiledGrammar:
    """A compiled grammar and the backend that made it (matchers come from the same one)."""

    def __init__(self, backend: StructuredOutputBackend, compiled: object):
        self.backend = backend
        self.compiled = compiled

    def matcher(self) -> GrammarMatcher:
        return self.backend.matcher(self.compiled)


class StructuredOutputManager:
    def __init__(self, backend: str, tokenizer, vocab_size: int, stop_token_ids: list[int], process: bool = False):
        if backend not in ("auto", *BACKENDS):
            raise ConfigError(f"structured_outputs_backend {backend!r} is not one of auto, {', '.join(BACKENDS)}")
        self.choice = backend
        self._tokenizer = tokenizer
        self.has_tokenizer = tokenizer is not None
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.process = process  # xgrammar's matchers in a process of their own (engine key structured_outputs_process)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="pagoda-grammar")
        # backends build in their own thread: a compile waiting for one must not hold its place
        self._builder = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagoda-grammar-init")
        self._backends: dict[str, concurrent.futures.Future] = {}
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    @functools.cached_property
    def tokenizer(self):
        """What the grammar libraries read: transformers' tokenizer class. A GGUF model's light
        wrapper builds it on first use (it imports transformers: only when a grammar is asked for)."""
        return getattr(self._tokenizer, "hf", self._tokenizer)

    def warm_up(self) -> None:
        """Start building the backend's view of the tokenizer in the background (a server does
        this at start, so that its first constrained request does not wait for it)."""
        if self.has_tokenizer:
            self._backend_future("xgrammar" if self.choice == "auto" else self.choice)

    # ------------------------------------------------------------------ backends
    def _backend_future(self, name: str) -> concurrent.futures.Future:
        with self._lock:
            future = self._backends.get(name)
            if future is None:
                extra = {"process": True} if self.process and name == "xgrammar" else {}
                future = self._builder.submit(BACKENDS[name], self.tokenizer, self.vocab_size, self.stop_token_ids,
                                              **extra)
                self._backends[name] = future
        return future

    def backend(self, name: str) -> StructuredOutputBackend:
        try:
            return self._backend_future(name).result()
        except ImportError as exc:
            raise ConfigError(f"structured_outputs_backend {name!r} needs the {name} package ({exc}); "
                              f"pip install {name}") from exc

    # ------------------------------------------------------------------ compiling
    def compile(self, params: StructuredOutputsParams, field: str | None = None) -> CompiledGrammar:
        """The compiled grammar of ``params`` (from the cache when seen before). A grammar that
        does not compile raises RequestError naming ``field`` (default ``structured_outputs.<kind>``)."""
        if not self.has_tokenizer:
            raise RequestError("structured outputs need the model's tokenizer (skip_tokenizer_init is set)",
                               field=field or "structured_outputs")
        spec = params.spec()
        field = field or f"structured_outputs.{spec.kind}"
        order = ["xgrammar", "llguidance"] if self.choice == "auto" else [self.choice]
        key = (tuple(order), spec)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        compiled = self._compile(spec, order, field)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec, order: list[str], field: str) -> CompiledGrammar:
        first_error = None
        for name in order:
            backend = self.backend(name)
            try:
                return CompiledGrammar(backend, backend.compile(spec))
            except ValueError as exc:
                first_error = first_error or f"{exc} ({name})"
                if len(order) > 1:
                    logger.info("structured outputs: %s cannot compile this %s (%s); trying the next backend",
                                name, spec.kind, exc)
        raise RequestError(f"{field} does not compile: {first_error}", field=field, code="invalid_grammar")

    def compile_async(self, params: StructuredOutputsParams, field: str | None = None) -> concurrent.futures.Future:
        """``compile`` in the thread pool (the server awaits it before queuing the request)."""
        return self.pool.submit(self.compile, params, field)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self._builder.shutdown(wait=False, cancel_futures=True)
        for future in list(self._backends.values()):
            if future.done() and future.exception() is None:
                future.result().close()
