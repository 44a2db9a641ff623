"""The parser interfaces: ``ToolParser`` (model text -> OpenAI tool calls) and
``ReasoningParser`` (model text -> reasoning and answer), with their per-request
streaming states.

A parser is constructed per request (it is cheap) with the model's tokenizer; the tool
parser also gets the request's ``tools``. ``extract(text)`` parses a whole output;
``stream()`` returns a fresh state whose ``feed(delta_text, done)`` parses it delta by
delta. For any split of a text into deltas, what the stream returns joins to exactly
what ``extract`` returns (content, each call's id, name and arguments; reasoning and
content). A parser implements either side: the other comes from it.
"""

from __future__ import annotations

import hashlib
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagoda.parsers.scan import WS


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it (parsers with another syntax convert it)


@dataclass
class ToolCallResult:
    content: str | None  # the text that is not a tool call; None when there is none
    calls: list[ToolCall] = field(default_factory=list)

    @classmethod
    def from_deltas(cls, deltas: list[Delta]) -> ToolCallResult:
        """Join streamed deltas into the result they add up to."""
        content: list[str] = []
        calls: dict[int, ToolCall] = {}
        for delta in deltas:
            if isinstance(delta, ContentDelta):
                content.append(delta.text)
                continue
            call = calls.setdefault(delta.index, ToolCall(delta.id or "", delta.name or "", ""))
            call.arguments += delta.arguments
        return cls("".join(content) or None, [calls[i] for i in sorted(calls)])


@dataclass
class ContentDelta:
    text: str


@dataclass
class ToolCallDelta:
    """Part of call ``index``: its first delta carries ``id`` and ``name``; then only
    ``arguments`` fragments, which join to the call's full arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


Delta = ContentDelta | ToolCallDelta
_ALNUM = string.ascii_letters + string.digits


def hidden_by_skip_special(tokenizer: Any, marker: str) -> bool:
    """Whether decoding with skip_special_tokens=True drops ``marker`` (True when there is
    no tokenizer to ask)."""
    if tokenizer is None:
        return True
    try:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        return tokenizer.decode(ids, skip_special_tokens=True) != marker
    except Exception:  # a tokenizer without encode/decode: assume the worst
        return True


def single_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` where the tokenizer encodes it as one token, else None."""
    if tokenizer is None:
        return None
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except Exception:
        return None
    return ids[0] if len(ids) == 1 else None


