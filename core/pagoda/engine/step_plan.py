"""A scheduled step as plain data: what a runner that keeps its own copy of every live sequence
(``pagoda.engine.input_batch``) needs to run it. No torch, no live objects.

``StepPlanner`` (next to the scheduler, one per runner that keeps a copy) turns a ``SchedulerOutput``
into a ``StepPlan``: per scheduled sequence its counts, its whole block tables, and only the token ids
the runner has not had yet — all of them the first time, the ones appended since on later steps. A
``PENDING_TOKEN`` (the step pipeline's stand-in for a token still on the device) is sent again, as the
real token, with the next step (``PlannedRow.first_sent`` says where the sent ids start, so the runner
overwrites its pending copy). Block tables travel whole: preemption, prefix caching and released
window blocks rewrite them. Sequences the engine forgot since the last plan are listed in
``forgotten``, so the runner drops their copies.

The tensor-parallel executor sends each plan to the other ranks (``pagoda.engine.executor.step_codec``
writes it as int64 words); every rank applies it to its ``InputBatch``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pagoda.engine.scheduler import PENDING_TOKEN, SchedulerOutput


class PlannedRow(NamedTuple):
    """One scheduled sequence of a step (a tuple: cheap to make, for every row of every step)."""

    seq_id: int
    num_computed_tokens: int  # before this step
    num_new_tokens: int  # tokens this step computes
    sample: bool  # the step computes the last known token: a token is sampled
    num_prompt_tokens: int
    num_preemptions: int  # decode graphs key their incremental block tables on (seq_id, this)
    lora_int_id: int  # the LoRA adapter, 0 for the base model
    wants_prompt_logprobs: bool
    first_sent: int  # the index in the sequence's token ids of ``tokens[0]``
    tokens: list[int]  # token ids from ``first_sent`` on that the runner has not had
    block_tables: tuple[list[int], ...]  # every KV cache group's table (group 0 first), whole


@dataclass(frozen=True, slots=True)
class StepPlan:
    rows: tuple[PlannedRow, ...]  # decodes first, then prefill chunks (the scheduler's order)
    num_decodes: int
    num_batched_tokens: int
    forgotten: tuple[int, ...] = ()  # seq ids the engine dropped since the last plan: runners drop theirs
    one_off: bool = False  # a step whose sequences the runner does not keep (scoring a prompt)


class StepPlanner:
    """Remembers how many tokens of each sequence a runner's copy holds (rank 0 of a tensor-parallel run
    plans for the other ranks' copies)."""

    def __init__(self) -> None:
        self._sent: dict[int, int] = {}
        self._forgotten: list[int] = []

    def forget(self, seq_id: int) -> None:
        if self._sent.pop(seq_id, None) is not None:
            self._forgotten.append(seq_id)

    def plan(self, out: SchedulerOutput, one_off: bool = False) -> StepPlan:
        """``out`` as plain data. ``one_off``: a step whose sequences the runner does not keep (every token
        is sent, nothing is remembered)."""
        rows = []
        sent_counts = self._sent
        for it in out.scheduled:
            seq = it.seq
            token_ids = seq.token_ids
            seq_id = seq.seq_id
            if one_off:
                sent = 0
            else:  # a pending last token is sent again once it is known
                sent = sent_counts.get(seq_id, 0)
                sent_counts[seq_id] = len(token_ids) - (token_ids[-1] == PENDING_TOKEN)
            groups = seq.group_block_tables
            # (copies: the block manager goes on changing its lists while a plan may still be read)
            tables = (seq.block_table[:], *(t[:] for t in groups)) if groups else (seq.block_table[:],)
            rows.append(PlannedRow(seq_id, seq.num_computed_tokens, it.num_new_tokens, it.sample,
                                   seq.num_prompt_tokens, seq.num_preemptions, seq.lora_int_id,
                                   seq.wants_prompt_logprobs, sent, token_ids[sent:], tables))
        forgotten, self._forgotten = tuple(self._forgotten), []
        return StepPlan(tuple(rows), out.num_decodes, out.num_batched_tokens, forgotten, one_off)
