"""A tool call written as a JSON object, ``{"name": "f", "arguments": {...}}`` (or
``"parameters"``), read from a growing text: shared by the hermes, llama3_json and
mistral parsers.

The call starts (its id and name are reported) as soon as the name is complete and the
arguments object has begun; the arguments are then passed on character by character as
the model writes them. Before that point anything unexpected (another key, a name that
is not a string, arguments that are not an object, text that is not JSON) makes the
object "malformed" and the caller gives its text back as content.
"""

from __future__ import annotations

import json

from pagoda.parsers.base import ToolCallStream
from pagoda.parsers.scan import JsonObjectScanner, Member

ARGUMENT_KEYS = ("arguments", "parameters")
ALLOWED_KEYS = ("name", *ARGUMENT_KEYS, "id", "type")


class JsonCallReader:
    def __init__(self, stream: ToolCallStream, stop: str | None = None):
        self.stream = stream
        self.scan = JsonObjectScanner(stop)
        self.name: str | None = None
        self.args: Member | None = None
        self.started = False
        self.malformed = False
        self.finished = False  # the object (or what is left of it) is read
        self._sent = 0  # characters of the arguments already reported

    def consume(self, text: str, done: bool) -> int:
        """Read from ``text``; return how many characters the call object took."""
        taken = self.scan.consume(text, done)
        self._check()
        if self.scan.status != "open" or done:
            self.finished = True
            if not self.started:
                self.malformed = True
        return taken

    def _check(self) -> None:
        scan = self.scan
        for member in scan.members:
            if member.key not in ALLOWED_KEYS:
                if not self.started:
                    self.malformed = self.finished = True
                    return
            elif member.key == "name" and self.name is None and member.end is not None:
                name = _string(scan.slice(member.start, member.end))
                if not isinstance(name, str) or not name:
                    self.malformed = self.finished = True
                    return
                self.name = name
            elif member.key in ARGUMENT_KEYS and self.args is None:
                if scan.slice(member.start, member.start + 1) != "{":
                    self.malformed = self.finished = True
                    return
                self.args = member
        if self.malformed:
            return
        if not self.started and self.name is not None and self.args is not None:
            self.started = True
            self.stream.begin_call(self.name)
        if self.started:
            end = self.args.end if self.args.end is not None else scan.length
            start = self.args.start + self._sent
            self.stream.call_arguments(scan.slice(start, end))
            self._sent = end - self.args.start


def _string(value: str) -> str | None:
    """The JSON string literal ``value`` decoded, or None if it is not one."""
    if not (value.startswith('"') and value.endswith('"')):
        return None
    try:
        return json.loads(value)
    except ValueError:
        return None