def derived_id(seed: str, index: int, length: int) -> str:
    """``length`` alphanumeric characters fixed by (seed, index)."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=32).digest()
    return "".join(_ALNUM[b % len(_ALNUM)] for b in digest[:length])


class ToolParser:
    """Turns model output into OpenAI tool calls. Subclasses implement ``stream()`` (a
    ``ToolCallStream``), or ``extract()`` alone (their stream then holds the text back
    until it is done and reports the calls at the end)."""

    # Markers the parser cannot do without that models often make special tokens (see
    # ``needs_special_tokens``).
    special_markers: tuple[str, ...] = ()

    def __init__(self, tokenizer: Any = None, tools: list[dict] | None = None,
                 id_factory: Callable[[int], str] | None = None):
        self.tokenizer = tokenizer
        self.tools = tools or []
        self.id_factory = id_factory
        self._id_seed = secrets.token_hex(8)

    @property
    def needs_special_tokens(self) -> bool:
        """Whether the output must be decoded with ``skip_special_tokens=False`` for the
        parser to see its markers."""
        return any(hidden_by_skip_special(self.tokenizer, m) for m in self.special_markers)

    def make_id(self, index: int) -> str:
        """The id of call ``index``: from ``id_factory`` when given, otherwise fixed per
        parser instance and index, so extract() and stream() agree."""
        if self.id_factory is not None:
            return self.id_factory(index)
        return "call_" + derived_id(self._id_seed, index, 24)

    def stream(self) -> ToolCallStream:
        if type(self).extract is ToolParser.extract:
            raise NotImplementedError(f"{type(self).__name__} implements neither stream() nor extract()")
        return BufferedToolCallStream(self)

    def extract(self, text: str) -> ToolCallResult:
        return ToolCallResult.from_deltas(self.stream().feed(text, done=True))


class ToolCallStream:
    """The streaming state of one request. ``feed`` appends ``delta_text`` to ``buf`` and
    calls ``advance()``, which a subclass implements: consume ``buf`` as far as it can
    decide, reporting through ``content()``, ``begin_call()`` and ``call_arguments()``,
    and leave the undecided rest in ``buf``; with ``done`` it must consume everything.

    Whitespace right before a call, and after the last call at the end of the text, is
    dropped; the rest of the content is kept exactly.
    """

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.buf = ""
        self.done = False
        self.num_calls = 0
        self._finished = False
        self._out: list[Delta] = []
        self._pending_ws = ""  # trailing whitespace of the content, not yet known to be content
        self._content_after_call = False
        self._args_pending, self._args_started = "", False

    def feed(self, delta_text: str, done: bool = False) -> list[Delta]:
        if self._finished:
            raise RuntimeError("feed() called after done=True")
        self.buf += delta_text
        self.done = done
        self.advance()
        if done:
            self._finished = True
            if self.buf:  # a subclass left text unread: never lose it
                self.content(self.buf)
                self.buf = ""
            if self._pending_ws and (self.num_calls == 0 or self._content_after_call):
                self._out.append(ContentDelta(self._pending_ws))
            self._pending_ws = ""
        return self._take()

    def advance(self) -> None:
        raise NotImplementedError

    def content(self, text: str) -> None:
        if not text:
            return
        body = text.rstrip(WS)
        if not body:
            self._pending_ws += text
            return
        self._out.append(ContentDelta(self._pending_ws + body))
        self._pending_ws = text[len(body):]
        self._content_after_call = True

    def begin_call(self, name: str, call_id: str | None = None) -> int:
        index = self.num_calls
        self.num_calls += 1
        self._pending_ws = ""
        self._args_pending, self._args_started = "", False
        self._content_after_call = False
        self._out.append(ToolCallDelta(index, call_id or self.parser.make_id(index), name))
        return index

    def call_arguments(self, text: str) -> None:
        if text:
            self._out.append(ToolCallDelta(self.num_calls - 1, arguments=text))

    def trimmed_arguments(self, text: str) -> None:
        """Pass on argument text without the whitespace around it: leading whitespace is
        dropped, trailing whitespace is held back until more argument text follows (for
        formats whose arguments end at a marker rather than at their closing brace)."""
        if not self._args_started:
            text = text.lstrip(WS)
            if not text:
                return
            self._args_started = True
        body = text.rstrip(WS)
        if body:
            self.call_arguments(self._args_pending + body)
            self._args_pending = text[len(body):]
        else:
            self._args_pending += text

    def _take(self) -> list[Delta]:
        merged: list[Delta] = []
        for delta in self._out:
            last = merged[-1] if merged else None
            if isinstance(delta, ContentDelta) and isinstance(last, ContentDelta):
                merged[-1] = ContentDelta(last.text + delta.text)
            elif (isinstance(delta, ToolCallDelta) and isinstance(last, ToolCallDelta)
                  and last.index == delta.index and delta.id is None):
                merged[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + delta.arguments)
            else:
                merged.append(delta)
        self._out = []
        return merged


class BufferedToolCallStream(ToolCallStream):
    """For parsers that implement only ``extract()``: everything is reported at the end."""

    def advance(self) -> None:
        if not self.done:
            return
        result = self.parser.extract(self.buf)
        self.buf = ""
        if result.content:
            self._out.append(ContentDelta(result.content))
        for index, call in enumerate(result.calls):
            self._out.append(ToolCallDelta(index, call.id, call.name, call.arguments))
        self.num_calls = len(result.calls)


# ------------------------------------------------------------------------------ reasoning
REASONING, CONTENT, AUTO = "reasoning", "content", "auto"
INITIAL_STATES = (REASONING, CONTENT, AUTO)


class ReasoningParser:
    """Splits model output into reasoning and the answer.

    Where the output starts (``initial``) depends on the prompt: ``"reasoning"`` when the
    chat template opened the reasoning block in the prompt (DeepSeek-R1: the output starts
    inside it), ``"content"`` when the prompt closed it (thinking switched off), ``"auto"``
    when the model opens it itself, if at all, at the start of its output.
    ``initial_state(prompt)`` tells which from the prompt text; None takes
    ``default_initial``. Subclasses implement ``stream()`` or ``extract()``.
    """

    default_initial: str = AUTO
    special_markers: tuple[str, ...] = ()  # as for ToolParser

    def __init__(self, tokenizer: Any = None):
        self.tokenizer = tokenizer

    @property
    def needs_special_tokens(self) -> bool:
        return any(hidden_by_skip_special(self.tokenizer, m) for m in self.special_markers)

    @property
    def reasoning_end_token_ids(self) -> list[int]:
        """Token ids that end the reasoning (empty when the end is not one token)."""
        return []

    @property
    def reasoning_start_token_id(self) -> int | None:
        """The token that opens the reasoning, where it is one token (None otherwise): with an
        ``"auto"`` start and a grammar, the first output token may be it or the grammar's."""
        return None

    def initial_state(self, prompt: str | None) -> str:
        return self.default_initial

    def is_reasoning_end(self, token_ids: list[int], initial: str | None = None) -> bool:
        """Whether the reasoning is over after the output ``token_ids`` (the output only, not
        the prompt): a grammar constraint may apply from the next token on."""
        raise NotImplementedError

    def stream(self, initial: str | None = None) -> ReasoningStream:
        if type(self).extract is ReasoningParser.extract:
            raise NotImplementedError(f"{type(self).__name__} implements neither stream() nor extract()")
        return BufferedReasoningStream(self, initial)

    def extract(self, text: str, initial: str | None = None) -> tuple[str | None, str | None]:
        """(reasoning, content); None for a part that is empty."""
        reasoning, content = self.stream(initial).feed(text, done=True)
        return reasoning or None, content or None

    def _initial(self, initial: str | None) -> str:
        initial = initial or self.default_initial
        if initial not in INITIAL_STATES:
            raise ValueError(f"initial must be one of {', '.join(INITIAL_STATES)}, not {initial!r}")
        return initial


