"""Outputs between an engine process and its front as deltas: each step sends what is new, not the whole.

A ``RequestOutput`` is cumulative (the prompt's ids, every token and the text so far), so sending it whole
after every step costs each stream O(length) per step to pickle, send and unpickle: with a replica
streaming to the server (``pagoda.distributed.dp_replica``), long prompts and long outputs made that the
engine's own host work. The replica's ``OutputSender`` sends a request's first output whole, then per
completion the tokens, text and logprobs added since (and where the text was cut back, e.g. at a stop
string: how much of what was sent stays). The front's ``OutputReceiver`` rebuilds the cumulative outputs,
new objects each time (a reader may still hold the previous one). Both forget a request once its final
output passed, or when it is aborted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from pagoda.outputs import CompletionOutput, RequestOutput


@dataclass
class CompletionDelta:
    index: int
    token_start: int  # tokens kept of the ones sent before
    token_ids: list[int]  # added after them
    text_keep: int  # characters kept of the text sent before
    text: str  # added after them
    logprobs_start: int
    logprobs: list | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: Any


@dataclass
class OutputDelta:
    request_id: str
    finished: bool
    completions: list[CompletionDelta]
    metrics: Any
    num_cached_tokens: int
    extra: dict
    error: str | None
    prompt_logprobs: list | None  # None: as sent before


@dataclass
class _Sent:
    """What the front holds of one completion."""

    tokens: int
    last_token: int | None
    text: str
    logprobs: int


class OutputSender:
    """Replica side: ``encode(outputs)`` -> what to send (``RequestOutput`` or ``OutputDelta`` each)."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[dict[int, _Sent], bool]] = {}  # request id -> (per completion, prompt logprobs)

    def encode(self, outputs: list[RequestOutput]) -> list:
        return [self._encode(out) for out in outputs]

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._sent.pop(rid, None)

    def _encode(self, out: RequestOutput):
        known = self._sent.pop(out.request_id, None)
        if not out.finished:
            self._sent[out.request_id] = ({c.index: _record(c) for c in out.outputs},
                                          out.prompt_logprobs is not None)
        if known is None:
            return out
        sent, had_prompt_logprobs = known
        return OutputDelta(out.request_id, out.finished, [_delta(c, sent.get(c.index)) for c in out.outputs],
                           out.metrics, out.num_cached_tokens, out.extra, out.error,
                           None if had_prompt_logprobs else out.prompt_logprobs)


def _record(c: CompletionOutput) -> _Sent:
    return _Sent(len(c.token_ids), c.token_ids[-1] if c.token_ids else None, c.text,
                 len(c.logprobs) if c.logprobs is not None else 0)


def _delta(c: CompletionOutput, sent: _Sent | None) -> CompletionDelta:
    ids, logprobs = c.token_ids, c.logprobs
    start = 0
    if sent is not None and len(ids) >= sent.tokens and (sent.tokens == 0 or ids[sent.tokens - 1] == sent.last_token):
        start = sent.tokens  # the tokens only grow (checked at the last one sent)
    keep = 0
    if sent is not None:
        keep = len(sent.text) if c.text.startswith(sent.text) else len(os.path.commonprefix([sent.text, c.text]))
    lp_start = sent.logprobs if sent is not None and logprobs is not None and len(logprobs) >= sent.logprobs else 0
    return CompletionDelta(c.index, start, ids[start:], keep, c.text[keep:], lp_start,
                           logprobs[lp_start:] if logprobs is not None else None, c.cumulative_logprob,
                           c.finish_reason, c.stop_reason)


class OutputReceiver:
    """Front side: ``decode(items)`` -> the cumulative ``RequestOutput`` of each."""

    def __init__(self) -> None:
        self._last: dict[str, RequestOutput] = {}

    def decode(self, items: list) -> list[RequestOutput]:
        """The outputs; a delta of a request forgotten here (aborted by the front while the replica was
        sending it) is dropped."""
        return [out for out in map(self._decode, items) if out is not None]

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._last.pop(rid, None)

    def _decode(self, item) -> RequestOutput | None:
        if isinstance(item, OutputDelta):
            last = self._last.get(item.request_id)
            if last is None:
                return None
            before = {c.index: c for c in last.outputs}
            prompt_logprobs = last.prompt_logprobs if item.prompt_logprobs is None else item.prompt_logprobs
            out = replace(last, outputs=[_apply(d, before.get(d.index)) for d in item.completions],
                          finished=item.finished, metrics=item.metrics, num_cached_tokens=item.num_cached_tokens,
                          extra=item.extra, error=item.error, prompt_logprobs=prompt_logprobs)
        else:
            out = item
        if out.finished:
            self._last.pop(out.request_id, None)
        else:
            self._last[out.request_id] = out
        return out


def _apply(d: CompletionDelta, before: CompletionOutput | None) -> CompletionOutput:
    ids = before.token_ids[:d.token_start] if before is not None else []
    text = before.text[:d.text_keep] if before is not None else ""
    logprobs = None
    if d.logprobs is not None:
        logprobs = (before.logprobs or [])[:d.logprobs_start] if before is not None else []
        logprobs = logprobs + d.logprobs
    return CompletionOutput(d.index, text + d.text, ids + d.token_ids, d.cumulative_logprob, logprobs,
                            d.finish_reason, d.stop_reason)
