"""Decode steps replayed from captured graphs.

Decode-only batches are padded to the next size bucket and run from one graph per bucket
over static input buffers. Padding rows write nowhere (slot -1) and read one cached token.
Each step's integer inputs travel in two host→device copies.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from pagoda.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from pagoda.scheduler import SchedulerOutput

logger = logging.getLogger("pagoda")


def bucket_sizes(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_bs]
    sizes += list(range(16, max_bs, 16))
    return sorted(set(sizes + [max_bs]))


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int, max_model_len: int):
        self.runner = runner
        self.max_bs = min(max_num_seqs, 512)
        self.block_size = runner.config.block_size
        self.width = -(-max_model_len // self.block_size)
        self.max_model_len = max_model_len
        self.buckets = bucket_sizes(self.max_bs)
        dev = runner.device
        b, w = self.max_bs, self.width
        # int64 rows: input ids, positions, slots; int32 rows: seq lens, token seq lens, tables
        self.host64 = torch.zeros(3, b, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self.host32 = torch.zeros(2 * b + b * w, dtype=torch.int32, pin_memory=dev.type == "cuda")
        self.dev64 = torch.zeros(3, b, dtype=torch.int64, device=dev)
        self.dev32 = torch.zeros(2 * b + b * w, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, object] = {}
        self.contexts: dict[int, ForwardContext] = {}
        self.np64 = self.host64.numpy()
        self.np32 = self.host32.numpy()

    def _views(self, bucket: int):
        b, w = self.max_bs, self.width
        ids, positions, slots = self.dev64[0, :bucket], self.dev64[1, :bucket], self.dev64[2, :bucket]
        seq_lens = self.dev32[:bucket]
        token_seq_lens = self.dev32[b:b + bucket]
        tables = self.dev32[2 * b:].view(b, w)[:bucket]
        return ids, positions, slots, seq_lens, token_seq_lens, tables

    def can_run(self, out: SchedulerOutput) -> bool:
        n = len(out.scheduled)
        return 0 < n <= self.max_bs and out.num_decodes == n

    def _fill(self, out: SchedulerOutput, bucket: int) -> None:
        n, b, w = len(out.scheduled), self.max_bs, self.width
        h64, h32 = self.np64, self.np32
        seqs = [it.seq for it in out.scheduled]
        h64[0, :n] = [s.token_ids[-1] for s in seqs]
        pos = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, n)
        h64[1, :n] = pos
        tables = h32[2 * b:].reshape(b, w)
        tables[:bucket] = 0
        for i, s in enumerate(seqs):
            bt = s.block_table
            k = min(len(bt), w)
            tables[i, :k] = bt[:k]
        h64[2, :n] = tables[np.arange(n), pos // self.block_size].astype(np.int64) * self.block_size \
            + pos % self.block_size
        h64[:, n:bucket] = 0
        h64[2, n:bucket] = -1
        h32[:n] = pos + 1
        h32[n:bucket] = 1
        h32[b:b + n] = pos + 1
        h32[b + n:b + bucket] = 1

    def run(self, out: SchedulerOutput) -> torch.Tensor:
        n = len(out.scheduled)
        bucket = next(s for s in self.buckets if s >= n)
        self._fill(out, bucket)
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32.copy_(self.host32, non_blocking=True)
        graph = self.graphs[bucket]
        graph.replay()
        self.runner._accumulate_experts(self.contexts[bucket])
        return graph.output[:n]

    def capture(self) -> None:
        runner = self.runner
        pool = runner.platform.graph_pool()
        for bucket in reversed(self.buckets):  # largest first, so smaller ones reuse its memory
            ids, positions, slots, seq_lens, token_seq_lens, tables = self._views(bucket)
            self.dev32.zero_()
            seq_lens.fill_(1)
            token_seq_lens.fill_(1)
            slots.fill_(-1)
            meta = AttentionMetadata(
                num_tokens=bucket, num_seqs=bucket, num_decodes=bucket, max_query_len=1,
                max_seq_len=self.max_model_len, block_size=self.block_size,
                query_start_loc=self.query_start_loc[:bucket + 1], seq_lens=seq_lens, block_tables=tables,
                slot_mapping=slots, query_start_loc_cpu=list(range(bucket + 1)), seq_lens_cpu=[1] * bucket,
                for_graph=True)
            for backend in runner.backends.values():
                meta.backend_data = backend.prepare(meta)
            ctx = ForwardContext(attn_metadata=meta, backends=runner.backends, token_seq_lens=token_seq_lens)

            def step(ids=ids, positions=positions, ctx=ctx):
                with set_forward_context(ctx):
                    ctx.expert_counts.clear()
                    hidden = runner.model(ids, positions)
                    return runner.model.compute_logits(hidden)

            with torch.inference_mode():
                step()
                step()
                self.graphs[bucket] = runner.platform.capture_graph(step, pool)
            self.contexts[bucket] = ctx
            pool = pool if pool is not None else runner.platform.graph_pool()
        logger.info("captured %d decode graphs (batch sizes up to %d)", len(self.graphs), self.max_bs)
