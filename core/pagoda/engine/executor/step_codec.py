"""A ``StepPlan`` (``pagoda.engine.step_plan``) as int64 words, and back: what rank 0 broadcasts to the
other ranks each step. Stateless: the planner decides which tokens travel, every rank's ``InputBatch``
keeps its copies.

Words: ``[n, num_decodes, num_batched_tokens, num_forgotten, one_off, num_groups]``, then n rows of the
``PlannedRow`` numbers (``seq_id, num_computed_tokens, num_new_tokens, sample, num_prompt_tokens,
num_preemptions, lora_int_id, wants_prompt_logprobs, first_sent``) followed by ``num_sent_tokens,
num_blocks``, then the sent tokens, the block tables (``num_blocks`` entries of each KV cache group, group 0
first: the groups' tables have one length) and the forgotten ids. Made column by column (no per-row
numpy writes: 64 decode rows cost about as much as the mirror codec it replaced).
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from pagoda.engine.step_plan import PlannedRow, StepPlan

HEAD = 6
NUMBERS = 9  # the PlannedRow fields before ``tokens``
COLUMNS = NUMBERS + 2


def encode_plan(plan: StepPlan) -> np.ndarray:
    rows = plan.rows
    n = len(rows)
    groups = len(rows[0].block_tables) if rows else 1
    head = [n, plan.num_decodes, plan.num_batched_tokens, len(plan.forgotten), int(plan.one_off), groups]
    if not n:
        return np.asarray(head + list(plan.forgotten), np.int64)
    columns = list(zip(*rows))
    tokens, tables = columns[NUMBERS], columns[NUMBERS + 1]
    table = np.empty((n, COLUMNS), np.int64)
    table[:, :NUMBERS] = np.array(columns[:NUMBERS], np.int64).T
    table[:, NUMBERS] = [len(t) for t in tokens]
    table[:, NUMBERS + 1] = [len(t[0]) for t in tables]
    blocks = chain.from_iterable(chain.from_iterable(tables))
    return np.concatenate([np.asarray(head, np.int64), table.reshape(-1),
                           np.fromiter(chain.from_iterable(tokens), np.int64),
                           np.fromiter(blocks, np.int64), np.asarray(plan.forgotten, np.int64)])


def decode_plan(words: np.ndarray) -> StepPlan:
    n, num_decodes, num_batched, num_forgotten, one_off, groups = (int(v) for v in words[:HEAD])
    table = words[HEAD:HEAD + n * COLUMNS].reshape(n, COLUMNS)
    pos = HEAD + n * COLUMNS
    sent, widths = table[:, NUMBERS].tolist(), table[:, NUMBERS + 1].tolist()
    num_tokens = sum(sent)
    tokens = words[pos:pos + num_tokens].tolist()
    pos += num_tokens
    num_blocks = sum(widths) * groups
    blocks = words[pos:pos + num_blocks].tolist()
    pos += num_blocks
    forgotten = tuple(words[pos:pos + num_forgotten].tolist())
    rows = []
    t = b = 0
    for (seq_id, computed, num_new, sample, num_prompt, preemptions, lora, wants, first_sent), k, w in zip(
            table[:, :NUMBERS].tolist(), sent, widths):
        if groups == 1:
            tables = (blocks[b:b + w],)
        else:
            tables = tuple(blocks[b + g * w:b + (g + 1) * w] for g in range(groups))
        rows.append(PlannedRow(seq_id, computed, num_new, sample == 1, num_prompt, preemptions, lora, wants == 1,
                               first_sent, tokens[t:t + k], tables))
        t += k
        b += w * groups
    return StepPlan(tuple(rows), num_decodes, num_batched, forgotten, bool(one_off))
