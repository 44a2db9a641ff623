"""``pythonic``: calls written as a Python list, as Llama 3.2 and Llama 4 do with their
pythonic tool prompts,

    [get_weather(city="Paris", days=3), get_time()]

optionally inside ``<|python_start|>`` ... ``<|python_end|>``. The list must open the
output (after whitespace); text after it is content. The list is parsed with Python's
``ast`` (never evaluated): each element must be a call of a plain name with keyword
arguments whose values are literals (strings, numbers, True/False/None and the JSON
spellings true/false/null, lists, tuples, dicts); the arguments become JSON with
``json.dumps``. A list that is not entirely such calls is content, as is an unclosed one.
The calls are reported when the list closes.
"""

from __future__ import annotations

import ast
import json

from pagoda.parsers.base import StateMachineStream, ToolCallStream, ToolParser
from pagoda.parsers.scan import WS, starts_with_marker

PY_START, PY_END = "<|python_start|>", "<|python_end|>"
_JSON_NAMES = {"true": True, "false": False, "null": None}


class PythonicToolParser(ToolParser):
    def stream(self) -> ToolCallStream:
        return PythonicStream(self)


def parse_call_list(text: str) -> list[tuple[str, str]] | None:
    """[(name, arguments JSON)] for a Python list of calls, or None if it is not one."""
    try:
        node = ast.parse(text.strip(WS), mode="eval").body
        if not isinstance(node, ast.List) or not node.elts:
            return None
        calls = []
        for call in node.elts:
            if not isinstance(call, ast.Call) or call.args or not isinstance(call.func, ast.Name):
                return None
            if any(kw.arg is None for kw in call.keywords):  # **kwargs
                return None
            args = {kw.arg: _literal(kw.value) for kw in call.keywords}
            calls.append((call.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False)))
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


def _literal(node: ast.AST):
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("a sign before something that is not a number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(k) if k is not None else None for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("dict keys must be strings")
        return dict(zip(keys, (_literal(v) for v in node.values)))
    raise ValueError(f"not a literal: {type(node).__name__}")


class PythonListScanner:
    """Finds the bracket that closes a Python list, skipping over string literals."""

    def __init__(self) -> None:
        self.depth = 0
        self.quote: str | None = None
        self.complete = False

    def consume(self, s: str, done: bool) -> int:
        i, n = 0, len(s)
        while i < n and not self.complete:
            c = s[i]
            if self.quote is not None:
                q = self.quote
                if c == "\\":
                    if i + 1 >= n and not done:
                        break
                    i += 2
                elif s.startswith(q, i):
                    self.quote = None
                    i += len(q)
                elif len(q) == 3 and not done and q.startswith(s[i:]):
                    break  # may be the closing triple quote
                else:
                    i += 1
                continue
            if c in "'\"":
                if s.startswith(c * 3, i):
                    self.quote = c * 3
                    i += 3
                    continue
                if not done and (c * 3).startswith(s[i:]):
                    break  # a triple quote or an empty string: not known yet
                self.quote = c
            elif c in "([{":
                self.depth += 1
            elif c in ")]}":
                self.depth -= 1
                self.complete = self.depth == 0
            i += 1
        return min(i, n)


class PythonicStream(StateMachineStream):
    # raw: the text of a candidate list, given back as content if it is not one
    def __init__(self, parser: ToolParser):
        super().__init__(parser, "start")
        self.scanner = PythonListScanner()

    def _start(self) -> bool:
        rest = self.buf.lstrip(WS)
        space = self.buf[:len(self.buf) - len(rest)]
        if self.raw:  # after <|python_start|>: part of what is given back if no list follows
            self.raw += space
        else:
            self.content(space)
        self.buf = rest
        if not rest and not self.done:
            return False
        if not self.raw:
            seen = starts_with_marker(rest, PY_START, self.done)
            if seen is None:
                return False
            if seen:
                self.raw, self.buf = PY_START, rest[len(PY_START):]
                return True
        self.state = "list" if self.buf.startswith("[") else "give_back"
        return True

    def _list(self) -> bool:
        taken = self.scanner.consume(self.buf, self.done)
        self.raw += self.buf[:taken]
        self.buf = self.buf[taken:]
        if not self.scanner.complete:
            return self.done and self._give_back()
        calls = parse_call_list(self.raw.removeprefix(PY_START))
        if calls is None:
            return self._give_back()
        for name, arguments in calls:
            self.begin_call(name)
            self.call_arguments(arguments)
        self.state = "after"
        return True

    def _give_back(self) -> bool:
        self.content(self.raw)
        self.raw, self.state = "", "content"
        return True

    def _after(self) -> bool:
        rest = self.buf.lstrip(WS)
        seen = starts_with_marker(rest, PY_END, self.done)
        if seen is None:
            return False
        if seen:
            self.buf = rest[len(PY_END):]
        self.state = "content"
        return True

    def _content(self) -> bool:
        self.content(self.buf)
        self.buf = ""
        return False