class ReasoningStream:
    """The streaming state of one request: ``feed(delta_text, done)`` returns
    (reasoning_delta, content_delta), each None when there is nothing new."""

    def feed(self, delta_text: str, done: bool = False) -> tuple[str | None, str | None]:
        raise NotImplementedError


class BufferedReasoningStream(ReasoningStream):
    def __init__(self, parser: ReasoningParser, initial: str | None):
        self.parser, self.initial, self.buf = parser, initial, ""

    def feed(self, delta_text: str, done: bool = False) -> tuple[str | None, str | None]:
        self.buf += delta_text
        if not done:
            return None, None
        return self.parser.extract(self.buf, self.initial)


class StateMachineStream(ToolCallStream):
    """A stream written as states: ``advance`` calls ``_<state>()`` until one returns False (it
    needs more text). ``_eat(n)`` takes n characters from ``buf``, remembered in ``raw`` while
    ``collecting`` (text to give back as content if what looked like a call is none)."""

    def __init__(self, parser: ToolParser, state: str):
        super().__init__(parser)
        self.state = state
        self.raw = ""
        self.collecting = False

    def advance(self) -> None:
        while getattr(self, "_" + self.state)():
            pass

    def _eat(self, size: int) -> str:
        taken, self.buf = self.buf[:size], self.buf[size:]
        if self.collecting:
            self.raw += taken
        return taken
