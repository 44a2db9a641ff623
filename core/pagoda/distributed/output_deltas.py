"""Outputs between an engine process and its front as deltas: each step sends what is new, not the whole.

A ``RequestOutput`` is cumulative (the prompt's ids, every token and the text so far), so sending it whole
after every step costs each stream O(length) per step to pickle, send and unpickle: with a replica
streaming to the server (``pagoda.distributed.dp_replica``), long prompts and long outputs made that the
engine's own host work. The replica's ``OutputSender`` sends a request's first output whole, then per
completion the tokens, text and logprobs added since (and where the text was cut back, e.g. at a stop
string: how much of what was sent stays). The front's ``OutputReceiver`` rebuilds the cumulative outputs,
new objects each time (a reader may still hold the previous one), without copying what came before: a
streamed output's token ids and logprobs are ``ListView`` snapshots of one list per completion that each
delta extends (rebuilding them as new lists cost the front O(length) per stream and step: 4.5 ms a step for
64 streams of 8,000 tokens on the development machine); a final output gets plain lists. Both forget a
request once its final output passed, or when it is aborted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from operator import attrgetter
from typing import Any

import numpy as np
import torch

from pagoda.engine.sequence import Request, Sequence
from pagoda.engine.step_completion import request_output
from pagoda.outputs import CompletionOutput, ListView, RequestMetrics, RequestOutput
from pagoda.pooling.outputs import PoolingOutput, PoolingRequestOutput

# The wire format is plain tuples: pickling 64 dataclass deltas took 9x as long as the same data in tuples
# (178 against 20 us on the development machine, each step, on the engine's critical path).
#   delta:      (DELTA, request_id, finished, completions, metrics, num_cached_tokens, extra or None, error,
#                prompt_logprobs or None: as sent before)
#   completion: (index, tokens kept of those sent before, token ids added, characters kept of the text sent
#                before, text added, logprobs kept, logprobs added or None, cumulative_logprob, finish_reason,
#                stop_reason)
#   metrics:    RequestMetrics' fields in order, or None
DELTA = "delta"
_METRICS = tuple(f.name for f in fields(RequestMetrics))
_metrics_tuple = attrgetter(*_METRICS)  # one C call per request and step (a generator over the fields cost 4x)


def is_delta(item: Any) -> bool:
    return isinstance(item, tuple) and item[:1] == (DELTA,)


def is_finished(item: Any) -> bool:
    """Whether an output the engine returned (a delta or a whole output) is its request's last."""
    return item[2] if is_delta(item) else item.finished


@dataclass
class _Sent:
    """What the front holds of one completion."""

    tokens: int
    last_token: int | None
    text: str
    logprobs: int


class OutputSender:
    """Replica side: ``encode(outputs)`` -> what to send (a ``RequestOutput`` or a delta tuple each)."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[dict[int, _Sent], bool]] = {}  # request id -> (per completion, prompt logprobs)

    def encode(self, outputs: list) -> list:
        """What to send for a step's outputs; deltas ``output_of`` made already pass as they are."""
        return [out if is_delta(out) else self._encode(out) for out in outputs]

    def output_of(self, request: Request, finished: bool):
        """The engine's output of ``request`` this step (``StepCompletion.build_output``): its delta, made from
        its sequences, once its first output was sent whole; else the whole output (``encode`` records it).
        The same delta ``encode`` would make of the cumulative output, without building that output (a
        RequestOutput, a CompletionOutput and two list views per stream and step) only to diff it."""
        known = self._sent.pop(request.request_id, None)
        if known is None:
            return request_output(request, finished)
        sent, had_prompt_logprobs = known
        completions = tuple(_sequence_delta(seq, sent.get(seq.index)) for seq in request.seqs)
        if not finished:
            self._sent[request.request_id] = ({seq.index: _recorded(seq) for seq in request.seqs},
                                              request.prompt_logprobs is not None)
        metrics = request.metrics
        prompt_logprobs = request.prompt_logprobs
        return (DELTA, request.request_id, finished, completions,
                None if metrics is None else _metrics_tuple(metrics), metrics.num_cached_tokens,
                None, request.error,
                None if had_prompt_logprobs or prompt_logprobs is None else list(prompt_logprobs))

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._sent.pop(rid, None)

    def _encode(self, out: RequestOutput):
        if isinstance(out, PoolingRequestOutput):  # finished at once; its tensor as an array (see _pooled)
            return _pooled(out)
        known = self._sent.pop(out.request_id, None)
        if not out.finished:
            self._sent[out.request_id] = ({c.index: _record(c) for c in out.outputs},
                                          out.prompt_logprobs is not None)
        if known is None:
            return out
        sent, had_prompt_logprobs = known
        metrics = out.metrics
        return (DELTA, out.request_id, out.finished, tuple(_delta(c, sent.get(c.index)) for c in out.outputs),
                None if metrics is None else _metrics_tuple(metrics), out.num_cached_tokens,
                out.extra or None, out.error, None if had_prompt_logprobs else out.prompt_logprobs)


