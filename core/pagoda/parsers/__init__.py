"""Parsers of model output for the server: tool calls (``ToolParser``) and reasoning
(``ReasoningParser``), chosen by name (``register_tool_parsers`` /
``register_reasoning_parsers``) or from the chat template. See docs/parsers.md."""

from pagoda.parsers.base import (
           AUTO,
           CONTENT,
           REASONING,
           ContentDelta,
           Delta,
           ReasoningParser,
           ReasoningStream,
           ToolCall,
           ToolCallDelta,
           ToolCallResult,
           ToolCallStream,
           ToolParser,
)
from pagoda.parsers.infer import infer_reasoning_parser, infer_tool_parser

__all__ = ["AUTO", "CONTENT", "REASONING", "ContentDelta", "Delta", "ReasoningParser", "ReasoningStream",
           "ToolCall", "ToolCallDelta", "ToolCallResult", "ToolCallStream", "ToolParser",
           "infer_reasoning_parser", "infer_tool_parser"]
