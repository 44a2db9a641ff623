"""``deepseek_r1``: DeepSeek-R1 and its distills, whose template ends the prompt with
``<think>\\n``: the output starts inside the reasoning and ``</think>`` ends it (an output
that repeats ``<think>`` is read the same). Without ``</think>`` the whole output is
reasoning (it was cut short)."""

from pagoda.parsers.base import REASONING
from pagoda.parsers.reasoning.think import ThinkReasoningParser


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    default_initial = REASONING
