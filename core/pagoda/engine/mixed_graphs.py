"""Steps that mix prefill chunks with decodes, replayed from captured graphs.

A step in which requests join a running batch (their prompts' chunks beside every running sequence's next
token) would run the model eagerly: a dozen or more launches per layer from Python, milliseconds of host
time that a serving engine pays whenever requests arrive, while the decode-only steps around it replay a
graph (``pagoda.engine.graphs``). Where the attention backend can run such a batch over fixed capacities
(``AttentionBackend.supports_mixed_graphs``) these steps are padded to a bucket of tokens and replayed
too: padding tokens write to slot -1 (and count for no expert), padding sequences have no tokens, and the
number of decodes is read by the attention kernels on the device. The graph ends at the hidden states;
the LM head runs after it on the sampling rows only (a [capacity, vocab] logits buffer per bucket would
cost hundreds of MB with a large vocabulary). Steps over the largest bucket, and steps that need what a
graph cannot hold (prompt logprobs, images, speculative decoding, tensor parallelism), stay eager. LoRA
adapters are captured as in the decode graphs: each token's adapter slot (-1: the base, and padding), the
tokens sorted by it, and the kernels' tiles in static buffers.

Buffers, on the device with page-locked host mirrors copied once per step (the host waits for the
previous step's copies before it writes the mirrors again): int64 rows [input ids, positions, slots of
each KV cache group, (enable_lora) each token's adapter slot, the tokens sorted by it] x tokens; int32
[token seq lens x tokens | query_start_loc x (seqs + 1) | seq lens x seqs]; block tables [group, block index,
sequence] int32 (the graphs see each group's transpose; the block indices in use copied, one run per
group); the sampling rows (int64); (enable_lora) the LoRA tiles [3, max tiles].
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from pagoda.engine.graphs import capture_forward, timed
from pagoda.engine.inputs import step_arrays
from pagoda.engine.step_plan import StepPlan
from pagoda.errors import ConfigError
from pagoda.forward_context import AttentionMetadata, ForwardContext, prepared_context
from pagoda.lora.ops import max_tiles, token_tiles

logger = logging.getLogger("pagoda")

# token counts a mixed step is padded to, below the step token budget (which is the last); a step at most 1.5x
# smaller than its bucket
BUCKETS = (128, 256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
# Up to this many tokens a bucket is always replayed: an eager step that small is bound by the host's launches
# on every GPU measured (~30 ms for Qwen3-0.6B's 28 layers on an H200's host against 1-5 ms replayed). Above
# it the device's own time grows until the eager step is bound by it too, and a padded replay can lose: a
# larger bucket replays only the steps whose eager run would take longer than its replay, both timed at
# start-up (``least_tokens``), unless max_cudagraph_capture_size sets the sizes.
ALWAYS_REPLAYED = 1024


def bucket_list(limit: int) -> list[int]:
    """The buckets of steps up to ``limit`` tokens: BUCKETS below it, then ``limit``."""
    return [b for b in BUCKETS if b < limit] + [limit]


def least_tokens(buckets: list[int], eager: dict[int, float], replay: dict[int, float]) -> dict[int, int]:
    """The buckets worth keeping, each with the fewest tokens of a step it replays, from timings in seconds
    (``eager`` at the buckets from ALWAYS_REPLAYED up, ``replay`` above it). Every bucket up to
    ALWAYS_REPLAYED replays whatever it gets; a larger one the steps whose eager time, interpolated between
    the eager times of the bucket below and its own, exceeds its replay: all of them where its replay beats
    the eager step of the bucket below, none where it does not beat its own size run eagerly."""
    kept = {b: 0 for b in buckets if b <= ALWAYS_REPLAYED}
    for below, bucket in zip(buckets, buckets[1:]):
        if bucket <= ALWAYS_REPLAYED or below not in eager or bucket not in eager or bucket not in replay:
            continue
        low, high, cost = eager[below], eager[bucket], replay[bucket]
        if cost < low:
            kept[bucket] = 0
        elif cost < high:  # eager(T) > cost from T = below + (cost - low) / (high - low) x (bucket - below) on
            kept[bucket] = below + 1 + int((cost - low) / (high - low) * (bucket - below))
    return kept


def why_not_mixed(runner) -> str | None:
    """Why ``runner``'s mixed steps cannot be captured, or None."""
    from pagoda.distributed import get_tp_size

    if runner.config.cudagraph_mode == "FULL_DECODE_ONLY":
        return "cudagraph_mode is FULL_DECODE_ONLY"
    backends = list(runner.backends.values())
    if len(backends) != 1 or not backends[0].supports_mixed_graphs:
        return f"attention backend {', '.join(b.name for b in backends)} captures decode-only batches"
    if runner.multimodal is not None:
        return "images are per step"
    if runner.config.speculative_config:
        return "speculative decoding reads the steps' hidden states"
    if get_tp_size() > 1:
        return "tensor-parallel ranks capture decode-only batches"
    return None


