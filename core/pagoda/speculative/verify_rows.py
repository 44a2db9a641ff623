"""Verification as a decode batch: a sequence's last token and its k drafts become k + 1 decode
rows, row j at position P + j over the sequence's own block table (P: its computed tokens).

Every attention backend stores a step's new K/V at their slots before any attention of that layer
reads the cache (pagoda's backends do; it is what lets row j see the keys of rows 0 .. j - 1 of
the same step), so each row computes exactly what one-token-at-a-time decoding would. The batch is
an ordinary decode step: it replays the captured decode graphs (CUDA graphs) when it fits them,
which a chunked verification (the prefill path) cannot.
"""

from __future__ import annotations

import torch

from pagoda.engine.inputs import build_step_inputs
from pagoda.engine.scheduler import SchedulerOutput
from pagoda.engine.step_plan import PlannedRow, StepPlan
from pagoda.forward_context import set_forward_context


def decode_rows(vout: SchedulerOutput, drafts: dict[int, list[int]]) -> tuple[StepPlan, list[list[int]]]:
    """The decode batch of a decode-only verification step, and per sampling item its rows. A verified
    sequence's row j is owned by (seq_id, j), the key decode graphs keep its block-table row under."""
    planned, rows = [], []
    for it in vout.scheduled:
        seq = it.seq
        d = drafts.get(seq.seq_id)
        base = seq.num_computed_tokens  # the sequence's last known token is computed at this position
        tables = (seq.block_table, *seq.group_block_tables)
        if d is None:
            rows.append([len(planned)])
            planned.append(PlannedRow(seq.seq_id, base, 1, True, seq.num_prompt_tokens, seq.num_preemptions,
                                      seq.lora_int_id, False, seq.token_ids[base:base + 1], tables))
            continue
        tokens = seq.token_ids[base:base + 1 + len(d)]  # (token_ids holds the drafts during the step)
        rows.append(list(range(len(planned), len(planned) + len(tokens))))
        for j, token in enumerate(tokens):
            planned.append(PlannedRow((seq.seq_id, j), base + j, 1, True, seq.num_prompt_tokens, seq.num_preemptions,
                                      seq.lora_int_id, False, [token], tables))
    return StepPlan(tuple(planned), len(planned), len(planned)), rows


@torch.inference_mode()
def forward_as_decodes(runner, vout: SchedulerOutput, drafts: dict[int, list[int]], eager: bool = False):
    """(logits [R, V] of every row, rows per sampling item) for a decode-only step: a replay of the
    decode graphs when they hold the rows, else (``eager``) an eager decode step, else None."""
    plan, rows = decode_rows(vout, drafts)
    graphs = runner.graphs
    if graphs is not None and graphs.can_run(plan):
        return graphs.run(plan), rows
    if not eager:
        return None
    inputs = build_step_inputs(plan, runner.config.block_size, runner.device,
                               num_groups=runner.kv_layout.num_groups)
    ctx = runner.forward_context(inputs)
    with set_forward_context(ctx):
        hidden = runner.model(inputs.input_ids, inputs.positions)
        logits = runner.model.compute_logits(hidden)
    runner.add_expert_counts(ctx)
    return logits, rows
