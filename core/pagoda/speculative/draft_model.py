"""Method "draft_model": a smaller model with the target's tokenizer drafts the tokens.

The draft runs in its own ModelRunner with its own paged KV cache and block manager (no prefix
cache). Each sequence that speculates has a shadow sequence in the draft: at every step it is
rewound to the tokens the target kept (the KV of rejected drafts is recomputed over), catches up
on what it has not computed (the whole prompt the first time), then decodes k tokens, one batched
draft step per token. Greedy requests draft the draft's argmax; sampled requests draw from the
draft's distribution after the request's own processing, temperature, top-k, top-p and min-p, and
that distribution q goes to rejection sampling. The two caches share the KV memory budget: each
holds the same number of blocks, sized so that both fit in what the target alone would take. The
draft's decode steps replay its own captured decode graphs where the platform has them.
"""

from __future__ import annotations

import logging

import torch

from pagoda.engine.block_manager import BlockManager
from pagoda.engine.sampling_batch import sampling_rows
from pagoda.engine.scheduler import ScheduledSeq, SchedulerOutput
from pagoda.engine.sequence import Sequence, SequenceStatus
from pagoda.engine.step_plan import plan_step
from pagoda.errors import ConfigError
from pagoda.forward_context import set_forward_context
from pagoda.logits_processors import process_row
from pagoda.speculative.acceptance import sampling_probs
from pagoda.speculative.config import SpeculativeConfig

logger = logging.getLogger("pagoda")
DRAFT_SEED_OFFSET = 1_000_003  # a seeded request's draft draws come from their own stream


