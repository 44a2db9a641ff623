"""``mistral``: Mistral's ``[TOOL_CALLS]`` formats, decoded with special tokens kept.

- Tokenizer v2 to v7 (Mistral-7B-Instruct-v0.3, Mixtral-8x22B, Mistral-Nemo, Mistral
  Small 3.1 with its HF template): ``[TOOL_CALLS] [{"name": "f", "arguments": {...}},
  {...}]``, one JSON list; an ``"id"`` member in an object is ignored.
- Tokenizer v11 and later (Mistral Small 3.2, Magistral, Devstral, Ministral 3):
  ``[TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}``, and
  ``[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{...}`` whose call id is kept. The arguments
  run to the next ``[TOOL_CALLS]`` or the end of the output, as the model wrote them.

Mistral's templates accept only 9-character alphanumeric call ids, so the ids made here
have that shape. A ``[TOOL_CALLS]`` not followed by a call is content.
"""

from __future__ import annotations

import re

from pagoda.parsers.base import StateMachineStream, ToolCallStream, ToolParser, derived_id
from pagoda.parsers.scan import WS, find_marker
from pagoda.parsers.tool.json_call import JsonCallReader

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
_MAX_NAME = 256


class MistralToolParser(ToolParser):
    special_markers = (TOOL_CALLS,)

    def make_id(self, index: int) -> str:
        if self.id_factory is not None:
            return self.id_factory(index)
        return derived_id(self._id_seed, index, 9)

    def stream(self) -> ToolCallStream:
        return MistralStream(self)


class MistralStream(StateMachineStream):
    # raw: text read since the last [TOOL_CALLS], while no call has started after it
    def __init__(self, parser: ToolParser):
        super().__init__(parser, "content")
        self.reader: JsonCallReader | None = None
        self.name = ""
        self.call_id: str | None = None

    def _not_a_call(self) -> bool:
        """What followed [TOOL_CALLS] is no call: before any call of the section the marker
        and that text are content; after one, the text from here on is."""
        if self.collecting:
            self.content(TOOL_CALLS)
            self.buf = self.raw + self.buf
        self.raw, self.collecting, self.reader, self.state = "", False, None, "content"
        return True

    def _content(self) -> bool:
        at, marker, _ = find_marker(self.buf, (TOOL_CALLS,), self.done)
        self.content(self.buf[:at])
        self.buf = self.buf[at:]
        if marker is None:
            return False
        self.buf = self.buf[len(TOOL_CALLS):]
        self.raw, self.collecting, self.state = "", True, "section"
        return True

    def _skip_ws(self) -> bool:
        """Drop leading whitespace; False while nothing else has arrived."""
        self._eat(len(self.buf) - len(self.buf.lstrip(WS)))
        return bool(self.buf) or self.done

    def _section(self) -> bool:  # right after [TOOL_CALLS]: a JSON list, or a v11 name
        if not self._skip_ws():
            return False
        if self.buf.startswith("["):
            self._eat(1)
            self.state = "list_item"
        else:
            self.name, self.call_id, self.state = "", None, "name"
        return True

    def _list_item(self) -> bool:
        if not self._skip_ws():
            return False
        if not self.buf.startswith("{"):
            return self._not_a_call()
        self.reader, self.state = JsonCallReader(self), "list_call"
        return True

    def _list_call(self) -> bool:
        self.buf = self.buf[self.reader.consume(self.buf, self.done):]
        if not self.reader.finished:
            return False
        if self.reader.malformed:
            self.buf = self.reader.scan.text + self.buf
            return self._not_a_call()
        self.raw, self.collecting = "", False
        self.reader, self.state = None, "list_sep"
        return True

    def _list_sep(self) -> bool:
        if not self._skip_ws():
            return False
        if self.buf.startswith(","):
            self.buf, self.state = self.buf[1:], "list_item"
        elif self.buf.startswith("]"):
            self.buf, self.state = self.buf[1:], "content"
        else:
            self.state = "content"
        return True

    def _name(self) -> bool:  # v11: the function name, up to [ARGS], [CALL_ID] or '{'
        at, marker, _ = find_marker(self.buf, (ARGS, CALL_ID, "{"), self.done)
        if _NAME.fullmatch(self.buf[:at]) is None or len(self.name) + at > _MAX_NAME:
            return self._not_a_call()
        self.name += self._eat(at)
        if marker is None:
            return self.done and self._not_a_call()
        if not self.name:
            return self._not_a_call()
        if marker != "{":
            self._eat(len(marker))
        self.state = "call_id" if marker == CALL_ID else "args_start"
        return True

    def _call_id(self) -> bool:
        at, marker, _ = find_marker(self.buf, (ARGS,), self.done)
        if marker is None:
            return self.done and self._not_a_call()
        call_id = self._eat(at).strip(WS)
        self._eat(len(ARGS))
        if not call_id.isalnum():
            return self._not_a_call()
        self.call_id, self.state = call_id, "args_start"
        return True

    def _args_start(self) -> bool:
        if not self._skip_ws():
            return False
        if not self.buf.startswith("{"):
            return self._not_a_call()
        self.begin_call(self.name, self.call_id)
        self.raw, self.collecting, self.state = "", False, "args"
        return True

    def _args(self) -> bool:  # the arguments run to the next [TOOL_CALLS] or the end
        at, marker, _ = find_marker(self.buf, (TOOL_CALLS,), self.done)
        self.trimmed_arguments(self.buf[:at])
        self.buf = self.buf[at:]
        if marker is None:
            return False
        self.buf = self.buf[len(TOOL_CALLS):]
        self.raw, self.collecting = "", True
        self.name, self.call_id, self.state = "", None, "name"
        return True
