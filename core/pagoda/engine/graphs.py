"""Decode steps replayed from captured graphs.

Decode-only batches are padded to the next size bucket and run from one graph per bucket
over static input buffers. Padding rows write nowhere (slot -1) and read one cached token.

Host cost per step is what limits small models at large batches, so the inputs are built
incrementally: the block table lives on the device as [max_blocks, max_batch] (block index
major; the graphs see its transpose, [batch, max_blocks] with strides (1, max_batch)), and a
row is rewritten only when another sequence takes it or its sequence was preempted; else
only the blocks appended since the last step are written. Each step copies three small
buffers to the device: the int64 rows (ids, positions, slots), the int32 rows (sequence
lengths) and the first ``max blocks in use`` rows of the table. A model with several KV cache
groups (``pagoda.engine.kv_groups``) has a table and a slot row per group; entries of blocks that
left a window are never read, so a released entry is not rewritten.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from pagoda.engine.step_plan import StepPlan
from pagoda.forward_context import AttentionMetadata, ForwardContext, prepared_context, set_forward_context
from pagoda.lora.ops import max_tiles, token_tiles

logger = logging.getLogger("pagoda")


def bucket_sizes(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_bs]
    sizes += list(range(16, max_bs, 16))
    return sorted(set(sizes + [max_bs]))


def capture_forward(runner, ctx: ForwardContext, ids: torch.Tensor, positions: torch.Tensor, pool,
                    logits: bool, eager_seconds: list | None = None) -> object:
    """The model's forward over static ``ids`` / ``positions`` under ``ctx``, run twice (kernels compiled,
    allocations settled) then captured into ``pool``; its output: the logits of every row, or (``logits``
    False) the hidden states. ``eager_seconds`` receives the second eager run's wall time (host and device)."""

    def step():
        with set_forward_context(ctx):
            ctx.expert_counts.clear()
            ctx.moe_pair_weights.clear()  # made inside the capture, from the graph's own slots
            hidden = runner.model(ids, positions)
            return runner.model.compute_logits(hidden) if logits else hidden

    with torch.inference_mode():
        step()
        if eager_seconds is None:
            step()
        else:
            eager_seconds.append(timed(runner.platform, step))
        return runner.platform.capture_graph(step, pool)