class MixedGraphs:
    def __init__(self, runner, max_num_seqs: int, max_model_len: int, step_tokens: int):
        self.runner = runner
        explicit = runner.config.max_cudagraph_capture_size
        self.buckets = bucket_list(max(1, min(step_tokens, explicit or step_tokens)))
        self.timed = explicit is None  # buckets above ALWAYS_REPLAYED kept by their timings (least_tokens)
        self.least: dict[int, int] = {}  # captured bucket -> the fewest tokens of a step it replays (``capture``)
        # (tokens, sequences) of each bucket: a step holds at most as many sequences as tokens
        self.capacity = {b: (b, min(max_num_seqs, b)) for b in self.buckets}
        t, s = self.buckets[-1], min(max_num_seqs, self.buckets[-1])
        self.block_size = runner.config.block_size
        self.width = -(-max_model_len // self.block_size)
        self.max_model_len = max_model_len
        self.num_groups = g = runner.kv_layout.num_groups
        host, dev = runner.platform.host_buffer, runner.device
        self.lora = runner.lora
        self.host64 = host((2 + g + 2 * (self.lora is not None), t), torch.int64)
        # (enable_lora) the LoRA kernels' tiles (pagoda.lora.ops.token_tiles), padded per bucket
        self.tile_width = max_tiles(t, self.lora.max_loras) if self.lora is not None else 0
        self.host_tiles = host((3, self.tile_width), torch.int64)
        self.dev_tiles = torch.zeros(3, self.tile_width, dtype=torch.int64, device=dev)
        self.host32 = host((t + 2 * s + 1,), torch.int32)
        self.host_tables = host((g, self.width, s), torch.int32)  # [group, block index, sequence]
        self.host_sample = host((s,), torch.int64)
        self.dev64 = torch.zeros(self.host64.shape, dtype=torch.int64, device=dev)
        self.dev32 = torch.zeros(self.host32.shape, dtype=torch.int32, device=dev)
        self.dev_tables = torch.zeros(self.host_tables.shape, dtype=torch.int32, device=dev)
        self.dev_sample = torch.zeros(self.host_sample.shape, dtype=torch.int64, device=dev)
        self.np64, self.np32 = self.host64.numpy(), self.host32.numpy()
        self.np_tables, self.np_sample = self.host_tables.numpy(), self.host_sample.numpy()
        self.np_tiles = self.host_tiles.numpy()
        self.max_tokens, self.max_seqs = t, s
        self.graphs: dict[int, object] = {}
        self.contexts: dict[int, ForwardContext] = {}
        self.copied = None  # Platform.record_event() after the last step's uploads
        self.replays = 0  # steps run from these graphs (the engine's stats: mixed_steps_replayed)

    # int32 row layout: token seq lens [0, t) | query_start_loc [t, t + s + 1) | seq lens [t + s + 1, t + 2s + 1)
    def _int32_views(self, buf: np.ndarray | torch.Tensor):
        t, s = self.max_tokens, self.max_seqs
        return buf[:t], buf[t:t + s + 1], buf[t + s + 1:]

    def bucket_for(self, plan: StepPlan) -> int | None:
        n = len(plan.rows)
        if plan.num_decodes == n:  # (decode-only batches are pagoda.engine.graphs')
            return None
        tokens = sum(r.num_new_tokens for r in plan.rows)
        bucket = next((b for b in self.buckets if tokens <= b and n <= self.capacity[b][1]), None)
        return bucket if bucket is not None and tokens >= self.least[bucket] else None

    def can_run(self, plan: StepPlan) -> bool:
        """A batch with prefill chunks that fits a bucket and wants nothing a graph cannot give."""
        if self.bucket_for(plan) is None:
            return False
        return not any(r.wants_prompt_logprobs for r in plan.rows[plan.num_decodes:])

    # ------------------------------------------------------------------ per step
    def stage(self, plan: StepPlan) -> tuple[int, int]:
        """The host half: the step's inputs written and their uploads queued. Returns (bucket, sampling rows)."""
        bucket = self.bucket_for(plan)
        tokens, seqs = self.capacity[bucket]
        if self.copied is not None:  # the previous step's uploads must have left the host buffers
            self.copied.synchronize()
        a = step_arrays(plan, self.block_size, num_groups=self.num_groups)  # tables as wide as this step needs
        t, n, k = len(a.ids), len(plan.rows), len(a.sample_rows)
        w = min(a.tables[0].shape[1], self.width)
        h64 = self.np64
        h64[0, :t], h64[1, :t] = a.ids, a.positions
        h64[:2, t:tokens] = 0
        for g in range(self.num_groups):
            h64[2 + g, :t] = a.slots[g]
        h64[2:, t:tokens] = -1  # padding tokens store nothing (and count for no expert)
        if self.lora is not None:  # each token's adapter slot, the tokens sorted by it, their tiles
            lora_row = 2 + self.num_groups
            per_seq = self.lora.sequence_slots(plan)
            if per_seq is not None:
                counts = np.diff(a.query_start_loc)
                h64[lora_row, :t] = np.repeat(per_seq, counts)
            else:
                h64[lora_row, :t] = -1
            order = np.argsort(h64[lora_row, :tokens], kind="stable")  # (padding, slot -1, sorts first)
            h64[lora_row + 1, :tokens] = order
            width = max_tiles(tokens, self.lora.max_loras)
            self.np_tiles[:, :width] = token_tiles(h64[lora_row, :tokens][order], pad_to=width)
        token_seq_lens, qsl, seq_lens = self._int32_views(self.np32)
        token_seq_lens[:t], token_seq_lens[t:tokens] = a.token_seq_lens, 1
        qsl[:n + 1], qsl[n + 1:seqs + 1] = a.query_start_loc, t  # padding sequences: no tokens
        seq_lens[:n], seq_lens[n:seqs] = a.seq_lens, 0
        for g in range(self.num_groups):
            self.np_tables[g, :w, :n] = a.tables[g][:, :w].T  # (entries past a row's blocks are never read)
        self.np_sample[:k], self.np_sample[k:seqs] = a.sample_indices, 0
        self.dev64[:, :tokens].copy_(self.host64[:, :tokens], non_blocking=True)
        self.dev32.copy_(self.host32, non_blocking=True)
        self.dev_tables[:, :w].copy_(self.host_tables[:, :w], non_blocking=True)  # (contiguous per group)
        self.dev_sample[:k].copy_(self.host_sample[:k], non_blocking=True)
        if self.tile_width:
            self.dev_tiles.copy_(self.host_tiles, non_blocking=True)
        ctx = self.contexts[bucket]
        for backend in self.runner.backends.values():
            backend.fill_mixed_graph(ctx.attn_metadata.backend_data, a.query_start_loc, plan.num_decodes)
        self.copied = self.runner.platform.record_event()
        return bucket, k

    @property
    def input_ids(self) -> torch.Tensor:
        """The graphs' input ids on the device (a staged step's decode rows may be overwritten here before its
        replay, as ``DecodeGraphs.input_ids``)."""
        return self.dev64[0]

    def replay(self, staged: tuple[int, int]) -> torch.Tensor:
        """The device half: logits [sampling rows, vocab]."""
        bucket, k = staged
        graph = self.graphs[bucket]
        graph.replay()
        self.replays += 1
        ctx = self.contexts[bucket]
        if ctx.expert_counts:
            self.runner.add_expert_counts(ctx)
        return self.runner.model.compute_logits(graph.output.index_select(0, self.dev_sample[:k]))

    def run(self, plan: StepPlan) -> torch.Tensor:
        return self.replay(self.stage(plan))

    # ------------------------------------------------------------------ capture
    def _context(self, bucket: int) -> tuple[ForwardContext, torch.Tensor, torch.Tensor]:
        tokens, seqs = self.capacity[bucket]
        token_seq_lens, qsl, seq_lens = self._int32_views(self.dev32)
        tables = [self.dev_tables[g].t()[:seqs] for g in range(self.num_groups)]  # [seqs, width], strides (1, s)
        slots = [self.dev64[2 + g, :tokens] for g in range(self.num_groups)]
        meta = AttentionMetadata(
            num_tokens=tokens, num_seqs=seqs, num_decodes=0, max_query_len=tokens, max_seq_len=self.max_model_len,
            block_size=self.block_size, query_start_loc=qsl[:seqs + 1], seq_lens=seq_lens[:seqs],
            block_tables=tables[0], slot_mapping=slots[0], query_start_loc_cpu=[], seq_lens_cpu=[], for_graph=True,
            mixed_graph=True)
        lora = None
        if self.lora is not None:  # the LoRA update is always captured; base and padding tokens have slot -1
            from pagoda.lora.manager import LoRAMapping

            row = 2 + self.num_groups
            lora = LoRAMapping(self.dev64[row, :tokens], True, self.dev64[row + 1, :tokens],
                               self.dev_tiles[:, :max_tiles(tokens, self.lora.max_loras)])
        ctx = prepared_context(meta, self.runner.backends, token_seq_lens=token_seq_lens[:tokens],
                               group_tables=list(zip(tables[1:], slots[1:])), lora=lora)
        return ctx, self.dev64[0, :tokens], self.dev64[1, :tokens]

    def capture(self) -> None:
        runner = self.runner
        pool = runner.platform.graph_pool()
        self.dev32.zero_()  # every sequence empty, no decode: the captures' attention reads nothing
        self.dev64[2:].fill_(-1)
        if self.lora is not None:  # no tiles (the capture runs no adapter); the order a permutation
            self.dev_tiles.zero_()
            self.dev64[3 + self.num_groups].copy_(torch.arange(self.max_tokens))
        eager: dict[int, float] = {}
        for bucket in reversed(self.buckets):  # largest first, so smaller ones reuse its memory
            ctx, ids, positions = self._context(bucket)
            seconds = [] if self.timed and bucket >= ALWAYS_REPLAYED else None
            try:
                self.graphs[bucket] = capture_forward(runner, ctx, ids, positions, pool, logits=False,
                                                      eager_seconds=seconds)
            except torch.OutOfMemoryError as exc:
                if not self.timed:
                    raise ConfigError(f"capturing the graph of {bucket}-token steps ran out of device memory: lower "
                                      f"max_cudagraph_capture_size or memory_utilization ({exc})") from exc
                if bucket <= ALWAYS_REPLAYED:
                    raise
                # a bucket of the default sizes above ALWAYS_REPLAYED is an optimisation: go without it
                logger.warning("steps with prefill chunks of up to %d tokens are not captured: out of device "
                               "memory outside memory_utilization (%s)", bucket, exc)
                continue
            self.contexts[bucket] = ctx
            if seconds:
                eager[bucket] = seconds[0]
            pool = pool if pool is not None else runner.platform.graph_pool()
        captured = [b for b in self.buckets if b in self.graphs]
        self.least = {b: 0 for b in captured}
        if self.timed and captured[-1] > ALWAYS_REPLAYED:
            self.least = self._timed_least(captured, eager)
        for bucket in set(captured) - set(self.least):
            del self.graphs[bucket], self.contexts[bucket]
        self.buckets = list(self.least)
        logger.info("captured %d graphs of steps that mix prefill chunks in (up to %d tokens)", len(self.graphs),
                    self.buckets[-1])

    def _timed_least(self, buckets: list[int], eager: dict[int, float]) -> dict[int, int]:
        """``least_tokens`` of ``buckets`` from the eager timings and their replays' (timed on the captures'
        dummy batches: every sequence empty, so both timings leave attention's reads out)."""
        platform = self.runner.platform
        with torch.inference_mode():
            replay = {b: min(timed(platform, self.graphs[b].replay) for _ in range(3))
                      for b in buckets if b > ALWAYS_REPLAYED}
        least = least_tokens(buckets, eager, replay)
        logger.info("steps with prefill chunks over %d tokens replay the buckets %s, other steps run eagerly "
                    "(timed: eager %s, replayed %s ms)", ALWAYS_REPLAYED,
                    ", ".join(f"{b} ({f'from {n} tokens' if n else 'every step'})" for b, n in least.items()
                              if b > ALWAYS_REPLAYED) or "none",
                    {b: round(1e3 * t, 2) for b, t in eager.items()}, {b: round(1e3 * t, 2) for b, t in replay.items()})
        return least
