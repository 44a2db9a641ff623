"""Reasoning inside ``<think>`` ... ``</think>``, the convention of Qwen3, QwQ and DeepSeek's
reasoning models; ``qwen3``, ``deepseek_r1`` and ``deepseek_v3`` differ only in where the
output starts when the prompt does not say (``default_initial``).

The reasoning is reported without the whitespace around it, the content without the
whitespace that follows ``</think>``; a content-only output comes back unchanged.
"""

from __future__ import annotations

from pagoda.parsers.base import AUTO, CONTENT, REASONING, ReasoningParser, ReasoningStream, single_token_id
from pagoda.parsers.scan import WS, find_marker, starts_with_marker


class ThinkReasoningParser(ReasoningParser):
    start_tag, end_tag = "<think>", "</think>"

    def __init__(self, tokenizer=None):
        super().__init__(tokenizer)
        self.special_markers = (self.start_tag, self.end_tag)
        self._start_id = single_token_id(tokenizer, self.start_tag)
        self._end_id = single_token_id(tokenizer, self.end_tag)

    @property
    def reasoning_end_token_ids(self) -> list[int]:
        return [] if self._end_id is None else [self._end_id]

    @property
    def reasoning_start_token_id(self) -> int | None:
        return self._start_id

    def initial_state(self, prompt: str | None) -> str:
        """From the end of the rendered prompt: an open ``<think>`` means the output starts in
        the reasoning, a closed ``</think>`` that thinking is off."""
        tail = (prompt or "").rstrip(WS)
        if tail.endswith(self.start_tag):
            return REASONING
        if tail.endswith(self.end_tag):
            return CONTENT
        return self.default_initial

    def is_reasoning_end(self, token_ids: list[int], initial: str | None = None) -> bool:
        initial = self._initial(initial)
        if initial == CONTENT:
            return True
        if self._start_id is None or self._end_id is None:  # the tags are not single tokens
            if self.tokenizer is None:
                raise ValueError("is_reasoning_end needs the tokenizer the parser was made with")
            stream = ThinkStream(self, initial)
            stream.feed(self.tokenizer.decode(token_ids, skip_special_tokens=False))
            return stream.past_reasoning
        if initial == AUTO:
            if not token_ids:
                return False
            if token_ids[0] != self._start_id:
                return True  # the model did not open a reasoning block
        return self._end_id in token_ids

    def stream(self, initial: str | None = None) -> ReasoningStream:
        return ThinkStream(self, self._initial(initial))


class ThinkStream(ReasoningStream):
    def __init__(self, parser: ThinkReasoningParser, initial: str):
        self.start_tag, self.end_tag = parser.start_tag, parser.end_tag
        # "start": the output may open with <think>; "open": it starts in the reasoning
        # (and may repeat <think>); then "reasoning", "after" (</think> seen), "content".
        self.state = "open" if initial == REASONING else "start"
        self.buf = ""
        self.started = False  # reasoning text seen (its leading whitespace is dropped)
        self.pending = ""  # trailing whitespace of the reasoning, not yet known to be inside it
        self._finished = False

    @property
    def past_reasoning(self) -> bool:
        return self.state in ("after", "content")

    def feed(self, delta_text: str, done: bool = False) -> tuple[str | None, str | None]:
        if self._finished:
            raise RuntimeError("feed() called after done=True")
        self._finished = done
        self.buf += delta_text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self.state in ("start", "open"):
                rest = self.buf.lstrip(WS)
                seen = starts_with_marker(rest, self.start_tag, done)
                if seen is None:
                    break
                if seen:
                    self.buf, self.state = rest[len(self.start_tag):], "reasoning"
                else:
                    self.state = "content" if self.state == "start" else "reasoning"
            elif self.state == "reasoning":
                at, marker, _ = find_marker(self.buf, (self.end_tag,), done)
                self._reason(self.buf[:at], reasoning)
                self.buf = self.buf[at:]
                if marker is None:
                    break
                self.buf, self.state, self.pending = self.buf[len(self.end_tag):], "after", ""
            elif self.state == "after":
                rest = self.buf.lstrip(WS)
                self.buf = rest
                if not rest:
                    break
                self.state = "content"
            else:
                content.append(self.buf)
                self.buf = ""
                break
        return "".join(reasoning) or None, "".join(content) or None

    def _reason(self, text: str, out: list[str]) -> None:
        if not self.started:
            text = text.lstrip(WS)
            if not text:
                return
            self.started = True
        body = text.rstrip(WS)
        if body:
            out.append(self.pending + body)
            self.pending = text[len(body):]
        else:
            self.pending += text
