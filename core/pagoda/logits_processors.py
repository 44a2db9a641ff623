"""What a request does to its own row of logits before a token is chosen, in vLLM's order.

Per row (float32 [vocab], modified in place): ``allowed_token_ids`` (everything else -inf),
``bad_words`` (the last token of a banned word whose other tokens were just generated),
``min_tokens`` (stop and EOS tokens -inf until enough tokens are out), ``logit_bias`` (added, each
bias clamped to [-100, 100] as OpenAI does), the repetition/frequency/presence penalties, then the
logits processors a plugin registered and the request named. The grammar mask of structured outputs
comes last, for the whole batch at once (``pagoda.structured_outputs``).
"""

from __future__ import annotations

import torch

from pagoda.engine.sampling_batch import SamplingRow

NEG_INF = float("-inf")


def process_row(row: torch.Tensor, seq: SamplingRow, stop_token_ids: set[int], processors: dict) -> None:
    """Apply every per-request processing ``seq``'s parameters ask for to its logits ``row`` [V]."""
    p = seq.params
    if p.allowed_token_ids:
        keep = torch.tensor(p.allowed_token_ids, device=row.device, dtype=torch.long)
        kept = row.index_select(0, keep)
        row.fill_(NEG_INF).index_copy_(0, keep, kept)
    if seq.bad_words_ids:
        _ban_bad_words(row, seq)
    if p.min_tokens and seq.num_output_tokens < p.min_tokens:
        banned = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else stop_token_ids)
        if banned:
            row.index_fill_(0, torch.tensor(sorted(banned), device=row.device, dtype=torch.long), NEG_INF)
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=row.device, dtype=torch.long)
        bias = torch.tensor([max(-100.0, min(100.0, b)) for b in p.logit_bias.values()], device=row.device,
                            dtype=row.dtype)
        row.index_add_(0, ids, bias)
    if p.needs_penalties:
        apply_penalties(row, seq)
    for name in p.logits_processors or ():
        out = processors[name](seq.output_token_ids, row)
        if out is not row:
            row.copy_(out)


def apply_penalties(row: torch.Tensor, seq: SamplingRow) -> None:
    p = seq.params
    if p.repetition_penalty != 1.0:
        ids = torch.tensor(sorted(set(seq.token_ids)), device=row.device, dtype=torch.long)
        vals = row.index_select(0, ids)
        row.index_copy_(0, ids, torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty))
    counts = seq.output_counts or {}
    if counts and (p.frequency_penalty or p.presence_penalty):
        ids = torch.tensor(list(counts), device=row.device, dtype=torch.long)
        cnt = torch.tensor(list(counts.values()), device=row.device, dtype=row.dtype)
        row.index_add_(0, ids, -(p.frequency_penalty * cnt + p.presence_penalty))


def _ban_bad_words(row: torch.Tensor, seq: SamplingRow) -> None:
    """A banned word of k tokens: its last token is -inf when the last k-1 generated tokens are its
    first k-1 (a one-token word is always banned)."""
    out = seq.output_token_ids
    banned = [ids[-1] for ids in seq.bad_words_ids
              if len(ids) == 1 or (len(out) >= len(ids) - 1 and out[len(out) - len(ids) + 1:] == ids[:-1])]
    if banned:
        row.index_fill_(0, torch.tensor(banned, device=row.device, dtype=torch.long), NEG_INF)


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """The token sequences to ban for each word: as written and with a leading space (a word in
    running text is usually one token longer or begins with the space), as vLLM does."""
    found: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in found:
                found.append(ids)
    return found
