"""A ``StepPlan`` (``pagoda.engine.step_plan``) as int64 words, and back: what rank 0 broadcasts to the
other ranks each step (its rows only: rank 0's sequences stay with rank 0, which alone samples).

Words: ``[n, num_decodes, num_batched_tokens, num_groups]``, then n rows of the ``PlannedRow`` numbers
(``seq_id, num_computed_tokens, num_new_tokens, sample, num_prompt_tokens, num_preemptions, lora_int_id,
wants_prompt_logprobs``) followed by ``num_blocks``, then the rows' tokens (``num_new_tokens`` each), then
the block tables (``num_blocks`` entries of each KV cache group, group 0 first: the groups' tables have one
length). Made column by column (no per-row numpy writes).
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from pagoda.engine.step_plan import PlannedRow, StepPlan

HEAD = 4
NUMBERS = 8  # the PlannedRow fields before ``tokens``
COLUMNS = NUMBERS + 1


def encode_plan(plan: StepPlan) -> np.ndarray:
    rows = plan.rows
    n = len(rows)
    groups = len(rows[0].block_tables) if rows else 1
    head = np.array([n, plan.num_decodes, plan.num_batched_tokens, groups], np.int64)
    if not n:
        return head
    columns = list(zip(*rows))
    tokens, tables = columns[NUMBERS], columns[NUMBERS + 1]
    table = np.empty((n, COLUMNS), np.int64)
    table[:, :NUMBERS] = np.array(columns[:NUMBERS], np.int64).T
    table[:, NUMBERS] = [len(t[0]) for t in tables]
    blocks = chain.from_iterable(chain.from_iterable(tables))
    return np.concatenate([head, table.reshape(-1), np.fromiter(chain.from_iterable(tokens), np.int64),
                           np.fromiter(blocks, np.int64)])


def decode_plan(words: np.ndarray) -> StepPlan:
    n, num_decodes, num_batched, groups = (int(v) for v in words[:HEAD])
    table = words[HEAD:HEAD + n * COLUMNS].reshape(n, COLUMNS)
    pos = HEAD + n * COLUMNS
    numbers = table[:, :NUMBERS].tolist()
    widths = table[:, NUMBERS].tolist()
    num_tokens = sum(r[2] for r in numbers)
    tokens = words[pos:pos + num_tokens].tolist()
    pos += num_tokens
    blocks = words[pos:pos + sum(widths) * groups].tolist()
    rows = []
    t = b = 0
    for (seq_id, computed, num_new, sample, num_prompt, preemptions, lora, wants), w in zip(numbers, widths):
        if groups == 1:
            tables = (blocks[b:b + w],)
        else:
            tables = tuple(blocks[b + g * w:b + (g + 1) * w] for g in range(groups))
        rows.append(PlannedRow(seq_id, computed, num_new, sample == 1, num_prompt, preemptions, lora, wants == 1,
                               tokens[t:t + num_new], tables))
        t += num_new
        b += w * groups
    return StepPlan(tuple(rows), num_decodes, num_batched)
