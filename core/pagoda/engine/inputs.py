"""Turning a StepPlan (``pagoda.engine.step_plan``) into the flat tensors one model step needs (numpy, no
loops over tokens): input ids, positions, slot mapping, block tables and the sampling rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from pagoda.engine.step_plan import StepPlan
from pagoda.forward_context import AttentionMetadata
from pagoda.kernels.host_upload import upload


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    token_seq_lens: torch.Tensor  # [T] int32, max(prompt length, position + 1) of each token
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [N] rows of the hidden states to sample from
    # KV cache groups 1.. (``pagoda.engine.kv_groups``): (block_tables, slot_mapping) of each
    group_tables: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # extra keyword arguments of model.forward (multimodal models: image_embeds, pagoda.multimodal.encoder)
    model_kwargs: dict = field(default_factory=dict)
    lora: object | None = None  # pagoda.lora.manager.LoRAMapping of the step's adapters, if any


TABLE_WIDTH_MULTIPLE = 16  # block tables of eager steps are padded to a multiple of this many blocks


@dataclass
class StepArrays:
    """A step's inputs on the host (numpy): what ``build_step_inputs`` uploads, and what mixed-batch graphs
    (``pagoda.engine.mixed_graphs``) copy into their static buffers."""

    ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    token_seq_lens: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B+1] int64
    seq_lens: np.ndarray  # [B] int64
    tables: list[np.ndarray]  # per KV cache group: [B, width] int32
    slots: list[np.ndarray]  # per KV cache group: [T] int64
    sample_rows: list[int]  # scheduled sequences that sample, in batch order
    sample_indices: np.ndarray  # [N] int64, their rows (each one's last token)
    max_query_len: int
    max_blocks: int  # the widest block table in use


def step_arrays(plan: StepPlan, block_size: int, block_table_width: int | None = None,
                num_groups: int = 1) -> StepArrays:
    rows = plan.rows
    n = len(rows)
    computed = np.fromiter((r.num_computed_tokens for r in rows), np.int64, n)
    num_new = np.fromiter((r.num_new_tokens for r in rows), np.int64, n)
    qsl = np.zeros(n + 1, np.int64)
    np.cumsum(num_new, out=qsl[1:])
    t = int(qsl[-1])
    seq_lens = computed + num_new

    if plan.num_decodes == n:  # pure decode: one token each, its sequence's last one
        ids = np.fromiter((r.tokens[0] for r in rows), np.int64, n)
        positions = computed
        row = np.arange(n)
        token_seq_lens = seq_lens
    else:
        ids = np.fromiter(chain.from_iterable(r.tokens for r in rows), np.int64, t)
        row = np.repeat(np.arange(n), num_new)
        positions = np.arange(t, dtype=np.int64) - np.repeat(qsl[:-1] - computed, num_new)
        # The sequence length each token is computed at, independent of chunking and of
        # recomputation after preemption: the prompt length for prompt tokens, position + 1
        # for generated ones (as transformers does: prefill once, then one token at a time).
        prompt_lens = np.fromiter((r.num_prompt_tokens for r in rows), np.int64, n)
        token_seq_lens = np.maximum(np.repeat(prompt_lens, num_new), positions + 1)

    max_blocks = int(-(-seq_lens.max() // block_size)) if n else 1
    # (eager steps: a multiple of TABLE_WIDTH_MULTIPLE, so that the tables' row stride, an argument of the
    # attention kernels, keeps one value class: Triton compiles a kernel variant per class (1, a multiple of
    # 16, other), and a context crossing 16 blocks compiled one mid-serving, stalling every stream)
    width = max(block_table_width or -(-max_blocks // TABLE_WIDTH_MULTIPLE) * TABLE_WIDTH_MULTIPLE, max_blocks)
    tables, slots = [], []
    for group in range(num_groups):
        table = np.zeros((n, width), np.int32)
        for i, r in enumerate(rows):
            bt = r.block_tables[group]
            k = min(len(bt), width)
            table[i, :k] = bt[:k]
        np.maximum(table, 0, out=table)  # blocks that left a window (NULL_BLOCK, -1): any valid id, never read
        tables.append(table)
        slots.append(table[row, positions // block_size].astype(np.int64) * block_size + positions % block_size)
    sample_rows = [i for i, r in enumerate(rows) if r.sample]
    return StepArrays(ids, positions, token_seq_lens, qsl, seq_lens, tables, slots, sample_rows,
                      qsl[1:][sample_rows] - 1, int(num_new.max()) if n else 0, max_blocks)


def build_step_inputs(plan: StepPlan, block_size: int, device: torch.device,
                      block_table_width: int | None = None, num_groups: int = 1) -> StepInputs:
    a = step_arrays(plan, block_size, block_table_width, num_groups)
    n = len(plan.rows)

    def dev(x: np.ndarray) -> torch.Tensor:
        return upload(x, device)  # never waits for the step in flight (a pipelined step is built meanwhile)

    meta = AttentionMetadata(
        num_tokens=len(a.ids), num_seqs=n, num_decodes=plan.num_decodes,
        max_query_len=a.max_query_len, max_seq_len=int(a.seq_lens.max()) if n else 0,
        block_size=block_size,
        query_start_loc=dev(a.query_start_loc.astype(np.int32)), seq_lens=dev(a.seq_lens.astype(np.int32)),
        block_tables=dev(a.tables[0]), slot_mapping=dev(a.slots[0]),
        query_start_loc_cpu=a.query_start_loc.tolist(), seq_lens_cpu=a.seq_lens.tolist(),
    )
    return StepInputs(
        input_ids=dev(a.ids), positions=dev(a.positions), token_seq_lens=dev(a.token_seq_lens.astype(np.int32)),
        meta=meta, sample_indices=dev(a.sample_indices),
        group_tables=[(dev(a.tables[g]), dev(a.slots[g])) for g in range(1, num_groups)],
    )
