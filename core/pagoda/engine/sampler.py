"""Token selection for a batch: per-request logits processing, grammar masks, temperature, top-k,
top-p, min-p, seeds, logprobs.

Rows are ``pagoda.engine.sampling_batch.SamplingRow``s (the batch: what the engine copied out of each sampling
sequence; never a live sequence). A row whose request only wants the most likely token (``argmax_only``) takes
the argmax of its logits as they are; the other rows are processed apart, in float32 (unless each is
greedy and only its grammar constrains it: masked in the logits' own dtype, the same argmax): their own
logits processing (``pagoda.logits_processors``), then their grammar's token mask (structured
outputs), then greedy selection or the exponential race (argmax of p / Exp(1) noise); a request
with a seed draws its noise from its own generator, so its tokens do not depend on what else is in
the batch. Logprobs come from the model's raw distribution (log-softmax of the logits before any
processing and temperature), as in vLLM.

A failure pinned to one row (its processing, its grammar, its generator, its logprobs, or the
batched selection retried row by row) fails that row only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda.engine.sampling_batch import SamplingRow
from pagoda.kernels.host_upload import upload
from pagoda.logits_processors import process_row


@dataclass
class StepResult:
    """What a step gave its sampling rows (``ModelRunner.collect``, or the sampler itself)."""

    tokens: list[int]
    # None (tokens chosen on the device: no logprobs), or per row: None, or
    # (sampled logprob, sampled rank, [(token, logprob), ...] top-n)
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None] | None
    # rows that could not be sampled, and why: their request fails, the other rows keep their tokens
    failed: dict[int, BaseException] = field(default_factory=dict)
    # prompt logprobs computed this step: seq_id -> [(position, logprob, rank, [(token, logprob), ...])]
    prompt_logprobs: dict[int, list] = field(default_factory=dict)


@dataclass
class MaskCost:
    """Grammar-mask work on the step's path: steps that had constrained rows, the rows, and the host
    seconds their masks took there (filling them, or waiting for the rest of a fill started ahead by
    ``pagoda.structured_outputs.mask_ahead``; uploading them and launching the kernel that applies them)."""

    steps: int = 0
    rows: int = 0
    seconds: float = 0.0
    fill_wait_seconds: float = 0.0  # of ``seconds``: waiting for fills started ahead (the engine's MaskAhead counts it)

    def add(self, rows: int, seconds: float) -> None:
        self.steps += 1
        self.rows += rows
        self.seconds += seconds

    def summary(self) -> dict:
        return {"mask_steps": self.steps, "mask_rows": self.rows, "mask_seconds": self.seconds,
                "fill_wait_seconds": self.fill_wait_seconds,
                "mask_ms_per_step": 1000.0 * self.seconds / self.steps if self.steps else 0.0,
                "mask_us_per_row": 1e6 * self.seconds / self.rows if self.rows else 0.0}


@dataclass
class DeviceSelection:
    """Tokens chosen without reading the device (``Sampler.select_on_device``)."""

    tokens: torch.Tensor  # [N] int64, on the device
    blocked: torch.Tensor | None = None  # [G] bool: grammar rows left with no allowed token
    grammar_rows: list[int] = field(default_factory=list)  # the G rows ``blocked`` describes
    failed: dict[int, BaseException] = field(default_factory=dict)  # rows whose mask could not be filled


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._seq_generators: dict[int, torch.Generator] = {}
        self.stop_token_ids: set[int] = set()  # the engine's EOS ids (min_tokens holds them back)
        self.processors: dict = {}  # logits processors the engine enabled, by name
        self.mask = MaskCost()  # what grammar masks cost the host (LLMEngine.get_stats reports it)
        self.mask_ahead = None  # pagoda.structured_outputs.mask_ahead.MaskAhead, set by the engine

    def forget(self, seq_id: int) -> None:
        self._seq_generators.pop(seq_id, None)

    def _generator(self, seq: SamplingRow) -> torch.Generator:
        gen = self._seq_generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seq.seed)
            self._seq_generators[seq.seq_id] = gen
        return gen

    def __call__(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> StepResult:
        """logits [N, V] for the N sequences (in order) that sample this step; the sampler may write over them
        (no caller reads a step's logits after choosing its tokens)."""
        special = [i for i, s in enumerate(seqs) if not s.params.argmax_only or s.grammar is not None]
        if len(special) < len(seqs):  # argmax before any float32 upcast: the same index (exact, monotonic)
            tokens = row_argmax(logits).tolist()
            if not special:
                return StepResult(tokens, [None] * len(seqs))
        else:
            tokens = [0] * len(seqs)
        wants_logprobs = any(seqs[i].params.logprobs is not None for i in special)
        rows, raw, work, failed, blocked = self._special(logits, seqs, special, _subset(logits, seqs, special),
                                                         keep_raw=wants_logprobs)
        picked = self._pick(work, rows, failed, blocked)
        out: list = [None] * len(seqs)
        if wants_logprobs:
            logp = torch.log_softmax(raw, dim=-1)
            for j, seq in enumerate(rows):
                if seq.params.logprobs is not None and j not in failed:
                    try:
                        out[special[j]] = _logprobs(logp[j], picked[j], seq.params.logprobs)
                    except Exception as exc:
                        failed[j] = exc
        for j, i in enumerate(special):
            tokens[i] = 0 if j in failed else picked[j]  # (a failed row's token is never used)
        return StepResult(tokens, out, {special[j]: exc for j, exc in failed.items()})

    def select_on_device(self, logits: torch.Tensor, seqs: list[SamplingRow]) -> DeviceSelection:
        """Tokens for logits [N, V] of rows whose requests sample on the device (``SamplingParams.
        samples_on_device``: greedy or random, constrained or not): the step pipeline chooses a launched
        step's tokens this way without waiting for the device. Grammar masks are filled on the host
        from the matchers as they stand; sequences that already finished (a token computed ahead for
        them is thrown away) take the argmax. ``logits`` may be written over, as in ``__call__``."""
        special = [i for i, s in enumerate(seqs)
                   if not s.finished and (not s.params.argmax_only or s.grammar is not None)]
        if not special:
            return DeviceSelection(row_argmax(logits))
        index = _subset(logits, seqs, special)
        tokens = None if index is None else row_argmax(logits)  # (every row special: none is the argmax)
        rows, _, work, failed, blocked = self._special(logits, seqs, special, index, keep_raw=False)
        params = [s.params for s in rows]
        random_rows = [j for j, p in enumerate(params) if not p.greedy]
        noise = self._noise(work.shape[-1], rows, random_rows, failed)
        try:
            picked = _select(work, params, random_rows, noise)
        except Exception:  # row by row on the host, pinning the failure down (reads the device)
            picked = torch.tensor(self._pick(work, rows, failed, blocked, noise), device=logits.device)
            blocked = []
        if index is None:
            tokens = picked.to(torch.int64)
        else:
            tokens.index_copy_(0, index, picked.to(tokens.dtype))
        grammar_rows, flags = blocked[0] if blocked else ([], None)
        return DeviceSelection(tokens, flags, [special[j] for j in grammar_rows],
                               {special[j]: exc for j, exc in failed.items()})

    def _special(self, logits: torch.Tensor, seqs: list[SamplingRow], special: list[int],
                 index: torch.Tensor | None, keep_raw: bool) -> tuple:
        """The rows ``special`` (``index`` on the device; None: every row) that take more than the argmax:
        (their sequences, their raw logits [S, V] (float32, unless each row is greedy and unprocessed), those
        logits after processing and grammar masks,
        failed rows by position in them, the grammar rows' "no token left" flags). The processing works on a
        copy when the raw logits are read afterwards (``keep_raw``: logprobs); else in place, in the rows
        gathered or upcast here or in the caller's own float32 logits (a [S, V] float32 copy less per step:
        1 ms of a 7 ms constrained step of 64 rows over 49,152 ids on the development machine's CPU)."""
        rows = [seqs[i] for i in special]
        raw = logits if index is None else logits.index_select(0, index)
        # Greedy rows that only their grammar constrains are picked as they are (bfloat16 on a GPU): the masks
        # write -inf in any dtype, and the argmax of values is the argmax of their float32 upcast, which
        # would cost the device a [S, V] copy between a step's forward and the next one's.
        if keep_raw or not all(s.params.greedy and not s.params.needs_processing for s in rows):
            raw = raw.float()
        failed: dict[int, BaseException] = {}  # by position in ``rows``
        blocked: list = []  # (grammar rows, device flags): rows whose grammar allows no token
        work = self._processed(raw, rows, failed, blocked, copy=keep_raw)
        return rows, raw, work, failed, blocked

    def prompt_logprobs(self, logits: torch.Tensor, seq: SamplingRow, first: int) -> dict[int, list]:
        """logits [R, V] at prompt positions first .. first + R - 1 of ``seq``: for each, the
        logprob and rank of the prompt token that follows (at position + 1) and the top k, as the
        engine records them (the model's raw distribution, as for sampled tokens)."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor(seq.token_ids[first + 1:first + 1 + logp.shape[0]], device=logp.device)
        chosen = logp.gather(1, targets[:, None])
        ranks = ((logp > chosen).sum(dim=1) + 1).tolist()
        k = seq.params.prompt_logprobs
        tops = [[]] * logp.shape[0]
        if k:
            vals, ids = logp.topk(k, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
        return {seq.seq_id: [(first + 1 + r, c, rank, top) for r, (c, rank, top)
                             in enumerate(zip(chosen.squeeze(1).tolist(), ranks, tops))]}

    def _processed(self, raw: torch.Tensor, rows: list[SamplingRow], failed: dict, blocked: list,
                   copy: bool = True) -> torch.Tensor:
        """The rows' logits after their own processing and grammar masks (``copy``: in a copy when anything
        applies, else in ``raw`` itself).
        ``blocked`` receives (grammar rows, device flags of the rows left with no allowed token), read
        with the picked tokens in one transfer."""
        needs = [j for j, s in enumerate(rows) if s.params.needs_processing]
        grammar = [j for j, s in enumerate(rows) if s.grammar is not None]
        if not needs and not grammar:
            return raw
        work = raw.clone() if copy else raw
        for j in needs:
            try:
                process_row(work[j], rows[j], self.stop_token_ids, self.processors)
            except Exception as exc:
                failed[j] = exc
        if grammar:
            from pagoda.structured_outputs.masking import apply_grammar_masks

            t0 = time.perf_counter()
            masked = [(j, rows[j].grammar, rows[j].grammar_opening and rows[j].grammar_opening[0]) for j in grammar]
            none_left = apply_grammar_masks(work, masked, self.mask_ahead, failed)
            self.mask.add(len(grammar), time.perf_counter() - t0)  # host time, the upload and kernel launched
            fail_blocked(none_left, [True] * len(none_left), failed)
            # a row's own processing may forbid what its grammar allows: those rows are checked on the device
            checked = [j for j in grammar if rows[j].params.needs_processing and j not in failed]
            if checked:
                blocked.append((checked, torch.isneginf(work.index_select(0, _on(work.device, checked))).all(dim=1)))
        return work

    def _pick(self, work: torch.Tensor, rows: list[SamplingRow], failed: dict, blocked: list,
              noise: torch.Tensor | None = None) -> list[int]:
        params = [s.params for s in rows]
        random_rows = [j for j, p in enumerate(params) if not p.greedy]
        if noise is None:
            noise = self._noise(work.shape[-1], rows, random_rows, failed)
        try:
            tokens = _select(work, params, random_rows, noise)
            if not blocked:
                return tokens.tolist()
            # one device-to-host read: the tokens and which constrained rows had no token left
            both = torch.cat([tokens, blocked[0][1].to(tokens.dtype)]).tolist()
            fail_blocked(blocked[0][0], both[len(rows):], failed)
            return both[:len(rows)]
        except Exception:  # pin the failure down: the same selection, one row at a time
            if blocked:
                fail_blocked(blocked[0][0], blocked[0][1].tolist(), failed)
            picked = [0] * len(rows)
            for j in range(len(rows)):
                if j in failed:
                    continue
                try:
                    k = random_rows.index(j) if j in random_rows else None
                    one = _select(work[j:j + 1], [params[j]], [0] if k is not None else [],
                                  None if k is None else noise[k:k + 1])
                    picked[j] = int(one[0])
                except Exception as exc:
                    failed[j] = exc
            return picked

    def _noise(self, vocab: int, seqs: list[SamplingRow], rows: list[int], failed: dict) -> torch.Tensor | None:
        """Exp(1) noise [len(rows), vocab] for the random rows: the rows without a seed in one draw from
        the engine's generator (one kernel, not one per row: 256 rows cost ~1.3 ms of launches on an H200's
        host), each seeded row from its sequence's own generator, so its tokens do not depend on the batch.
        Drawn once per step, before anything that can fail as a batch, so a retry row by row draws nothing
        twice."""
        if not rows:
            return None
        noise = torch.empty(len(rows), vocab, device=self.device)
        seeded = [k for k, j in enumerate(rows) if seqs[j].seed is not None]
        if len(seeded) < len(rows):  # (the seeded rows' share of this draw is overwritten below)
            try:
                noise.exponential_(generator=self.generator)
            except Exception as exc:
                noise.fill_(1.0)
                failed.update({j: exc for j in rows if seqs[j].seed is None})
        for k in seeded:
            j = rows[k]
            try:
                noise[k].exponential_(generator=self._generator(seqs[j]))
            except Exception as exc:
                failed[j] = exc
                noise[k].fill_(1.0)
        return noise


def row_argmax(t: torch.Tensor) -> torch.Tensor:
    """``t.argmax(dim=-1)``. On the CPU through ``max(dim=-1)``: the same indices (the first of equal values, a NaN
    as the largest), and 2.3-4.6x faster there than torch's argmax kernel ([64, 49,152] float32: 1.5 against 4.2
    ms; one row: 27 against 64 us)."""
    return t.max(dim=-1).indices if t.device.type == "cpu" else t.argmax(dim=-1)


def fail_blocked(grammar_rows: list[int], none_left: list, failed: dict) -> None:
    """A row whose every token is forbidden (its grammar with its other constraints) cannot go on."""
    for j, empty in zip(grammar_rows, none_left):
        if empty and j not in failed:
            failed[j] = RuntimeError("the grammar (with this request's other constraints) allows no token")


def _select(logits: torch.Tensor, params: list, random_rows: list[int], noise: torch.Tensor | None) -> torch.Tensor:
    """Token per row: the argmax for greedy rows; for random rows the exponential race over
    their temperature-scaled, top-k/top-p/min-p filtered distribution."""
    tokens = row_argmax(logits)
    if random_rows:
        rows = _on(logits.device, random_rows)
        sub = logits.index_select(0, rows)
        temps = _on(logits.device, [params[i].temperature for i in random_rows], logits.dtype)
        probs = _filtered_probs(sub / temps[:, None], [params[i] for i in random_rows])
        tokens[rows] = row_argmax(probs / noise)
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


def _filtered_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """softmax, then zero what top-k, top-p and min-p exclude (each row its own settings)."""
    probs = torch.softmax(logits, dim=-1)
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if any(min_p):
        mp = _on(probs.device, min_p, probs.dtype)
        probs = probs.masked_fill(probs < mp[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        vocab = probs.shape[-1]
        k = _on(probs.device, [k if k > 0 else vocab for k in top_k])
        ranks = torch.arange(vocab, device=probs.device)[None, :]
        sorted_probs = sorted_probs.masked_fill(ranks >= k[:, None], 0.0)
        tp = _on(probs.device, top_p, probs.dtype)
        renorm = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
        before = renorm.cumsum(dim=-1) - renorm  # mass strictly above this token
        sorted_probs = sorted_probs.masked_fill(before >= tp[:, None], 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def _subset(logits: torch.Tensor, seqs: list, special: list[int]) -> torch.Tensor | None:
    """``special`` on the logits' device, or None when it is every row."""
    return None if len(special) == len(seqs) else _on(logits.device, special)


def _on(device, values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A short host list on the device through pinned memory: the copy queues behind the device's work
    instead of waiting for it (a step launched ahead may still be running; ``pagoda.kernels.host_upload``)."""
    return upload(np.asarray(values), device, dtype)

