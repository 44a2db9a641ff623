"""``hermes``: Hermes-style calls as Qwen2.5 and Qwen3 (and NousResearch Hermes) write them,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one JSON object per ``<tool_call>`` block, any number of blocks, with content before
(and, rarely, between or after) them. A block whose text is not such an object is
content, tags included.
"""

from __future__ import annotations

from pagoda.parsers.base import ToolCallStream, ToolParser
from pagoda.parsers.scan import WS, find_marker, starts_with_marker
from pagoda.parsers.tool.json_call import JsonCallReader

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    special_markers = (START, END)

    def stream(self) -> ToolCallStream:
        return HermesStream(self)


class HermesStream(ToolCallStream):
    def __init__(self, parser: ToolParser):
        super().__init__(parser)
        self.reader: JsonCallReader | None = None
        self.closing = False  # after a call: an end tag may follow

    def advance(self) -> None:
        while True:
            if self.reader is not None:
                self.buf = self.buf[self.reader.consume(self.buf, self.done):]
                if not self.reader.finished:
                    return
                if self.reader.malformed:  # not a call: the tag and its text are content
                    self.content(START)
                    self.buf = self.reader.scan.text + self.buf
                else:
                    self.closing = True
                self.reader = None
                continue
            if self.closing:
                rest = self.buf.lstrip(WS)
                seen = starts_with_marker(rest, END, self.done)
                if seen is None:
                    return
                if seen:
                    self.buf = rest[len(END):]
                self.closing = False
                continue
            at, marker, _ = find_marker(self.buf, (START,), self.done)
            self.content(self.buf[:at])
            if marker is None:
                self.buf = self.buf[at:]
                return
            self.buf = self.buf[at + len(START):]
            self.reader = JsonCallReader(self, stop=END)
