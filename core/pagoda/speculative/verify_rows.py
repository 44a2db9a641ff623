"""Verification as a decode batch: a sequence's last token and its k drafts become k + 1 decode
rows, row j at position P + j over the sequence's own block table (P: its computed tokens).

Every attention backend stores a step's new K/V at their slots before any attention of that layer
reads the cache (pagoda's backends do; it is what lets row j see the keys of rows 0 .. j - 1 of
the same step), so each row computes exactly what one-token-at-a-time decoding would. The batch is
an ordinary decode step: it replays the captured decode graphs (CUDA graphs) when it fits them,
which a chunked verification (the prefill path) cannot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagoda.engine.inputs import build_step_inputs
from pagoda.engine.scheduler import ScheduledSeq, SchedulerOutput
from pagoda.forward_context import set_forward_context


@dataclass(slots=True, eq=False)
class DecodeRow:
    """What a decode step reads of a sequence, for one position of a verified sequence."""

    seq_id: tuple[int, int]  # (sequence, position in the verification): the graphs' table-row owner
    token_ids: list[int]  # [the token computed at this row's position]
    num_computed_tokens: int
    num_tokens: int
    num_prompt_tokens: int
    block_table: list[int]
    group_block_tables: list[list[int]] = field(default_factory=list)
    num_preemptions: int = 0


def decode_rows(vout: SchedulerOutput, drafts: dict[int, list[int]]) -> tuple[SchedulerOutput, list[list[int]]]:
    """The decode batch of a decode-only verification step, and per sampling item its rows."""
    items, rows = [], []
    for it in vout.scheduled:
        seq = it.seq
        d = drafts.get(seq.seq_id)
        if d is None:
            rows.append([len(items)])
            items.append(it)
            continue
        base = seq.num_computed_tokens  # the sequence's last known token is computed at this position
        tokens = seq.token_ids[base:base + 1 + len(d)]  # (token_ids holds the drafts during the step)
        rows.append(list(range(len(items), len(items) + len(tokens))))
        for j, token in enumerate(tokens):
            row = DecodeRow((seq.seq_id, j), [token], base + j, base + j + 1, seq.num_prompt_tokens,
                            seq.block_table, seq.group_block_tables, seq.num_preemptions)
            items.append(ScheduledSeq(row, 1, True))
    return SchedulerOutput(items, len(items), len(items)), rows


@torch.inference_mode()
def forward_as_decodes(runner, vout: SchedulerOutput, drafts: dict[int, list[int]], eager: bool = False):
    """(logits [R, V] of every row, rows per sampling item) for a decode-only step: a replay of the
    decode graphs when they hold the rows, else (``eager``) an eager decode step, else None."""
    rows_out, rows = decode_rows(vout, drafts)
    graphs = runner.graphs
    if graphs is not None and graphs.can_run(rows_out):
        return graphs.run(rows_out), rows
    if not eager:
        return None
    inputs = build_step_inputs(rows_out, runner.config.block_size, runner.device,
                               num_groups=runner.kv_layout.num_groups)
    ctx = runner.forward_context(inputs)
    with set_forward_context(ctx):
        hidden = runner.model(inputs.input_ids, inputs.positions)
        logits = runner.model.compute_logits(hidden)
    runner.add_expert_counts(ctx)
    return logits, rows