class DraftModelProposer:
    def __init__(self, engine, spec: SpeculativeConfig):
        from pagoda.engine.model_runner import ModelRunner
        from pagoda.loader.model_loader import load_config
        from pagoda.loader.source import resolve_source

        config = engine.config
        try:
            self.source = resolve_source(spec.model, spec.revision, config.download_dir)
            hf_config = load_config(self.source)
        except ConfigError as exc:
            raise ConfigError(f"speculative_config.model {spec.model!r}: {exc}") from None
        vocab, target_vocab = getattr(hf_config, "vocab_size", None), engine.hf_config.vocab_size
        if vocab != target_vocab:
            raise ConfigError(f"speculative_config.model {spec.model!r}: its vocab_size {vocab} differs from the "
                              f"target's {target_vocab}; a draft model must share the target's tokenizer")
        longest = getattr(hf_config, "max_position_embeddings", None)
        if longest is not None and longest < engine.max_model_len:
            raise ConfigError(f"speculative_config.model {spec.model!r}: max_position_embeddings {longest} is "
                              f"below max_model_len {engine.max_model_len}; lower max_model_len")
        draft_config = config.model_copy(update=dict(
            model=spec.model, revision=spec.revision, quantization=spec.quantization, speculative_config=None,
            tensor_parallel_size=1, expert_placement=None, enable_expert_parallel=False))
        runner = engine.runner
        self.max_num_seqs, self.max_model_len = config.max_num_seqs, engine.max_model_len
        self.runner = ModelRunner(draft_config, self.source, hf_config, engine.platform, runner.dtype_name,
                                  runner.device)
        self.block_manager: BlockManager | None = None
        self.shadows: dict[int, tuple[Sequence, Sequence, int]] = {}  # seq_id -> (seq, shadow, kept length)
        self.generator = torch.Generator(device=runner.device).manual_seed(config.seed + DRAFT_SEED_OFFSET)
        self._generators: dict[int, torch.Generator] = {}
        logger.info("speculative decoding: draft model %s loaded in %.1f s", self.source.name,
                    self.runner.load_seconds)

    def share_kv_budget(self, target_runner) -> int:
        """Allocate the draft's cache; return the blocks the target takes (both hold as many)."""
        total = target_runner.available_kv_blocks()
        if target_runner.config.num_kv_blocks:  # an explicit size: both caches hold that many blocks
            blocks = total
        else:
            t, d = target_runner.bytes_per_block(), self.runner.bytes_per_block()
            blocks = max(1, total * t // (t + d))
        self.runner.allocate_kv_cache(blocks)
        self.block_manager = BlockManager(blocks, target_runner.config.block_size, False,
                                          self.runner.kv_layout.windows)
        self.runner.capture_graphs(self.max_num_seqs, self.max_model_len)  # the draft's decode steps
        return blocks

    # ------------------------------------------------------------------ shadows
    def forget(self, seq_id: int) -> None:
        entry = self.shadows.pop(seq_id, None)
        self._generators.pop(seq_id, None)
        if entry is not None:
            self.block_manager.free(entry[1])

    def _collect(self) -> None:
        """Free the shadows of sequences that finished or were preempted."""
        for seq_id, (seq, _, _) in list(self.shadows.items()):
            if seq.status is not SequenceStatus.RUNNING:
                self.forget(seq_id)

    def _synced_shadow(self, seq: Sequence) -> Sequence:
        """The sequence's shadow, its tokens the target's and its computed count rewound to the
        longest prefix it shares with them."""
        entry = self.shadows.get(seq.seq_id)
        if entry is None:
            shadow = Sequence(seq.request_id, seq.index, seq.prompt_token_ids, seq.params)
            shadow.status = SequenceStatus.RUNNING
            common = 0
        else:
            _, shadow, kept = entry
            old, new = shadow.token_ids, seq.token_ids
            common = kept  # the target's tokens then are a prefix of its tokens now
            while common < min(len(old), len(new)) and old[common] == new[common]:
                common += 1
        shadow.token_ids = list(seq.token_ids)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, common, len(shadow.token_ids) - 1)
        self.shadows[seq.seq_id] = (seq, shadow, len(seq.token_ids))
        return shadow

    def _draw_generator(self, seq: Sequence) -> torch.Generator:
        if seq.seed is None:
            return self.generator
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.runner.device).manual_seed(seq.seed + DRAFT_SEED_OFFSET)
            self._generators[seq.seq_id] = gen
        return gen

    # ------------------------------------------------------------------ drafting
    def propose(self, seqs: list[Sequence], ks: list[int], engine) -> tuple[dict[int, list[int]], dict]:
        """Up to ks[i] tokens for each of ``seqs``; and q [len(draft), V] of the sampled requests."""
        self._collect()
        active = [(seq, self._synced_shadow(seq), k) for seq, k in zip(seqs, ks)]
        drafts: dict[int, list[int]] = {seq.seq_id: [] for seq in seqs}
        qs: dict[int, list[torch.Tensor]] = {}
        sampler = engine.runner.sampler
        for _ in range(max(ks)):
            items = []
            for seq, shadow, k in active:
                if len(drafts[seq.seq_id]) >= k:
                    continue
                num_new = shadow.num_tokens - shadow.num_computed_tokens
                if not self.block_manager.allocate_slots(shadow, num_new):  # the draft's cache is full
                    self.forget(seq.seq_id)
                    continue
                items.append((seq, ScheduledSeq(shadow, num_new, True)))
            active = [a for a in active if a[0].seq_id in self.shadows]
            if not items:
                break
            items.sort(key=lambda x: x[1].num_new_tokens != 1)  # decodes first
            out = SchedulerOutput([it for _, it in items], sum(it.num_new_tokens == 1 for _, it in items))
            logits = self._forward(out)
            for row, (seq, it) in enumerate(items):
                shadow, mine = it.seq, drafts[seq.seq_id]
                token, q = self._pick(logits[row], seq, mine, sampler)
                shadow.num_computed_tokens += it.num_new_tokens
                shadow.token_ids.append(token)
                mine.append(token)
                if q is not None:
                    qs.setdefault(seq.seq_id, []).append(q)
        return ({sid: d for sid, d in drafts.items() if d},
                {sid: torch.stack(rows) for sid, rows in qs.items()})

    def _pick(self, logits: torch.Tensor, seq: Sequence, drafted: list[int], sampler):
        """(the draft token, the draft distribution it was drawn from or None for greedy requests)."""
        params = seq.params
        if params.argmax_only:
            return int(logits.argmax()), None
        row = logits.float().clone()
        if params.needs_processing:
            process_row(row, sampling_rows([seq])[0].as_if_generated(drafted), sampler.stop_token_ids,
                        sampler.processors)
        if params.greedy:
            return int(row.argmax()), None
        probs = sampling_probs(row[None], params)[0]
        if not bool(torch.isfinite(probs).all()):  # (the decoder logs it and drafts nothing for the sequence)
            finite = row[torch.isfinite(row)]
            raise FloatingPointError(
                f"request {seq.request_id}: the drafter's distribution is not finite (logits: "
                f"{int(torch.isnan(row).sum())} NaN, {int(torch.isinf(row).sum())} infinite of {row.numel()}, "
                f"finite range [{float(finite.min()) if finite.numel() else 0:.3g}, "
                f"{float(finite.max()) if finite.numel() else 0:.3g}])")
        token = int(torch.multinomial(probs, 1, generator=self._draw_generator(seq)).item())
        return token, probs

    @torch.inference_mode()
    def _forward(self, out: SchedulerOutput) -> torch.Tensor:
        """The draft's logits [n, V] at the last scheduled token of each sequence of ``out``."""
        runner = self.runner
        plan = plan_step(out)
        if runner.graphs is not None and runner.graphs.can_run(plan):
            return runner.graphs.run(plan)
        inputs = runner.step_inputs(plan)
        with set_forward_context(runner.forward_context(inputs)):
            hidden = runner.model(inputs.input_ids, inputs.positions)
            return runner.model.compute_logits(hidden.index_select(0, inputs.sample_indices))
