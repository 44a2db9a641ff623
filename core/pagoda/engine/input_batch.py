"""A runner's own copy of every live sequence, kept up to date from ``StepPlan``s
(``pagoda.engine.step_plan``). No torch.

``InputBatch.apply(plan)`` updates the copies (new rows, the token ids sent, counts, block tables),
drops the ones the plan forgets, and returns the step as the runner reads it: a ``SchedulerOutput``
whose items hold ``BatchRow``s. A ``BatchRow`` has the fields of a ``Sequence`` that the runner's input
building, graphs, LoRA mapping and prompt logprobs read (``seq_id``, ``token_ids``, ``num_tokens``,
``num_prompt_tokens``, ``num_computed_tokens``, ``block_table``, ``group_block_tables``,
``num_preemptions``, ``lora_request``, ``lora_int_id``, ``wants_prompt_logprobs``) and nothing else: no
sampling parameters, no status, no grammar (rank 0 samples).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagoda.engine.scheduler import ScheduledSeq, SchedulerOutput
from pagoda.engine.step_plan import StepPlan


@dataclass(slots=True)
class BatchRow:
    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    block_table: list[int] = field(default_factory=list)
    group_block_tables: list[list[int]] = field(default_factory=list)  # KV cache groups 1..
    lora_request: object | None = None  # the adapter's LoRARequest (registered on this runner), None: base
    wants_prompt_logprobs: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def lora_int_id(self) -> int:
        return 0 if self.lora_request is None else self.lora_request.lora_int_id


class InputBatch:
    """The copies, by seq_id. ``lora_lookup``: a LoRA adapter id -> its LoRARequest on this runner."""

    def __init__(self, lora_lookup: Callable[[int], object] | None = None) -> None:
        self.rows: dict[int, BatchRow] = {}
        self.lora_lookup = lora_lookup

    def apply(self, plan: StepPlan) -> SchedulerOutput:
        """Bring the copies up to ``plan`` and return its step (items hold this batch's rows; a one-off
        plan's rows are built for the step only)."""
        for seq_id in plan.forgotten:
            self.rows.pop(seq_id, None)
        keep = not plan.one_off
        lookup = self.lora_lookup
        scheduled = []
        for p in plan.rows:
            row = self.rows.get(p.seq_id) if keep else None
            if row is None:
                row = BatchRow(p.seq_id, list(p.tokens), p.num_prompt_tokens)
                if keep:
                    self.rows[p.seq_id] = row
            elif p.tokens:
                del row.token_ids[p.first_sent:]  # (a pending token sent before, now known)
                row.token_ids.extend(p.tokens)
            row.num_computed_tokens = p.num_computed_tokens
            row.num_preemptions = p.num_preemptions
            row.wants_prompt_logprobs = p.wants_prompt_logprobs
            row.lora_request = lookup(p.lora_int_id) if p.lora_int_id else None
            # (the plan's own lists: a plan is made for one batch, and its lists are copies)
            row.block_table = p.block_tables[0]
            row.group_block_tables = list(p.block_tables[1:])
            scheduled.append(ScheduledSeq(row, p.num_new_tokens, p.sample))
        return SchedulerOutput(scheduled, plan.num_decodes, plan.num_batched_tokens)

    def forget(self, seq_id: int) -> None:
        self.rows.pop(seq_id, None)
