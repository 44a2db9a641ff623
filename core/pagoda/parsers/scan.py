"""Scanning helpers shared by the parsers: markers that may arrive split across deltas, and
one JSON object followed through a growing text.

Every parser decides only on what it has seen; whatever could still turn out differently
(half of a marker, an escape whose character has not arrived) is left unread until the
next delta, or until the text is done. That is what makes streamed and non-streamed
parsing agree for any split of the text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

WS = " \t\r\n"


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def find_marker(text: str, markers: tuple[str, ...], done: bool) -> tuple[int, str | None, int]:
    """The first of ``markers`` in ``text``: (index, marker, 0) where found; otherwise
    (end of what is surely not a marker, None, length held back), holding back a suffix
    that could begin a marker unless ``done``."""
    best, found = -1, None
    for marker in markers:
        at = text.find(marker)
        if at != -1 and (best == -1 or at < best):
            best, found = at, marker
    if found is not None:
        return best, found, 0
    held = 0 if done else max(partial_marker_len(text, m) for m in markers)
    return len(text) - held, None, held


def starts_with_marker(text: str, marker: str, done: bool) -> bool | None:
    """True if ``text`` starts with ``marker``, False if it cannot, None while undecided
    (``text`` is a proper prefix of ``marker`` and more may come)."""
    if text.startswith(marker):
        return True
    if not done and marker.startswith(text):
        return None
    return False


@dataclass
class Member:
    """One top-level member of a JSON object: its key and where its value is in the text."""

    key: str
    start: int
    end: int | None = None  # None while the value is still arriving


_STRING_STOP = re.compile(r'["\\]')


class JsonObjectScanner:
    """Follows one JSON object through a growing text: where it ends and, at its top level,
    each member's key and value span, available while the object is still arriving.

    The top level is checked strictly, so text that is not an object is recognised as soon
    as it shows; inside member values only strings and bracket depth are tracked (no
    validation), so a value's end is found without parsing it. ``stop`` is a marker (such
    as ``</tool_call>``) that ends the object wherever it appears outside a string.

    ``status``: "open" while reading, "end" after the closing brace, "error" where the text
    stops being an object, "stop" at the stop marker. ``text`` is what was read, ``length``
    its length.
    """

    def __init__(self, stop: str | None = None):
        self._parts: list[str] = []  # what was read, chunk by chunk (joined only when asked)
        self.length = 0
        self.status = "open"
        self.members: list[Member] = []
        self._stop = stop
        self._depth = 0  # 0 before the opening brace, 1 at the top level, more inside values
        self._phase = "key"  # at depth 1: key, colon, value, scalar, after; deeper: nested
        self._string: str | None = None  # inside a string: "key", "value" or "inner"
        self._key_start = 0
        self._key = ""
        special = '"{}[]' + (stop[0] if stop and stop[0] not in '"{}[]' else "")
        self._nested = re.compile("[" + re.escape(special) + "]")

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def slice(self, start: int, end: int) -> str:
        """``text[start:end]``, cheap when it lies in the last chunk read (as new text does)."""
        last = self._parts[-1] if self._parts else ""
        base = self.length - len(last)
        if start >= base:
            return last[start - base:end - base]
        return self.text[start:end]

    def consume(self, chunk: str, done: bool) -> int:
        """Read from ``chunk``; return how many of its characters belong to the object. The
        rest is the caller's: text after the object, or an undecided tail left for the
        next call (none when ``done``). Positions (``Member``) count from the object's start.

        Only ``chunk`` is scanned: whatever could depend on text not yet seen (an escape, a
        possible stop marker) is left unread, so no state reaches back into earlier chunks
        but a key's start, which ``_close_string`` reads through ``slice``."""
        s = chunk
        i = 0
        n = len(s)
        self._base = self.length
        while i < n and self.status == "open":
            if self._string is not None:
                m = _STRING_STOP.search(s, i)
                if m is None:
                    i = n
                    break
                j = m.start()
                if s[j] == "\\":
                    if j + 1 >= n and not done:
                        i = j  # the escaped character has not arrived yet
                        break
                    i = min(j + 2, n)
                    continue
                i = j + 1
                self._close_string(s, i)
                continue
            if self._phase == "nested":
                m = self._nested.search(s, i)
                if m is None:
                    i = n
                    break
                i = m.start()
                c = s[i]
                if c == '"':
                    self._string = "inner"
                elif c in "{[":
                    self._depth += 1
                elif c in "}]":
                    self._depth -= 1
                    if self._depth == 1:
                        self.members[-1].end = self._base + i + 1
                        self._phase = "after"
                else:  # the stop marker's first character
                    at_stop = self._at_stop(s, i, done)
                    if at_stop is not None:
                        break
                i += 1
                continue
            if self._at_stop(s, i, done) is not None:
                break
            c = s[i]
            if self._depth == 0:
                if c in WS:
                    i += 1
                elif c == "{":
                    self._depth, self._phase = 1, "key"
                    i += 1
                else:
                    self.status = "error"
                continue
            i = self._top_level(s, i, c)
        if i:
            self._parts.append(s[:i])
            self.length += i
        return i

    def _at_stop(self, s: str, i: int, done: bool) -> str | None:
        """"stop" (status set) or "wait" where the stop marker is, or may be, at ``i``."""
        if self._stop is None:
            return None
        seen = starts_with_marker(s[i:i + len(self._stop)], self._stop, done)
        if seen:
            self.status = "stop"
            return "stop"
        return "wait" if seen is None else None

    def _top_level(self, s: str, i: int, c: str) -> int:
        """One character at depth 1; returns the next position (unchanged where a scalar ends)."""
        phase = self._phase
        at = self._base + i
        if phase == "scalar":
            if c in WS or c in ",}":
                self.members[-1].end = at
                self._phase = "after"
                return i
            return i + 1
        if c in WS:
            return i + 1
        if phase == "key" and c == '"':
            self._string, self._key_start = "key", at
        elif phase == "key" and c == "}" and not self.members:
            self._depth, self.status = 0, "end"
        elif phase == "colon" and c == ":":
            self._phase = "value"
        elif phase == "value" and c not in "}],:":
            self.members.append(Member(self._key, at))
            if c == '"':
                self._string = "value"
            elif c in "{[":
                self._depth, self._phase = 2, "nested"
            else:
                self._phase = "scalar"
        elif phase == "after" and c == ",":
            self._phase = "key"
        elif phase == "after" and c == "}":
            self._depth, self.status = 0, "end"
        else:
            self.status = "error"
            return i
        return i + 1

    def _close_string(self, s: str, end: int) -> None:
        """A string closed at ``s[end - 1]`` (``s`` the chunk being read)."""
        role, self._string = self._string, None
        end += self._base
        if role == "key":
            start, stop = self._key_start - self._base, end - self._base
            raw = s[start:stop] if start >= 0 else self.text[self._key_start:] + s[:stop]
            try:
                self._key = json.loads(raw)
            except ValueError:
                self.status = "error"
                return
            self._phase = "colon"
        elif role == "value":
            self.members[-1].end = end
            self._phase = "after"
