"""Continuous batching: which sequences run in the next step, and with how many tokens. No torch.

Each step has one token budget (``max_num_batched_tokens``). Running sequences that
decode (one token each) are served first, then running sequences whose prompt is only
partly computed (chunked prefill), then waiting sequences in arrival order. When a running
sequence needs a block and none is free, the most recently admitted running sequence is
preempted by recompute: its blocks are freed and it returns to the front of the waiting
queue, keeping its generated tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pagoda.engine.block_manager import BlockManager
from pagoda.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    sample: bool  # the step computes the last known token, so a new token is sampled


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes first, then prefills
    num_decodes: int = 0
    num_batched_tokens: int = 0
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_steps: int = 0
    num_prefill_tokens: int = 0  # prompt tokens actually computed (not served from cache)
    num_generated_tokens: int = 0


# The place of a sampled token while its step is still on the device (see ``Scheduler.advance``).
PENDING_TOKEN = -1


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, idle_step_tokens: int | None = None, max_loras: int | None = None):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # the budget of a step in which no sequence decodes (nobody waits for a token), when the
        # budget above is a stall bound for decoding streams (pagoda.engine.step_budget)
        self.idle_step_tokens = idle_step_tokens
        self.max_model_len = max_model_len
        # LoRA: the most distinct adapters among running sequences (a step's adapters all fit the slots)
        self.max_loras = max_loras
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    # ------------------------------------------------------------------ queue management
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a sequence (stop, length or abort) and free its blocks."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = status
        self.bm.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        scheduled_ids: set[int] = set()

        # Running sequences: decodes first, then partial prefills, in admission order.
        ordered, partial = [], []
        for s in self.running:
            left = len(s.token_ids) - s.num_computed_tokens
            if left == 1:
                if s.token_ids[-1] == PENDING_TOKEN and self.ends_by_length(s):
                    continue  # its pending token (a step in flight) finishes it: nothing to compute
                ordered.append(s)
            elif left > 1:
                partial.append(s)
        decoding = bool(ordered)
        ordered += partial
        budget = self.max_num_batched_tokens
        if self.idle_step_tokens and not decoding:
            budget = self.idle_step_tokens
        start_budget = budget
        running_status = SequenceStatus.RUNNING
        block_size = self.bm.block_size
        for seq in ordered:
            if budget == 0:
                break
            if seq.status is not running_status:  # preempted earlier in this loop
                continue
            computed = seq.num_computed_tokens
            if len(seq.token_ids) - computed == 1 and computed < len(seq.block_table) * block_size:
                # a decode whose slot is already allocated (allocate_slots would change nothing)
                scheduled_ids.add(seq.seq_id)
                decodes.append(ScheduledSeq(seq, 1, True))
                budget -= 1
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.bm.allocate_slots(seq, num_new):
                victim = next((s for s in reversed(self.running) if s.seq_id not in scheduled_ids), None)
                if victim is None:
                    break
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING or len(seq.block_table) * self.bm.block_size < \
                    seq.num_computed_tokens + num_new:
                continue
            scheduled_ids.add(seq.seq_id)
            item = ScheduledSeq(seq, num_new, seq.num_computed_tokens + num_new == seq.num_tokens)
            (decodes if seq.num_tokens - seq.num_computed_tokens == 1 else prefills).append(item)
            budget -= num_new

        # Waiting sequences, first come first served, while budget, seats and blocks last. Not in a
        # step that had to preempt: a sequence admitted now would only be preempted again.
        prefilling = None  # requests with a sequence computing its prompt (built on first need)
        loras = None  # adapter ids of running sequences (built on first need, with max_loras)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            if self.max_loras is not None and seq.lora_request is not None:
                if loras is None:
                    loras = {s.lora_int_id for s in self.running if s.lora_request is not None}
                if seq.lora_int_id not in loras and len(loras) >= self.max_loras:
                    break  # every adapter slot is taken by running sequences: admitted when one frees
                loras.add(seq.lora_int_id)
            if self._shares_prompt_with_sibling(seq):
                if prefilling is None:
                    prefilling = {s.request_id for s in self.running if s.num_computed_tokens < s.num_prompt_tokens}
                if seq.request_id in prefilling:
                    # a sibling (n > 1) is computing this prompt: admitted next step, it reads the prompt's
                    # full blocks from the prefix cache instead of computing them a second time
                    break
            if not self.bm.allocate_slots(seq, min(seq.num_tokens - seq.num_computed_tokens, budget)):
                break
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)  # after any cached prefix
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled_ids.add(seq.seq_id)
            prefills.append(ScheduledSeq(seq, num_new, seq.num_computed_tokens + num_new == seq.num_tokens))
            budget -= num_new
            if prefilling is not None:
                prefilling.add(seq.request_id)

        out.scheduled = decodes + prefills
        out.num_decodes = len(decodes)
        out.num_batched_tokens = start_budget - budget
        self.stats.num_steps += 1
        self.stats.num_prefill_tokens += sum(_prefill_tokens(item) for item in out.scheduled)
        return out

    def _shares_prompt_with_sibling(self, seq: Sequence) -> bool:
        """Whether ``seq`` could read its prompt from a sibling's cached blocks: prefix caching on,
        a fresh sequence of a request with n > 1, a prompt of at least one full block."""
        return (self.bm.enable_prefix_caching and seq.params.n > 1 and seq.num_computed_tokens == 0
                and seq.num_prompt_tokens >= self.bm.block_size)

    # ------------------------------------------------------------------ after the model ran
    def update(self, out: SchedulerOutput, sampled: dict[int, int], eos_token_ids: set[int],
               now: float | None = None) -> list[Sequence]:
        """Advance computed counts, append sampled tokens, apply token-level stops.

        ``sampled`` maps seq_id to the new token for sequences with ``sample`` set. Returns
        the sequences that received a token (finished ones included).
        """
        del now
        self.advance(out)
        return self.commit(out, sampled, eos_token_ids)

    def advance(self, out: SchedulerOutput) -> None:
        """The step ``out`` was launched: count its tokens as computed and give every sequence
        that samples a ``PENDING_TOKEN`` in place of the token not known yet, so that the
        next step can be scheduled now (a pipelined engine launches it before this one's
        tokens reach the host; ``commit`` writes them in)."""
        running_status = SequenceStatus.RUNNING
        bm = self.bm
        caching, block_size = bm.enable_prefix_caching, bm.block_size
        for item in out.scheduled:
            seq = item.seq
            if seq.status is not running_status:
                continue
            seq.num_computed_tokens += item.num_new_tokens
            # (cache_computed_blocks returns at once unless a block became full; a pending token
            # is never inside a computed block: it is computed by the next step)
            if caching and min(seq.num_computed_tokens, len(seq.token_ids)) // block_size > len(seq.block_hashes):
                bm.cache_computed_blocks(seq)
            if item.sample:
                seq.token_ids.append(PENDING_TOKEN)

    def commit(self, out: SchedulerOutput, sampled: dict[int, int], eos_token_ids: set[int]) -> list[Sequence]:
        """Write the sampled tokens of an advanced step over their pending places and apply
        the stops. Sequences that ended meanwhile (aborted, or stopped while this step was in
        flight) get their token written but nothing else."""
        touched = []
        running_status = SequenceStatus.RUNNING
        check_stop = self.check_stop
        for item in out.scheduled:
            if not item.sample:
                continue
            seq = item.seq
            if not seq.token_ids or seq.token_ids[-1] != PENDING_TOKEN:
                continue  # not advanced (it had ended before the step was launched)
            token = sampled[seq.seq_id]
            seq.fill_last_token(token)
            if seq.status is not running_status:
                continue
            touched.append(seq)
            status = check_stop(seq, token, eos_token_ids)
            if status is not None:
                self.finish(seq, status)
        self.stats.num_generated_tokens += len(touched)
        return touched

    def ends_by_length(self, seq: Sequence) -> bool:
        """Whether the sequence's last token (known or pending) reaches a length limit, so that
        it finishes when that token is committed."""
        num_tokens = len(seq.token_ids)
        limit = seq.params.max_tokens
        return num_tokens >= self.max_model_len or (limit is not None and
                                                    num_tokens - len(seq.prompt_token_ids) >= limit)

    def has_work_ahead(self) -> bool:
        """Whether a step could be scheduled now: a waiting sequence, or a running one that
        its pending token (if any) does not finish."""
        return bool(self.waiting) or any(
            s.token_ids[-1] != PENDING_TOKEN or not self.ends_by_length(s) for s in self.running)

    def fits_without_preemption(self) -> bool:
        """Whether every running sequence can get the blocks for its next chunk, whatever the
        step budget gives it: then ``schedule`` preempts nothing (a pipelined engine schedules
        only such steps ahead, since a preempted sequence may hold a pending token)."""
        bm = self.bm
        need = 0
        for seq in self.running:
            left = len(seq.token_ids) - seq.num_computed_tokens
            if left <= 0 or (left == 1 and seq.token_ids[-1] == PENDING_TOKEN and self.ends_by_length(seq)):
                continue
            tokens = seq.num_computed_tokens + min(left, self.max_num_batched_tokens)
            need += bm.new_blocks_needed(seq, tokens)
        return need <= bm.num_free_blocks

    def check_stop(self, seq: Sequence, token: int, eos_token_ids: set[int]) -> SequenceStatus | None:
        params = seq.params
        num_tokens = len(seq.token_ids)
        n_out = num_tokens - len(seq.prompt_token_ids)
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in eos_token_ids:
                seq.stop_reason = None
                return SequenceStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
        if params.max_tokens is not None and n_out >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None


def _prefill_tokens(item: ScheduledSeq) -> int:
    """Tokens of a scheduled chunk that are prompt work (the prompt, or everything but the last
    token when a preempted sequence recomputes), whether the chunk is long or a last single token."""
    seq = item.seq
    start = seq.num_computed_tokens
    limit = max(seq.num_prompt_tokens, seq.num_tokens - 1)
    return max(0, min(start + item.num_new_tokens, limit) - start)


def monotonic() -> float:
    return time.monotonic()
