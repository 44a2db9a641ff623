"""From cumulative RequestOutputs to what the APIs send: text deltas, logprobs, usage.

The engine reports each completion's text and token ids so far. Streams send deltas.
While a request has stop strings, the last ``longest stop - 1`` characters are held back
until the request finishes, because the engine trims a stop string (and what follows)
from the text once it is complete: the streamed pieces then always add up to the final text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class DeltaTracker:
    """Per completion: how much text, how many tokens and logprobs were already sent."""

    holdback: int = 0
    sent_text: dict[int, int] = field(default_factory=dict)
    sent_tokens: dict[int, int] = field(default_factory=dict)

    @classmethod
    def for_stops(cls, stop_strings: list[str]) -> DeltaTracker:
        return cls(holdback=max((len(s) for s in stop_strings), default=1) - 1)

    def delta(self, c: CompletionOutput) -> tuple[str, list[int], int]:
        """(new text, new token ids, index of the first new token) of one completion."""
        done = c.finish_reason is not None
        text_start = self.sent_text.get(c.index, 0)
        visible = len(c.text) if done else max(text_start, len(c.text) - self.holdback)
        tok_start = self.sent_tokens.get(c.index, 0)
        self.sent_text[c.index] = visible
        self.sent_tokens[c.index] = len(c.token_ids)
        return c.text[text_start:visible], c.token_ids[tok_start:], tok_start


def usage_sum(outs: list[RequestOutput]) -> dict:
    """OpenAI usage of requests: each prompt counted once, every completion's tokens, and the
    prompt tokens served from the prefix cache."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class TokenText:
    """Decoded text of single tokens (cached), for logprobs."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self.cache) < 100_000:
                self.cache[token_id] = text
        return text


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    return sorted(((tid, lp) for tid, lp in entry.items() if lp.rank <= k), key=lambda x: x[1].rank)[:k]


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int, text: TokenText) -> dict:
    """``choices[i].logprobs`` of a chat completion: ``{"content": [...]}``."""
    content = []
    for tid, entry in zip(token_ids, entries):
        tok = text(tid)
        content.append({
            "token": tok, "logprob": entry[tid].logprob, "bytes": list(tok.encode()),
            "top_logprobs": [{"token": text(t), "logprob": lp.logprob, "bytes": list(text(t).encode())}
                             for t, lp in _top(entry, k)],
        })
    return {"content": content}


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int, text: TokenText,
                        offset: int) -> dict:
    """``choices[i].logprobs`` of a text completion (legacy format); ``offset`` is the text
    length before these tokens."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        tok = text(tid)
        tokens.append(tok)
        offsets.append(offset)
        offset += len(tok)
        if entry is None:  # the first prompt token (echo): nothing before it to predict it
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(entry[tid].logprob)
        alternatives: dict[str, float] = {}
        for t, lp in _top(entry, k):  # tokens that decode alike (partial UTF-8) keep the likelier one
            alternatives.setdefault(text(t), lp.logprob)
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def merge_logprobs(first: dict, second: dict) -> dict:
    """Two runs of completion logprobs (the echoed prompt's, then the output's) as one."""
    return {key: first[key] + second[key] for key in first}


def prompt_logprobs_json(entries: list | None) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt token, null (the first) or {token id: {logprob, rank,
    decoded_token}}."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in e.items()} for e in entries]

