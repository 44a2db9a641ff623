"""``deepseek_v3``: DeepSeek's tool-call tokens, in both of its layouts.

- DeepSeek-V3 (0324) and DeepSeek-R1 (their templates write calls this way)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

- DeepSeek-V3.1 (also registered as ``deepseek_v31``)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>
    <｜tool▁calls▁end｜>    (no line break in the output)

The layout is told per call by what follows ``<｜tool▁sep｜>``: a JSON object (V3.1) or a
name line and a json fence (V3). The arguments are passed on as written. DeepSeek-V3.2's
DSML format is not this parser's. A section that holds no call is content.
"""

from __future__ import annotations

from pagoda.parsers.base import StateMachineStream, ToolCallStream, ToolParser
from pagoda.parsers.scan import WS, find_marker, starts_with_marker

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE, FENCE_CLOSE = "```json", "\n```"
_MAX_HEAD = 256  # longest name (or V3 call type) accepted


class DeepSeekV3ToolParser(ToolParser):
    special_markers = (CALLS_BEGIN, CALL_BEGIN, SEP, CALL_END, CALLS_END)

    def stream(self) -> ToolCallStream:
        return DeepSeekStream(self)


class DeepSeekStream(StateMachineStream):
    # raw: text read after the anchor while no call has started
    def __init__(self, parser: ToolParser):
        super().__init__(parser, "content")
        self.anchor = CALLS_BEGIN  # the marker given back as content if no call follows it
        self.in_section = 0  # calls made in the current section
        self.head = ""
        self.args_end: tuple[str, ...] = ()

    def _not_a_call(self) -> bool:
        if self.collecting:
            self.content(self.anchor)
            self.buf = self.raw + self.buf
        self.raw, self.collecting, self.state = "", False, "content"
        return True

    def _content(self) -> bool:
        at, marker, _ = find_marker(self.buf, (CALLS_BEGIN,), self.done)
        self.content(self.buf[:at])
        self.buf = self.buf[at:]
        if marker is None:
            return False
        self.buf = self.buf[len(CALLS_BEGIN):]
        self.anchor, self.raw, self.collecting = CALLS_BEGIN, "", True
        self.in_section, self.state = 0, "section"
        return True

    def _section(self) -> bool:  # between calls: the next call, or the end of the section
        self._eat(len(self.buf) - len(self.buf.lstrip(WS)))
        for marker, state in ((CALL_BEGIN, "head"), (CALLS_END, "content")):
            seen = starts_with_marker(self.buf, marker, self.done)
            if seen is None:
                return False
            if seen and (marker == CALL_BEGIN or self.in_section):
                self._eat(len(marker))
                if marker == CALL_BEGIN and self.in_section:
                    self.anchor, self.raw, self.collecting = CALL_BEGIN, "", True
                self.state = state
                return True
        return self._not_a_call() if self.in_section == 0 else self._leave()

    def _leave(self) -> bool:
        self.state = "content"
        return True

    def _head(self) -> bool:  # the name (V3.1) or the call type (V3), up to the separator
        at, marker, _ = find_marker(self.buf, (SEP,), self.done)
        piece = self.buf[:at]
        if "<｜" in piece or "\n" in piece.strip(WS) or len(piece) > _MAX_HEAD:
            return self._not_a_call()
        if marker is None:
            return self.done and self._not_a_call()
        self.head = self._eat(at).strip(WS)
        self._eat(len(SEP))
        self.state = "after_sep"
        return True

    def _after_sep(self) -> bool:
        rest = self.buf.lstrip(WS)
        if not rest and not self.done:
            return False
        if rest.startswith("{"):  # V3.1: the head was the name; the arguments follow
            if not self.head:
                return self._not_a_call()
            return self._start(self.head, (CALL_END,))
        self.state = "name"
        return True

    def _name(self) -> bool:  # V3: the name, on the line after the separator
        at, marker, _ = find_marker(self.buf, ("\n",), self.done)
        name = self.buf[:at].strip(WS)
        if "<｜" in name or at > _MAX_HEAD or (marker is None and self.done) or (marker and not name):
            return self._not_a_call()
        if marker is None:
            return False
        self._eat(at + 1)
        self.head, self.state = name, "fence"
        return True

    def _fence(self) -> bool:
        self._eat(len(self.buf) - len(self.buf.lstrip(WS)))
        seen = starts_with_marker(self.buf, FENCE, self.done)
        if seen is None:
            return False
        if not seen:
            return self._not_a_call()
        self._eat(len(FENCE))
        return self._start(self.head, (FENCE_CLOSE, CALL_END))

    def _start(self, name: str, ends: tuple[str, ...]) -> bool:
        self.begin_call(name)
        self.in_section += 1
        self.raw, self.collecting = "", False
        self.args_end, self.state = ends, "args"
        return True

    def _args(self) -> bool:
        at, marker, _ = find_marker(self.buf, self.args_end, self.done)
        self.trimmed_arguments(self.buf[:at])
        self.buf = self.buf[at:]
        if marker is None:
            return False
        self.buf = self.buf[len(marker):]
        self.state = "close" if marker == FENCE_CLOSE else "section"
        return True

    def _close(self) -> bool:  # V3: after the closing fence, the call's end token
        rest = self.buf.lstrip(WS)
        seen = starts_with_marker(rest, CALL_END, self.done)
        if seen is None:
            return False
        if seen:
            self.buf = rest[len(CALL_END):]
        self.state = "section"
        return True
