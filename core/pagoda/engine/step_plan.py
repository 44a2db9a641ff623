"""A scheduled step as plain data: everything a runner reads to build the step's inputs, on any rank.
No torch, no live objects in what travels.

``plan_step(out)`` turns the scheduler's ``SchedulerOutput`` into a ``StepPlan``: per scheduled sequence
its counts, whether it samples, its adapter, its block tables and the token ids this step computes
(``token_ids[num_computed_tokens:num_computed_tokens + num_new_tokens]``; a ``PENDING_TOKEN`` where the
previous step's token is still on the device: the step pipeline feeds it from there). Nothing is
remembered between steps, so any step driver (the engine, speculative decoding, pooling, scoring) makes
its plan the same way, and the tensor-parallel executor sends the plan as it is to the other ranks
(``pagoda.engine.executor.step_codec``). Block tables travel whole: preemption, prefix caching and
released window blocks rewrite them (decode graphs still copy only what changed to the device).

Rank 0's plan also holds each row's ``Sequence`` (``StepPlan.sequences``, never sent: other ranks do not
sample): the runner reads them only through ``sampling_rows`` / ``sampling_row`` (``pagoda.engine.
sampling_batch``: what choosing a token and scoring a prompt read, copied out as plain rows). Where a row's
prompt holds images, the plan carries each row's ``MultiModalInputs`` (``StepPlan.mm_inputs``: the images and
where they lie; rank 0's too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pagoda.engine.sampling_batch import SamplingRow, sampling_rows
from pagoda.engine.scheduler import SchedulerOutput

# How a launched step's tokens are chosen (``ModelRunner.launch(plan, how=...)``; the runner's and every
# executor's ``launch_modes`` say which they can).
ARGMAX = "argmax"  # the argmax on the device, copied to the host in the background (the step pipeline)
ON_DEVICE = "device"  # the sampler on the device, once the host allows (``choose_on_device``): greedy or random,
#                       under grammar masks filled from matchers advanced in between (the step pipeline)
ON_HOST = "host"  # the whole sampler when collected (logits processing, logprobs, prompt logprobs)


class PlannedRow(NamedTuple):
    """One scheduled sequence of a step (a tuple: cheap to make, for every row of every step)."""

    seq_id: int | tuple  # (speculative verification rows: (seq_id, draft position))
    num_computed_tokens: int  # before this step
    num_new_tokens: int  # tokens this step computes
    sample: bool  # the step computes the last known token: a token is sampled
    num_prompt_tokens: int
    num_preemptions: int  # decode graphs key their incremental block tables on (seq_id, this)
    lora_int_id: int  # the LoRA adapter, 0 for the base model
    wants_prompt_logprobs: bool
    tokens: list[int]  # the ids this step computes, one per new token
    block_tables: tuple[list[int], ...]  # every KV cache group's table (group 0 first), whole (read-only)

    @property
    def block_table(self) -> list[int]:
        return self.block_tables[0]


@dataclass(frozen=True, slots=True)
class StepPlan:
    rows: tuple[PlannedRow, ...]  # decodes first, then prefill chunks (the scheduler's order)
    num_decodes: int
    num_batched_tokens: int
    sequences: tuple = ()  # rank 0's Sequence of each row (never sent to other ranks; read through the methods)
    mm_inputs: tuple = ()  # each row's MultiModalInputs or None, where any row has images (else empty)

    def sampling_rows(self) -> list[SamplingRow]:
        """The rows that sample, as the sampler reads them, in row order (none on other ranks)."""
        if not self.sequences:
            return []
        return sampling_rows([seq for seq, row in zip(self.sequences, self.rows) if row.sample])

    def sampling_row(self, i: int) -> SamplingRow | None:
        """Row ``i`` as the sampler reads it (prompt logprobs: its prompt ids and ``params.prompt_logprobs``);
        None on other ranks."""
        return sampling_rows([self.sequences[i]])[0] if self.sequences else None


def plan_step(out: SchedulerOutput) -> StepPlan:
    """``out`` as plain data. The rows hold the sequences' own block-table lists (a copy of every table on every
    step cost more than the rest of the row): a plan is read before the scheduler runs again, which is when
    the block manager changes them."""
    rows = []
    seqs = []
    images = False
    new_row = tuple.__new__  # (PlannedRow's own __new__ is one Python call more per row)
    for it in out.scheduled:
        seq = it.seq
        start, count = seq.num_computed_tokens, it.num_new_tokens
        groups = seq.group_block_tables
        lora = seq.lora_request
        rows.append(new_row(PlannedRow, (
            seq.seq_id, start, count, it.sample, len(seq.prompt_token_ids), seq.num_preemptions,
            0 if lora is None else lora.lora_int_id, seq.wants_prompt_logprobs, seq.token_ids[start:start + count],
            (seq.block_table, *groups) if groups else (seq.block_table,))))
        seqs.append(seq)
        images = images or seq.mm_inputs is not None
    return StepPlan(tuple(rows), out.num_decodes, out.num_batched_tokens, tuple(seqs),
                    tuple(seq.mm_inputs for seq in seqs) if images else ())
