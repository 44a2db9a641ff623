"""``deepseek_v3``: DeepSeek-V3.1's hybrid thinking. Its template ends the prompt with
``<think>`` in thinking mode (``thinking=True``: the output starts inside the reasoning,
as with R1) and with ``</think>`` otherwise (the output is all content). That differs from
R1 only when the prompt is not known: V3.1's default is thinking off, so "content"."""

from pagoda.parsers.base import CONTENT
from pagoda.parsers.reasoning.think import ThinkReasoningParser


class DeepSeekV3ReasoningParser(ThinkReasoningParser):
    default_initial = CONTENT
