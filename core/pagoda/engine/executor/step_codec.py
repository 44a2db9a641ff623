"""A ``StepPlan`` (``pagoda.engine.step_plan``) as int64 words, and back: what rank 0 broadcasts to the
other ranks each step. Stateless: the planner decides which tokens travel, every rank's ``InputBatch``
keeps its copies.

Words: ``[n, num_decodes, num_batched_tokens, num_forgotten, one_off, num_groups]``, then n rows of
``(seq_id, num_computed_tokens, num_new_tokens, flags, num_prompt_tokens, num_preemptions, num_sent_tokens,
num_blocks, first_sent)`` (flags: 1 = samples, 2 = wants prompt logprobs, bits 2..: the LoRA adapter id, 0
for the base model), then the sent tokens, the block tables (``num_blocks`` entries of each KV cache group,
group 0 first: the groups' tables have one length) and the forgotten ids.
"""

from __future__ import annotations

import numpy as np

from pagoda.engine.step_plan import PlannedRow, StepPlan

HEAD = 6
COLUMNS = 9


def encode_plan(plan: StepPlan) -> np.ndarray:
    rows = plan.rows
    n = len(rows)
    groups = len(rows[0].block_tables) if rows else 1
    table = np.empty((n, COLUMNS), np.int64)
    tokens: list[int] = []
    blocks: list[int] = []
    for i, r in enumerate(rows):
        flags = int(r.sample) | (2 if r.wants_prompt_logprobs else 0) | (r.lora_int_id << 2)
        table[i] = (r.seq_id, r.num_computed_tokens, r.num_new_tokens, flags, r.num_prompt_tokens, r.num_preemptions,
                    len(r.tokens), len(r.block_tables[0]), r.first_sent)
        tokens += r.tokens
        for t in r.block_tables:
            blocks += t
    head = np.array([n, plan.num_decodes, plan.num_batched_tokens, len(plan.forgotten), int(plan.one_off), groups],
                    np.int64)
    return np.concatenate([head, table.reshape(-1), np.asarray(tokens, np.int64), np.asarray(blocks, np.int64),
                           np.asarray(plan.forgotten, np.int64)])


def decode_plan(words: np.ndarray) -> StepPlan:
    n, num_decodes, num_batched, num_forgotten, one_off, groups = (int(v) for v in words[:HEAD])
    table = words[HEAD:HEAD + n * COLUMNS].reshape(n, COLUMNS).tolist()
    pos = HEAD + n * COLUMNS
    num_tokens = sum(r[6] for r in table)
    tokens = words[pos:pos + num_tokens].tolist()
    pos += num_tokens
    num_blocks = sum(r[7] for r in table) * groups
    blocks = words[pos:pos + num_blocks].tolist()
    pos += num_blocks
    forgotten = tuple(words[pos:pos + num_forgotten].tolist())
    rows = []
    t = b = 0
    for seq_id, computed, num_new, flags, num_prompt, preemptions, num_sent, num_bt, first_sent in table:
        tables = tuple(tuple(blocks[b + g * num_bt:b + (g + 1) * num_bt]) for g in range(groups))
        rows.append(PlannedRow(seq_id, computed, num_new, bool(flags & 1), num_prompt, preemptions, first_sent,
                               tuple(tokens[t:t + num_sent]), tables, flags >> 2, bool(flags & 2)))
        t += num_sent
        b += num_bt * groups
    return StepPlan(tuple(rows), num_decodes, num_batched, forgotten, bool(one_off))
