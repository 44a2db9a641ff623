"""Choosing a parser from a model's chat template, only where the template leaves no doubt.

The template is what teaches the model its tool-call and reasoning syntax, so its own
text names the format: ``infer_tool_parser`` and ``infer_reasoning_parser`` return a
built-in parser's name when exactly one format's markers appear, and None otherwise
(no markers, markers of several formats, or a look-alike such as Qwen3-Coder's XML calls
inside ``<tool_call>``): then the user names the parser.
"""

from __future__ import annotations

import re


def _tool_formats(t: str) -> list[str]:
    found = []
    # Qwen2.5/Qwen3/Hermes write JSON inside <tool_call>; Qwen3-Coder (<function=...>) and
    # GLM-4.5 (<arg_key>) use the same tag for XML-like calls this parser does not read.
    if "<tool_call>" in t and '"arguments"' in t and "<function=" not in t and "<arg_key>" not in t:
        found.append("hermes")
    if "[TOOL_CALLS]" in t:
        found.append("mistral")
    if "<｜tool▁calls▁begin｜>" in t or "<｜tool▁call▁begin｜>" in t:
        found.append("deepseek_v3")
    if "<|start_header_id|>" in t and '"parameters"' in t:
        found.append("llama3_json")
    if "[func_name1(" in t:  # the pythonic tool prompt of Llama 3.2 / Llama 4
        found.append("pythonic")
    return found


def infer_tool_parser(chat_template: str | None) -> str | None:
    """The built-in tool parser for this chat template, or None if it is not unambiguous."""
    found = _tool_formats(chat_template or "")
    if len(found) == 2 and "pythonic" in found and "llama3_json" in found:
        return "pythonic"  # a Llama template rewritten for pythonic calls keeps the header tokens
    return found[0] if len(found) == 1 else None


def infer_reasoning_parser(chat_template: str | None) -> str | None:
    """The built-in reasoning parser for this chat template, or None."""
    t = chat_template or ""
    if "<think>" not in t and "</think>" not in t:
        return None
    if "<|im_start|>" in t:  # Qwen3, QwQ
        return "qwen3"
    if "<｜Assistant｜>" in t:  # DeepSeek: V3.1 switches thinking with a template variable
        return "deepseek_v3" if re.search(r"\bthinking\b", t) else "deepseek_r1"
    return None
