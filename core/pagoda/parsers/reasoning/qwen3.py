"""``qwen3``: Qwen3 (hybrid thinking and the 2507 Thinking models) and QwQ.

With thinking on, Qwen3's template leaves the assistant turn empty and the model opens
``<think>`` itself; with ``enable_thinking=False`` the template writes an empty
``<think>\\n\\n</think>`` into the prompt and the output is all content; the Thinking-2507
models and QwQ get ``<think>`` in the prompt and start inside the reasoning. Pass the
prompt to ``initial_state`` to tell these apart; without it the model is assumed to open
the block itself ("auto").
"""

from pagoda.parsers.base import AUTO
from pagoda.parsers.reasoning.think import ThinkReasoningParser


class Qwen3ReasoningParser(ThinkReasoningParser):
    default_initial = AUTO
