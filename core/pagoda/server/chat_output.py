"""From a chat completion's text to OpenAI's assistant message: the reasoning (a reasoning parser),
the tool calls (the request's tool parser, or the forced-call reader when tool_choice forced them)
and the content, whole (``message``) or as streamed deltas (``ChoiceStream``). A parser instance per
completion, so that call ids are the same streamed and not."""

from __future__ import annotations

from typing import Any

from pagoda.parsers import ContentDelta, ToolCallDelta
from pagoda.parsers.tool.forced import ForcedToolCallParser


class ChatOutput:
    """How one request's completions are read. ``reasoning_cls`` / ``tool_cls``: parser classes, or
    None; ``forced``: the grammar forced tool calls; ``prompt``: the rendered prompt (where the
    output starts: inside the reasoning or not)."""

    def __init__(self, tokenizer, reasoning_cls, tool_cls, tools: list[dict] | None, forced: bool,
                 prompt: str | None):
        self.tokenizer = tokenizer
        self.reasoning_cls = reasoning_cls
        self.tool_cls = ForcedToolCallParser if forced else (tool_cls if tools else None)
        self.tools = tools
        self.initial = reasoning_cls(tokenizer).initial_state(prompt) if reasoning_cls is not None else None

    @property
    def needs_special_tokens(self) -> bool:
        """Whether a parser's markers are special tokens, so the text must keep them."""
        return any(cls is not None and cls(self.tokenizer).needs_special_tokens
                   for cls in (self.reasoning_cls, self.tool_cls))

    def _tool_parser(self):
        return None if self.tool_cls is None else self.tool_cls(self.tokenizer, self.tools)

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """(the assistant message, whether it calls tools) of a finished completion's text."""
        reasoning, content = (None, text) if self.reasoning_cls is None else \
            self.reasoning_cls(self.tokenizer).extract(text, self.initial)
        calls = []
        parser = self._tool_parser()
        if parser is not None and content is not None:
            result = parser.extract(content)
            content, calls = result.content, result.calls
        message: dict[str, Any] = {"role": "assistant", "content": content if content is not None or calls else ""}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return message, bool(calls)

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One completion's deltas: ``feed(text, done)`` -> a list of OpenAI delta objects
    (``{"reasoning_content": ...}``, ``{"content": ...}``, ``{"tool_calls": [...]}``)."""

    def __init__(self, output: ChatOutput):
        self.reasoning = None if output.reasoning_cls is None else \
            output.reasoning_cls(output.tokenizer).stream(output.initial)
        parser = output._tool_parser()
        self.tools = None if parser is None else parser.stream()
        self.called = False

    def feed(self, text: str, done: bool) -> list[dict]:
        out: list[dict] = []
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.feed(text, done)
        if reasoning:
            out.append({"reasoning_content": reasoning})
        if self.tools is None:
            if content:
                out.append({"content": content})
            return out
        for delta in self.tools.feed(content or "", done):
            if isinstance(delta, ContentDelta):
                out.append({"content": delta.text})
            elif isinstance(delta, ToolCallDelta):
                self.called = True
                call: dict[str, Any] = {"index": delta.index, "function": {"arguments": delta.arguments}}
                if delta.id is not None:
                    call.update(id=delta.id, type="function")
                    call["function"]["name"] = delta.name
                out.append({"tool_calls": [call]})
        return out
