"""Method "mtp": the checkpoint's multi-token-prediction layer drafts (DeepSeek-V3).

The target's model class names the architecture of its MTP layer (``mtp_architecture``, e.g.
pagoda-models' ``DeepSeekMTPModel``); it is built from the same checkpoint, in its own ModelRunner
with its own paged KV cache and block manager (its one attention layer), as a draft model is.

The layer at position p reads the token x_{p+1} and the target's hidden state h_p, so it runs after
each target step, over the positions the target computed and kept in that step (the shadow sequence
holds the tokens shifted by one), then drafts: its last row predicts the token after the sequence's
last one, and k > 1 drafts chain the layer on its own output hidden state. The drafts wait for the
next step's verification. With this method every step runs through the speculative decoder, eagerly
(the target's hidden states are needed); a sequence whose earlier positions were not computed by
the target in this engine (a prefix-cache hit) does not speculate.
"""

from __future__ import annotations

import copy
import logging

import torch

from pagoda.engine.scheduler import ScheduledSeq, SchedulerOutput
from pagoda.engine.sequence import Sequence, SequenceStatus
from pagoda.engine.step_plan import plan_step
from pagoda.errors import ConfigError
from pagoda.forward_context import set_forward_context
from pagoda.speculative.config import SpeculativeConfig
from pagoda.speculative.draft_model import DRAFT_SEED_OFFSET, DraftModelProposer

logger = logging.getLogger("pagoda")


