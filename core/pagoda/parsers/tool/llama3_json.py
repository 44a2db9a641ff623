"""``llama3_json``: JSON calls as Llama 3.1, 3.2 and 3.3 write them with their chat
templates' JSON tool prompt,

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

one object per call with ``"parameters"`` (or ``"arguments"``), several separated by
``;``, the ``<|python_tag|>`` optional (it is dropped wherever it appears). An object
is a call only if its members are ``name`` and ``parameters``/``arguments``; any other
JSON, and all other text, is content. Llama 3.1's built-in tools
(``<|python_tag|>brave_search.call(query="...")``) are not JSON and stay content.
"""

from __future__ import annotations

from pagoda.parsers.base import ToolCallStream, ToolParser
from pagoda.parsers.scan import WS, find_marker
from pagoda.parsers.tool.json_call import JsonCallReader

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def stream(self) -> ToolCallStream:
        return Llama3JsonStream(self)


class Llama3JsonStream(ToolCallStream):
    def __init__(self, parser: ToolParser):
        super().__init__(parser)
        self.reader: JsonCallReader | None = None
        self.separator = False  # after a call: a ';' may follow

    def advance(self) -> None:
        while True:
            if self.reader is not None:
                self.buf = self.buf[self.reader.consume(self.buf, self.done):]
                if not self.reader.finished:
                    return
                if self.reader.malformed:  # not a call: its brace is content, rescan after it
                    text = self.reader.scan.text + self.buf
                    self.content(text[:1])
                    self.buf = text[1:]
                else:
                    self.separator = True
                self.reader = None
                continue
            if self.separator:
                rest = self.buf.lstrip(WS)
                if not rest and not self.done:
                    return
                if rest.startswith(";"):
                    self.buf = rest[1:]
                self.separator = False
                continue
            at, marker, _ = find_marker(self.buf, (PYTHON_TAG, "{"), self.done)
            self.content(self.buf[:at])
            if marker is None:
                self.buf = self.buf[at:]
                return
            if marker == PYTHON_TAG:
                self.buf = self.buf[at + len(PYTHON_TAG):]
                continue
            self.buf = self.buf[at:]
            self.reader = JsonCallReader(self)
