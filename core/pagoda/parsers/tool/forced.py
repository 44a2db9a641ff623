"""Tool calls forced by ``tool_choice`` ("required" or a named function): the structured-output
grammar makes the whole output a JSON list ``[{"name": "f", "parameters": {...}}, ...]``
(``ChatCompletionRequest.tool_calls_schema``), read here like the list of Mistral's
``[TOOL_CALLS]`` section, with OpenAI-style call ids. Not a registered parser: the server uses it
for forced calls whatever the model's own format is."""

from __future__ import annotations

from pagoda.parsers.base import ToolCallStream, ToolParser
from pagoda.parsers.tool.mistral import MistralStream


class ForcedToolCallParser(ToolParser):
    def stream(self) -> ToolCallStream:
        return _ForcedStream(self)


class _ForcedStream(MistralStream):
    """The output starts where Mistral's list starts, right after the (absent) marker."""

    def __init__(self, parser: ToolParser):
        super().__init__(parser)
        self.state, self.collecting = "section", True

    def _not_a_call(self) -> bool:  # (a list cut short by max_tokens): what is left is content, no marker
        if self.collecting:
            self.buf = self.raw + self.buf
        self.raw, self.collecting, self.reader, self.state = "", False, None, "content"
        return True
