"""Token selection for a batch: penalties, temperature, top-k, top-p, min-p, seeds, logprobs.

Rows are sequences. Greedy rows take the argmax of the penalised logits. Random rows
sample with the exponential-race trick (argmax of p / Exp(1) noise); a request with a
seed draws its noise from its own generator, so its tokens do not depend on what else is
in the batch. Logprobs come from the model's raw distribution (log-softmax of the logits
before penalties and temperature), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.sequence import Sequence


@dataclass
class SampleResult:
    tokens: list[int]
    # per row: None, or (sampled logprob, sampled rank, [(token, logprob), ...] top-n)
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]


class Sampler:
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
        logits = logits.float()
        raw = logits
        if any(p.needs_penalties for p in params):
            logits = logits.clone()
            for i, seq in enumerate(seqs):
                if seq.params.needs_penalties:
                    _apply_penalties(logits[i], seq)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            sub = logits.index_select(0, rows)
            temps = torch.tensor([params[i].temperature for i in random_rows], device=logits.device)
            probs = _filtered_probs(sub / temps[:, None], [params[i] for i in random_rows])
            noise = torch.empty_like(probs)
            for j, i in enumerate(random_rows):
                if seqs[i].seed is not None:
                    noise[j].exponential_(generator=self._generator(seqs[i]))
                else:
                    noise[j].exponential_(generator=self.generator)
            tokens[rows] = (probs / noise).argmax(dim=-1)
        token_list = tokens.tolist()
        out: list = [None] * len(seqs)
        if want_logprobs:
            logp = torch.log_softmax(raw, dim=-1)
            for i, p in enumerate(params):
                if p.logprobs is None:
                    continue
                chosen = logp[i, token_list[i]]
                rank = int((logp[i] > chosen).sum().item()) + 1
                top: list[tuple[int, float]] = []
                if p.logprobs > 0:
                    vals, ids = logp[i].topk(p.logprobs)
                    top = list(zip(ids.tolist(), vals.tolist()))
                out[i] = (float(chosen.item()), rank, top)
        return SampleResult(token_list, out)


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