class MTPProposer(DraftModelProposer):
    def __init__(self, engine, spec: SpeculativeConfig):  # (DraftModelProposer's loading is not used)
        from pagoda.engine.model_runner import ModelRunner

        model_cls = type(engine.runner.model)
        arch = getattr(model_cls, "mtp_architecture", None)
        layers = getattr(engine.hf_config, "num_nextn_predict_layers", 0) or 0
        if arch is None or not layers:
            why = ("its config.json has no num_nextn_predict_layers" if arch is not None else
                   f"pagoda has no MTP layer for {model_cls.__name__}")
            raise ConfigError(f"speculative_config: method 'mtp' needs a model with multi-token-prediction "
                              f"layers (DeepSeek-V3); {why}")
        hf_config = copy.deepcopy(engine.hf_config)
        hf_config.architectures = [arch]
        runner = engine.runner
        config = engine.config.model_copy(update=dict(speculative_config=None, tensor_parallel_size=1,
                                                      enforce_eager=True, model_impl="pagoda"))
        self.k = spec.num_speculative_tokens
        self.max_num_seqs, self.max_model_len = engine.config.max_num_seqs, engine.max_model_len
        self.runner = ModelRunner(config, engine.source, hf_config, engine.platform, runner.dtype_name, runner.device)
        self.block_manager = None
        self.shadows: dict[int, tuple[Sequence, Sequence, int]] = {}  # seq_id -> (seq, shadow, preemptions)
        self.pending: dict[int, tuple[int, list[int], list]] = {}  # seq_id -> (its length then, drafts, q rows)
        self.generator = torch.Generator(device=runner.device).manual_seed(engine.config.seed + DRAFT_SEED_OFFSET)
        self._generators: dict[int, torch.Generator] = {}
        logger.info("speculative decoding: MTP layer %s loaded in %.1f s", arch, self.runner.load_seconds)

    def forget(self, seq_id: int) -> None:
        self.pending.pop(seq_id, None)
        super().forget(seq_id)

    def propose(self, seqs: list[Sequence], ks: list[int], engine) -> tuple[dict[int, list[int]], dict]:
        """The drafts made after the previous step, for sequences that have not changed since."""
        drafts, qs = {}, {}
        for seq, k in zip(seqs, ks):
            length, d, q = self.pending.pop(seq.seq_id, (None, None, None))
            if length == seq.num_tokens and d:
                drafts[seq.seq_id] = d[:k]
                if q:
                    qs[seq.seq_id] = torch.stack(q[:k])
        return drafts, qs

    # ------------------------------------------------------------------ after a target step
    def after_step(self, vout: SchedulerOutput, hidden: torch.Tensor, qsl: list[int], engine, may_speculate) -> None:
        """Run the MTP layer over the positions the target computed and kept in ``vout`` (hidden [T, H]:
        the target's output rows, ``qsl``: each item's first row), then draft for the decoding sequences."""
        self._collect()
        work = []  # (seq, shadow, rows of hidden)
        for i, it in enumerate(vout.scheduled):
            seq = it.seq
            if seq.status is not SequenceStatus.RUNNING or not may_speculate(seq):
                self.forget(seq.seq_id)
                continue
            start = seq.num_computed_tokens - it.num_new_tokens  # computed when the step began
            shadow = self._shadow_at(seq, start)
            if shadow is None:
                continue
            shadow.token_ids = seq.token_ids[1:seq.num_computed_tokens + 1]  # shadow position p holds x_{p+1}
            work.append((seq, shadow, list(range(qsl[i], qsl[i] + it.num_new_tokens))))
        if not work:
            return
        bm = self.block_manager
        items, rows, seqs = [], [], []
        for seq, shadow, r in work:
            if not bm.allocate_slots(shadow, len(r)):
                self.forget(seq.seq_id)
                continue
            items.append(ScheduledSeq(shadow, len(r), True))
            rows.append(r)
            seqs.append(seq)
        order = sorted(range(len(items)), key=lambda j: items[j].num_new_tokens != 1)  # decodes first
        items, rows, seqs = [items[j] for j in order], [rows[j] for j in order], [seqs[j] for j in order]
        flat = torch.tensor([x for r in rows for x in r], dtype=torch.long, device=hidden.device)
        out_hidden, logits = self._forward_mtp(SchedulerOutput(items, sum(it.num_new_tokens == 1 for it in items)),
                                               hidden.index_select(0, flat))
        drafting = []
        for j, (seq, it) in enumerate(zip(seqs, items)):
            it.seq.num_computed_tokens += it.num_new_tokens
            if seq.num_computed_tokens == seq.num_tokens - 1:  # decoding: draft
                drafting.append((seq, it.seq, j))
        self._draft_chain(drafting, out_hidden, logits, engine)

    def _shadow_at(self, seq: Sequence, start: int) -> Sequence | None:
        """The sequence's shadow with ``start`` positions computed, or None when it lacks some (a
        prefix-cache hit, a shadow dropped for lack of blocks): that sequence does not speculate."""
        entry = self.shadows.get(seq.seq_id)
        if entry is not None and entry[2] != seq.num_preemptions:  # recomputed from the start
            self.forget(seq.seq_id)
            entry = None
        if entry is None:
            if start != 0:
                return None
            shadow = Sequence(seq.request_id, seq.index, seq.prompt_token_ids[1:] or [0], seq.params)
            shadow.status = SequenceStatus.RUNNING
            self.shadows[seq.seq_id] = (seq, shadow, seq.num_preemptions)
            return shadow
        shadow = entry[1]
        if shadow.num_computed_tokens < start:
            self.forget(seq.seq_id)
            return None
        shadow.num_computed_tokens = start  # drafted positions are computed again with the kept tokens
        return shadow

    def _draft_chain(self, drafting, out_hidden: torch.Tensor, logits: torch.Tensor, engine) -> None:
        sampler = engine.runner.sampler
        made = {seq.seq_id: ([], []) for seq, _, _ in drafting}
        active = [(seq, shadow) for seq, shadow, _ in drafting]
        rows = [j for _, _, j in drafting]
        prev, step_logits = out_hidden[rows] if rows else None, logits[rows] if rows else None
        for step in range(self.k):
            if not active:
                break
            next_active, next_rows = [], []
            for n, (seq, shadow) in enumerate(active):
                d, q = made[seq.seq_id]
                token, probs = self._pick(step_logits[n], seq, d, sampler)
                d.append(token)
                if probs is not None:
                    q.append(probs)
                if step + 1 < self.k and self.block_manager.allocate_slots(shadow, 1):
                    shadow.token_ids.append(token)
                    next_active.append((seq, shadow))
                    next_rows.append(n)
            active = next_active
            if not active or step + 1 == self.k:
                break
            items = [ScheduledSeq(shadow, 1, True) for _, shadow in active]
            prev, step_logits = self._forward_mtp(SchedulerOutput(items, len(items)), prev[next_rows])
            for _, shadow in active:
                shadow.num_computed_tokens += 1
        for seq, _, _ in drafting:
            d, q = made[seq.seq_id]
            self.pending[seq.seq_id] = (seq.num_tokens, d, q)

    @torch.inference_mode()
    def _forward_mtp(self, out: SchedulerOutput, previous_hidden: torch.Tensor):
        """(output hidden, logits) at the last scheduled token of each shadow of ``out``."""
        runner = self.runner
        inputs = runner.step_inputs(plan_step(out))
        runner.model.previous_hidden = previous_hidden
        try:
            with set_forward_context(runner.forward_context(inputs)):
                hidden = runner.model(inputs.input_ids, inputs.positions).index_select(0, inputs.sample_indices)
                return hidden, runner.model.compute_logits(hidden)
        finally:
            runner.model.previous_hidden = None