def _pooled(out: PoolingRequestOutput) -> PoolingRequestOutput:
    """A pooling output whose tensor travels as a numpy array: multiprocessing pickles a CPU tensor as a
    handle to shared memory that the other process must fetch from this one (and may not: its key differs)."""
    data = out.outputs.data if out.outputs is not None else None
    if isinstance(data, torch.Tensor):
        return replace(out, outputs=PoolingOutput(data.numpy()))
    return out


def _record(c: CompletionOutput) -> _Sent:
    return _Sent(len(c.token_ids), c.token_ids[-1] if c.token_ids else None, c.text,
                 len(c.logprobs) if c.logprobs is not None else 0)


def _recorded(seq: Sequence) -> _Sent:
    """``_record`` of the completion ``seq`` stands for."""
    n = seq.num_tokens - seq.num_prompt_tokens
    return _Sent(n, seq.token_ids[seq.num_tokens - 1] if n else None, seq.text,
                 len(seq.logprobs) if seq.logprobs is not None else 0)


def _sequence_delta(seq: Sequence, sent: _Sent | None) -> tuple:
    """``_delta`` of the completion ``seq`` stands for, read from the sequence."""
    first, end = seq.num_prompt_tokens, seq.num_tokens
    ids, logprobs, text = seq.token_ids, seq.logprobs, seq.text
    start = 0
    if sent is not None and end - first >= sent.tokens and (sent.tokens == 0 or ids[first + sent.tokens - 1]
                                                             == sent.last_token):
        start = sent.tokens
    keep, lp_start = _kept(sent, text, logprobs)
    return (seq.index, start, ids[first + start:end], keep, text[keep:], lp_start,
            logprobs[lp_start:] if logprobs is not None else None,
            seq.cumulative_logprob if logprobs is not None else None, seq.finish_reason(), seq.stop_reason)


def _kept(sent: _Sent | None, text: str, logprobs) -> tuple[int, int]:
    """(characters of the text sent before that still stand, logprobs sent before that stay)."""
    if sent is None:
        return 0, 0
    keep = len(sent.text) if text.startswith(sent.text) else len(os.path.commonprefix([sent.text, text]))
    return keep, sent.logprobs if logprobs is not None and len(logprobs) >= sent.logprobs else 0


def _delta(c: CompletionOutput, sent: _Sent | None) -> tuple:
    ids, logprobs = c.token_ids, c.logprobs
    start = 0
    if sent is not None and len(ids) >= sent.tokens and (sent.tokens == 0 or ids[sent.tokens - 1] == sent.last_token):
        start = sent.tokens  # the tokens only grow (checked at the last one sent)
    keep, lp_start = _kept(sent, c.text, logprobs)
    return (c.index, start, ids[start:], keep, c.text[keep:], lp_start,
            logprobs[lp_start:] if logprobs is not None else None, c.cumulative_logprob, c.finish_reason,
            c.stop_reason)


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
        if is_delta(item):
            _, rid, finished, completions, metrics, cached, extra, error, prompt_logprobs = item
            last = self._last.get(rid)
            if last is None:
                return None
            before = {c.index: c for c in last.outputs}
            out = RequestOutput(rid, last.prompt, last.prompt_token_ids,
                                [_apply(d, before.get(d[0]), finished) for d in completions], finished,
                                metrics=None if metrics is None else RequestMetrics(*metrics),
                                num_cached_tokens=cached, extra=extra or {}, error=error,
                                prompt_logprobs=last.prompt_logprobs if prompt_logprobs is None else prompt_logprobs)
        else:
            out = item
            if isinstance(out, PoolingRequestOutput) and isinstance(getattr(out.outputs, "data", None), np.ndarray):
                out = replace(out, outputs=PoolingOutput(torch.from_numpy(out.outputs.data)))
        if out.finished:
            self._last.pop(out.request_id, None)
        else:
            self._last[out.request_id] = out
        return out


def _apply(d: tuple, before: CompletionOutput | None, final: bool) -> CompletionOutput:
    index, token_start, token_ids, text_keep, text, logprobs_start, new_logprobs, cumulative, finish, stop = d
    ids = _grown(before.token_ids if before is not None else None, token_start, token_ids, final)
    kept = before.text[:text_keep] if before is not None else ""
    logprobs = None
    if new_logprobs is not None:
        logprobs = _grown(before.logprobs if before is not None else None, logprobs_start, new_logprobs, final)
    return CompletionOutput(index, kept + text, ids, cumulative, logprobs, finish, stop)


def _grown(before, keep: int, new: list, final: bool):
    """``before[:keep] + new``: extending the list behind ``before`` in place when ``before`` is all of it
    (its readers keep seeing their own window), else a new list; a ``ListView`` of it, or (``final``) a
    list of its own."""
    if isinstance(before, ListView) and before.start == 0 and keep == len(before) == len(before.items):
        items = before.items
    else:
        items = list(before[:keep]) if before is not None else []
    items.extend(new)
    return list(items) if final else ListView(items, 0, len(items))
