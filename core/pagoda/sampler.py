"""Token selection for a batch: penalties, temperature, top-k, top-p, min-p, seeds, logprobs.

Rows are sequences. Greedy rows take the argmax of the penalised logits. Random rows
sample with the exponential-race trick (argmax of p / Exp(1) noise); a request with a
seed draws its noise from its own generator, so its tokens do not depend on what else is
in the batch. Logprobs come from the model's raw distribution (log-softmax of the logits
before penalties and temperature), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagoda.sequence import Sequence


@dataclass
class SampleResult:
    tokens: list[int]
    # per row: None, or (sampled logprob, sampled rank, [(token, logprob), ...] top-n)
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]
    # rows that could not be sampled, and why: their request fails, the other rows keep their tokens
    failed: dict[int, BaseException] = field(default_factory=dict)


class Sampler:
    """Samples a batch; a failure pinned to one row (its penalties, its generator, its logprobs,
    or the batched selection retried row by row) fails that row only."""

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._seq_generators: dict[int, torch.Generator] = {}

    def forget(self, seq_id: int) -> None:
        self._seq_generators.pop(seq_id, None)

    def _generator(self, seq: Sequence) -> torch.Generator:
        gen = self._seq_generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seq.seed)
            self._seq_generators[seq.seq_id] = gen
        return gen

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """logits [N, V] for the N sequences (in order) that sample this step."""
        params = [s.params for s in seqs]
        distinct = list({id(p): p for p in params}.values())  # offline batches share one object
        want_logprobs = any(p.logprobs is not None for p in distinct)
        plain = not any(p.needs_penalties or not p.greedy for p in distinct)
        if plain and not want_logprobs:
            # argmax before the float32 upcast: the same index (the upcast is exact and
            # monotonic), without writing a float32 copy of [N, vocab]
            return SampleResult(logits.argmax(dim=-1).tolist(), [None] * len(seqs))
        failed: dict[int, BaseException] = {}
        raw = logits.float()
        logits = self._penalised(raw, seqs, failed)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        noise = self._noise(logits.shape[-1], seqs, random_rows, failed)
        try:
            token_list = _select(logits, params, random_rows, noise).tolist()
        except Exception:  # pin the failure down: the same selection, one row at a time
            token_list = [0] * len(seqs)
            for i in range(len(seqs)):
                if i in failed:
                    continue
                try:
                    j = random_rows.index(i) if i in random_rows else None
                    one = _select(logits[i:i + 1], [params[i]], [0] if j is not None else [],
                                  None if j is None else noise[j:j + 1])
                    token_list[i] = int(one[0])
                except Exception as exc:
                    failed[i] = exc
        out: list = [None] * len(seqs)
        if want_logprobs:
            logp = torch.log_softmax(raw, dim=-1)
            for i, p in enumerate(params):
                if p.logprobs is None or i in failed:
                    continue
                try:
                    out[i] = _logprobs(logp[i], token_list[i], p.logprobs)
                except Exception as exc:
                    failed[i] = exc
        for i in failed:
            token_list[i] = 0  # never used: the engine fails the row's request
        return SampleResult(token_list, out, failed)

    def _penalised(self, logits: torch.Tensor, seqs: list[Sequence], failed: dict) -> torch.Tensor:
        """The logits with each row's repetition/frequency/presence penalties applied (a copy)."""
        if not any(s.params.needs_penalties for s in seqs):
            return logits
        logits = logits.clone()
        for i, seq in enumerate(seqs):
            if seq.params.needs_penalties:
                try:
                    _apply_penalties(logits[i], seq)
                except Exception as exc:
                    failed[i] = exc
        return logits

    def _noise(self, vocab: int, seqs: list[Sequence], rows: list[int], failed: dict) -> torch.Tensor | None:
        """Exp(1) noise [len(rows), vocab] for the random rows, each drawn from its sequence's
        own generator when it has a seed. Drawn once per step, before anything that can fail
        as a batch, so a retry row by row draws nothing twice."""
        if not rows:
            return None
        noise = torch.empty(len(rows), vocab, device=self.device)
        for j, i in enumerate(rows):
            try:
                gen = self.generator if seqs[i].seed is None else self._generator(seqs[i])
                noise[j].exponential_(generator=gen)
            except Exception as exc:
                failed[i] = exc
                noise[j].fill_(1.0)
        return noise


def _select(logits: torch.Tensor, params: list, random_rows: list[int], noise: torch.Tensor | None) -> torch.Tensor:
    """Token per row: the argmax for greedy rows; for random rows the exponential race over
    their temperature-scaled, top-k/top-p/min-p filtered distribution."""
    tokens = logits.argmax(dim=-1)
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        sub = logits.index_select(0, rows)
        temps = torch.tensor([params[i].temperature for i in random_rows], device=logits.device)
        probs = _filtered_probs(sub / temps[:, None], [params[i] for i in random_rows])
        tokens[rows] = (probs / noise).argmax(dim=-1)
    return tokens


def _logprobs(logp: torch.Tensor, token: int, k: int) -> tuple[float, int, list[tuple[int, float]]]:
    """(the token's logprob, its rank from 1, the top k as (token, logprob)) of one row [V]."""
    chosen = logp[token]
    rank = int((logp > chosen).sum().item()) + 1
    top: list[tuple[int, float]] = []
    if k > 0:
        vals, ids = logp.topk(k)
        top = list(zip(ids.tolist(), vals.tolist()))
    return float(chosen.item()), rank, top


def _apply_penalties(row: torch.Tensor, seq: Sequence) -> None:
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


def _filtered_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """softmax, then zero what top-k, top-p and min-p exclude (each row its own settings)."""
    probs = torch.softmax(logits, dim=-1)
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if any(min_p):
        mp = torch.tensor(min_p, device=probs.device, dtype=probs.dtype)
        probs = probs.masked_fill(probs < mp[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        vocab = probs.shape[-1]
        k = torch.tensor([k if k > 0 else vocab for k in top_k], device=probs.device)
        ranks = torch.arange(vocab, device=probs.device)[None, :]
        sorted_probs = sorted_probs.masked_fill(ranks >= k[:, None], 0.0)
        tp = torch.tensor(top_p, device=probs.device, dtype=probs.dtype)
        renorm = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
        before = renorm.cumsum(dim=-1) - renorm  # mass strictly above this token
        sorted_probs = sorted_probs.masked_fill(before >= tp[:, None], 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)