def timed(platform, fn) -> float:
    """Wall seconds of ``fn()`` and the device work it queues."""
    platform.synchronize()
    start = time.perf_counter()
    fn()
    platform.synchronize()
    return time.perf_counter() - start


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int, max_model_len: int):
        self.runner = runner
        self.max_bs = min(max_num_seqs, runner.config.max_cudagraph_capture_size or 512)
        self.block_size = runner.config.block_size
        self.width = -(-max_model_len // self.block_size)
        self.max_model_len = max_model_len
        self.buckets = bucket_sizes(self.max_bs)
        dev = runner.device
        host = runner.platform.host_buffer  # page-locked where the platform has it
        b, w = self.max_bs, self.width
        self.num_groups = g = runner.kv_layout.num_groups
        # int64 rows: input ids, positions, then the slots of each group, then (enable_lora) each row's
        # LoRA adapter slot (-1: the base; padding rows too) and the rows sorted by that slot;
        # int32 rows: seq lens, token seq lens
        self.lora = runner.lora
        self.host64 = host((2 + g + 2 * (self.lora is not None), b), torch.int64)
        # (enable_lora) the LoRA kernels' tiles (pagoda.lora.ops.token_tiles), padded per bucket
        self.tile_width = max_tiles(b, self.lora.max_loras) if self.lora is not None else 0
        self.host_tiles = host((3, self.tile_width), torch.int64)
        self.dev_tiles = torch.zeros(3, self.tile_width, dtype=torch.int64, device=dev)
        self.host32 = host((2, b), torch.int32)
        self.host_tables = host((g, w, b), torch.int32)  # [group, block index, row]
        self.dev64 = torch.zeros(self.host64.shape[0], b, dtype=torch.int64, device=dev)
        self.dev32 = torch.zeros(2, b, dtype=torch.int32, device=dev)
        self.dev_tables = torch.zeros(g, w, b, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, object] = {}
        self.contexts: dict[int, ForwardContext] = {}
        self.np64 = self.host64.numpy()
        self.np32 = self.host32.numpy()
        self.np_tables = self.host_tables.numpy()
        self.np_tiles = self.host_tiles.numpy()
        # what each table row holds: (seq_id, num_preemptions) and how many blocks were written
        self.row_owner: list[tuple[int, int] | None] = [None] * b
        self.row_blocks = [0] * b
        self.copied = None  # Platform.record_event() after the last step's host->device uploads

    def _views(self, bucket: int):
        ids, positions, slots = self.dev64[0, :bucket], self.dev64[1, :bucket], self.dev64[2, :bucket]
        seq_lens = self.dev32[0, :bucket]
        token_seq_lens = self.dev32[1, :bucket]
        tables = self.dev_tables[0].t()[:bucket]  # [bucket, width], strides (1, max_bs)
        groups = [(self.dev_tables[g].t()[:bucket], self.dev64[2 + g, :bucket]) for g in range(1, self.num_groups)]
        return ids, positions, slots, seq_lens, token_seq_lens, tables, groups

    def can_run(self, plan: StepPlan) -> bool:
        n = len(plan.rows)
        return 0 < n <= self.max_bs and plan.num_decodes == n

    def _update_tables(self, rows) -> int:
        """Write changed block-table entries into the host table; return the widest row used.
        Between preemptions a sequence's block table only grows, so (seq_id, preemptions)
        names its contents up to the blocks already written."""
        table = self.np_tables[0]
        others = [(self.np_tables[g], g - 1) for g in range(1, self.num_groups)]
        owners, written = self.row_owner, self.row_blocks
        widest = 0
        for i, r in enumerate(rows):
            tables = r.block_tables
            bt = tables[0]
            k = len(bt)
            if k > widest:
                widest = k
            owner = (r.seq_id, r.num_preemptions)
            done = written[i]
            if owners[i] == owner and done <= k and (done == 0 or table[done - 1, i] == bt[done - 1]):
                if k > done:  # new blocks only (a window's released entries are never read again)
                    table[done:k, i] = bt[done:k]
                    for other, g in others:
                        other[done:k, i] = tables[g + 1][done:k]
                    written[i] = k
                continue
            if k:  # released entries (NULL_BLOCK) as block 0: any valid id
                table[:k, i] = np.maximum(bt, 0)
                for other, g in others:
                    other[:k, i] = np.maximum(tables[g + 1], 0)
            owners[i] = owner
            written[i] = k
        return min(widest, self.width)

    def _fill(self, plan: StepPlan, bucket: int) -> int:
        """Fill the host buffers for a step; return how many table rows to copy. A sequence whose
        last token is still on the device (``PENDING_TOKEN``, the step pipeline) gets it patched in
        on the device (``run``'s ``patch``)."""
        rows = plan.rows
        n = len(rows)
        h64, h32 = self.np64, self.np32
        h64[0, :n] = [r.tokens[0] for r in rows]
        pos = np.fromiter((r.num_computed_tokens for r in rows), np.int64, n)
        h64[1, :n] = pos
        widest = self._update_tables(rows)
        block, rows = pos // self.block_size, np.arange(n)
        for g in range(self.num_groups):
            h64[2 + g, :n] = self.np_tables[g, block, rows].astype(np.int64) * self.block_size + pos % self.block_size
        if self.lora is not None:
            lora_slots = self.lora.sequence_slots(plan)
            h64[2 + self.num_groups, :n] = -1 if lora_slots is None else lora_slots
        h64[:2, n:bucket] = 0
        h64[2:, n:bucket] = -1
        if self.lora is not None:  # padding rows (slot -1) sort first with the base rows
            order = np.argsort(h64[2 + self.num_groups, :bucket], kind="stable")
            h64[3 + self.num_groups, :bucket] = order
            width = max_tiles(bucket, self.lora.max_loras)
            self.np_tiles[:, :width] = token_tiles(h64[2 + self.num_groups, :bucket][order], pad_to=width)
        h32[0, :n] = pos + 1
        h32[0, n:bucket] = 1
        h32[1, :n] = pos + 1  # a decoding sequence's length is its computed tokens + the new one
        h32[1, n:bucket] = 1
        return max(widest, 1)

    def run(self, plan: StepPlan) -> torch.Tensor:
        """Replay the bucket's graph for a decode batch; returns logits [n, vocab] (static
        buffer, valid until the next replay)."""
        return self.replay(self.stage(plan))

    @property
    def input_ids(self) -> torch.Tensor:
        """The graphs' input ids [max_bs] on the device: a staged step's rows may be overwritten here before its
        replay (decodes fed a token a step launched before is still computing: ``ModelRunner.launch``)."""
        return self.dev64[0]

    def stage(self, plan: StepPlan) -> tuple[int, int]:
        """The host half of ``run``: the batch's inputs written and their uploads queued (behind the
        work already on the stream, which includes the replay that reads the previous ones).
        Returns (rows, bucket) for ``replay``; no other replay may come between."""
        n = len(plan.rows)
        bucket = next(s for s in self.buckets if s >= n)
        if self.copied is not None:  # the previous step's uploads must have left the host buffers
            self.copied.synchronize()
        rows = self._fill(plan, bucket)
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32.copy_(self.host32, non_blocking=True)
        self.dev_tables[:, :rows].copy_(self.host_tables[:, :rows], non_blocking=True)
        if self.tile_width:
            self.dev_tiles.copy_(self.host_tiles, non_blocking=True)
        self.copied = self.runner.platform.record_event()
        return n, bucket

    def replay(self, staged: tuple[int, int]) -> torch.Tensor:
        """The device half of ``run`` for a ``stage``d batch."""
        n, bucket = staged
        graph = self.graphs[bucket]
        graph.replay()
        if self.contexts[bucket].expert_counts:
            self.runner.add_expert_counts(self.contexts[bucket])
        return graph.output[:n]

    def capture(self) -> None:
        runner = self.runner
        pool = runner.platform.graph_pool()
        for bucket in reversed(self.buckets):  # largest first, so smaller ones reuse its memory
            ids, positions, slots, seq_lens, token_seq_lens, tables, groups = self._views(bucket)
            self.dev32.fill_(1)
            self.dev_tables.zero_()
            self.dev64[2:].fill_(-1)
            if self.lora is not None:  # a permutation, as every step writes it
                self.dev64[3 + self.num_groups].copy_(torch.arange(self.max_bs))
            meta = AttentionMetadata(
                num_tokens=bucket, num_seqs=bucket, num_decodes=bucket, max_query_len=1,
                max_seq_len=self.max_model_len, block_size=self.block_size,
                query_start_loc=self.query_start_loc[:bucket + 1], seq_lens=seq_lens, block_tables=tables,
                slot_mapping=slots, query_start_loc_cpu=list(range(bucket + 1)), seq_lens_cpu=[1] * bucket,
                for_graph=True)
            lora = None
            if self.lora is not None:  # the LoRA update is always captured; base rows have slot -1
                from pagoda.lora.manager import LoRAMapping

                self.dev_tiles.zero_()  # no tiles: the capture runs no adapter
                lora = LoRAMapping(self.dev64[2 + self.num_groups, :bucket], True,
                                   self.dev64[3 + self.num_groups, :bucket],
                                   self.dev_tiles[:, :max_tiles(bucket, self.lora.max_loras)])
            ctx = prepared_context(meta, runner.backends, token_seq_lens=token_seq_lens, group_tables=groups,
                                   lora=lora)

            self.graphs[bucket] = capture_forward(runner, ctx, ids, positions, pool, logits=True)
            self.contexts[bucket] = ctx
            pool = pool if pool is not None else runner.platform.graph_pool()
        # the captures wrote zeros into the table: every row must be rewritten before use
        self.row_owner = [None] * self.max_bs
        self.np_tables[:] = 0
        logger.info("captured %d decode graphs (batch sizes up to %d)", len(self.graphs), self.max_bs)
