"""One engine step with speculative decoding.

After the scheduler picked the step, every decoding sequence that may speculate (no logprobs, no
grammar) gets up to ``num_speculative_tokens`` drafted tokens from the proposer. Their KV slots are
allocated, and the target computes the sequence's last token plus the drafts in one forward pass,
as a chunk against the paged cache (the prefill attention path). Logits of every computed position
are kept; ``pagoda.speculative.acceptance`` decides which drafts stay. The scheduler then commits
the kept drafts and the target's token as if they had been decoded one by one (computed counts,
prefix-cache hashes over kept tokens only), stops (EOS, stop tokens, max_tokens, stop strings) cut
inside the kept tokens, and the blocks holding only rejected slots are given back.

A step in which nothing was drafted runs as a plain step (CUDA graphs included). Sequences that
do not speculate (prefills, requests with logprobs or a grammar) share the step and are sampled
as usual.
"""

from __future__ import annotations

import logging

import torch

from pagoda.engine.detokenizer import PREFIX_WINDOW
from pagoda.engine.sampling_batch import sampling_rows
from pagoda.engine.scheduler import ScheduledSeq, SchedulerOutput
from pagoda.engine.sequence import Sequence, SequenceStatus
from pagoda.engine.step_plan import plan_step
from pagoda.errors import ConfigError
from pagoda.forward_context import set_forward_context
from pagoda.speculative.acceptance import accept_greedy, accept_sampled, processed_rows, sampling_probs
from pagoda.speculative.config import SpeculativeConfig, parse_speculative_config
from pagoda.speculative.stats import SpeculativeStats
from pagoda.speculative.verify_rows import forward_as_decodes

logger = logging.getLogger("pagoda")


def create_speculative_decoder(engine) -> SpeculativeDecoder | None:
    """The engine's decoder for its ``speculative_config`` (None when unset). Call before the
    target's KV cache is allocated: a draft model's weights and cache share the memory budget."""
    spec = parse_speculative_config(engine.config.speculative_config)
    if spec is None:
        return None
    from pagoda.engine.model_runner import ModelRunner

    if not isinstance(engine.runner, ModelRunner):
        raise ConfigError("speculative_config: speculative decoding runs on one device; set "
                          "tensor_parallel_size to 1 (or drop speculative_config)")
    return SpeculativeDecoder(engine, spec)


class SpeculativeDecoder:
    def __init__(self, engine, spec: SpeculativeConfig):
        self.engine = engine
        self.spec = spec
        self.k = spec.num_speculative_tokens
        if spec.method == "ngram":
            from pagoda.speculative.ngram import NgramProposer

            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        elif spec.method == "mtp":
            from pagoda.speculative.mtp import MTPProposer

            self.proposer = MTPProposer(engine, spec)
        elif spec.method == "eagle3":
            from pagoda.speculative.eagle3 import Eagle3Proposer

            self.proposer = Eagle3Proposer(engine, spec)
        else:
            from pagoda.speculative.draft_model import DraftModelProposer

            self.proposer = DraftModelProposer(engine, spec)
        self.stats = SpeculativeStats(self.k)
        # decode-only verifications as decode batches: None replays the target's decode graphs where they
        # fit the rows, else verifies as chunks on the prefill path; True also runs decode rows eagerly
        # (tests); False always chunks
        self.verify_as_decodes: bool | None = None
        self.verified_as_decodes = self.verified_as_chunks = 0  # verification steps of each form
        self.drafter_failures = 0  # steps whose drafting raised (logged; those sequences went on plainly)
        # a proposer that reads the target's hidden states after each step (mtp) sees every step
        self.after_step = getattr(self.proposer, "after_step", None)
        if self.after_step is not None:
            self.verify_as_decodes = False
        logger.info("speculative decoding: %s, %d tokens per step", spec.method, self.k)

    def graph_batch_size(self, max_num_seqs: int) -> int:
        """Decode graphs hold every row of a full verification batch (1 + k rows per sequence)."""
        return max_num_seqs * (1 + self.k)

    def target_kv_blocks(self) -> int | None:
        """KV blocks the target allocates (None: all that fit); a draft model takes its share first."""
        share = getattr(self.proposer, "share_kv_budget", None)
        return share(self.engine.runner) if share is not None else None

    @staticmethod
    def may_speculate(seq: Sequence) -> bool:
        p = seq.params
        return (p.logprobs is None and p.structured_outputs is None and seq.grammar is None
                and seq.pending_grammar is None and seq.grammar_opening is None)

    # ------------------------------------------------------------------ the step
    def step(self, out: SchedulerOutput, finished_only: bool, t0: float, t1: float):
        """Run ``out`` with verification; None when nothing was drafted (the engine runs it plainly)."""
        drafts, q = self._draft(out)
        if not drafts and self.after_step is None:
            return None
        engine = self.engine
        nd = out.num_decodes
        plain = [it for it in out.scheduled[:nd] if it.seq.seq_id not in drafts]
        spec = [ScheduledSeq(it.seq, 1 + len(drafts[it.seq.seq_id]), True) for it in out.scheduled[:nd]
                if it.seq.seq_id in drafts]
        vout = SchedulerOutput(plain + spec + out.scheduled[nd:], len(plain),
                               out.num_batched_tokens + sum(map(len, drafts.values())), out.preempted)
        found = None
        if self.verify_as_decodes is not False and not out.scheduled[nd:]:  # decode-only: graphs where they fit
            found = forward_as_decodes(engine.runner, vout, drafts, eager=bool(self.verify_as_decodes))
        if found is not None:
            (logits, rows), prompt = found, {}
            self.verified_as_decodes += 1
        else:
            logits, rows, prompt, hidden, qsl = self._forward(vout, drafts)
            self.verified_as_chunks += bool(drafts)
        for it in spec:  # the drafts leave token_ids: what is kept is appended below
            del it.seq.token_ids[-len(drafts[it.seq.seq_id]):]

        sample_items = [it for it in vout.scheduled if it.sample]
        plain_pos = [j for j, it in enumerate(sample_items) if it.seq.seq_id not in drafts]
        tokens: list[int] = [0] * len(sample_items)
        logprobs: list = [None] * len(sample_items)
        failed: dict[int, BaseException] = {}
        if plain_pos:
            picked = torch.tensor([rows[j][-1] for j in plain_pos], device=logits.device)
            result = engine.runner.sampler(logits.index_select(0, picked),
                                           sampling_rows([sample_items[j].seq for j in plain_pos]))
            for n, j in enumerate(plain_pos):
                tokens[j], logprobs[j] = result.tokens[n], result.logprobs[n]
            failed.update({plain_pos[n]: exc for n, exc in result.failed.items()})
        kept_drafts: dict[int, int] = {}
        for j, it in enumerate(sample_items):
            seq = it.seq
            if seq.seq_id not in drafts:
                continue
            d = drafts[seq.seq_id]
            try:
                accepted, kept = self._accept(seq, logits[rows[j][0]:rows[j][-1] + 1], d, q.get(seq.seq_id))
            except Exception as exc:  # this request fails, the step goes on
                failed[j] = exc
                it.num_new_tokens = 1
                continue
            self.stats.record(len(d), kept)
            accepted = self._cut_at_stop(seq, accepted)
            for token in accepted[:-1]:
                seq.append_token(token)
            it.num_new_tokens = len(accepted)  # the last known token and the kept drafts are computed
            tokens[j] = accepted[-1]
            kept_drafts[seq.seq_id] = len(accepted) - 1
        if prompt:
            engine.controls.record_prompt_logprobs(engine.requests, {it.seq.seq_id: it.seq for it in vout.scheduled},
                                                   prompt)
        outputs = engine.completion.complete(vout, tokens, logprobs, finished_only, t0, t1, failed=failed)
        engine.scheduler.stats.num_generated_tokens += sum(kept_drafts.values())
        bm = engine.block_manager
        for it in spec:
            if it.seq.status is SequenceStatus.RUNNING:
                bm.trim_slots(it.seq, it.seq.num_tokens)  # blocks that held only rejected drafts
        if self.after_step is not None:
            try:
                self.after_step(vout, hidden, qsl, engine, self.may_speculate)
            except Exception as exc:
                self._drafter_failed(exc, [it.seq for it in vout.scheduled])
        return outputs

    def _drafter_failed(self, exc: BaseException, seqs: list[Sequence]) -> None:
        """A drafter that fails costs speed, never requests: the verification keeps outputs exact
        whatever is drafted, so the sequences it was drafting for go on without this step's drafts and the
        error is logged. The proposer forgets them: a draft model reads them again from the start, an
        MTP layer or EAGLE-3 head (whose state follows the target's steps) does not draft for them again."""
        self.drafter_failures += 1
        log = logger.error if self.drafter_failures == 1 else logger.debug
        log("speculative decoding: the %s drafter failed (%s: %s); %d sequences go on without drafts",
            self.spec.method, type(exc).__name__, exc, len(seqs), exc_info=exc)
        for seq in seqs:
            self.proposer.forget(seq.seq_id)

    def _draft(self, out: SchedulerOutput) -> tuple[dict[int, list[int]], dict]:
        """Drafted tokens by seq_id, appended to each sequence's token_ids with their KV slots
        allocated; and the draft distributions q of sampled requests (seq_id -> [k, V])."""
        engine = self.engine
        sched, bm = engine.scheduler, engine.block_manager
        room = sched.max_num_batched_tokens - out.num_batched_tokens
        seqs, ks = [], []
        for it in out.scheduled[:out.num_decodes]:
            seq = it.seq
            if not self.may_speculate(seq):
                continue
            # every kept token must fit max_model_len and max_tokens, with the target's token after them
            k = min(self.k, room, engine.max_model_len - seq.num_tokens - 1)
            if seq.params.max_tokens is not None:
                k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
                room -= k
        if not seqs:
            return {}, {}
        try:
            proposed, q = self.proposer.propose(seqs, ks, engine)
        except Exception as exc:
            self._drafter_failed(exc, seqs)
            return {}, {}
        drafts = {}
        for seq, k in zip(seqs, ks):
            d = proposed.get(seq.seq_id, [])[:k]
            if not d:
                continue
            seq.token_ids.extend(d)
            if not bm.allocate_slots(seq, 1 + len(d)):  # no free block: this sequence decodes plainly
                del seq.token_ids[-len(d):]
                continue
            drafts[seq.seq_id] = d
        return drafts, q

    @torch.inference_mode()
    def _forward(self, vout: SchedulerOutput, drafts: dict[int, list[int]]):
        """The target's logits [R, V] of every row to sample from (all 1 + k positions of a
        verified sequence, the last one of the others); rows[j]: the logits rows of sampling
        item j; the step's prompt logprobs; the hidden states [T, H] and each item's first row."""
        runner = self.engine.runner
        plan = plan_step(vout)  # (the drafts are in token_ids until the step has run)
        inputs = runner.step_inputs(plan)
        qsl = inputs.meta.query_start_loc_cpu
        flat, rows = [], []
        for i, it in enumerate(vout.scheduled):
            if not it.sample:
                continue
            positions = range(qsl[i], qsl[i + 1]) if it.seq.seq_id in drafts else [qsl[i + 1] - 1]
            rows.append(list(range(len(flat), len(flat) + len(positions))))
            flat.extend(positions)
        ctx = runner.forward_context(inputs)
        with set_forward_context(ctx):
            hidden = runner.model(inputs.input_ids, inputs.positions)
            logits = runner.model.compute_logits(hidden.index_select(0, torch.tensor(flat, dtype=torch.long,
                                                                                     device=hidden.device)))
            prompt = runner.prompt_logprobs(plan, inputs, hidden)
        runner.add_expert_counts(ctx)
        return logits, rows, prompt, hidden, qsl

    def _accept(self, seq: Sequence, logits: torch.Tensor, drafts: list[int], q) -> tuple[list[int], int]:
        sampler = self.engine.runner.sampler
        params = seq.params
        if params.argmax_only:
            return accept_greedy(logits, drafts)
        row = sampling_rows([seq])[0]
        work = processed_rows(logits, row, drafts, sampler.stop_token_ids, sampler.processors)
        if params.greedy:
            return accept_greedy(work, drafts)
        generator = sampler.generator if seq.seed is None else sampler._generator(row)
        return accept_sampled(sampling_probs(work, params), drafts, q, generator)

    def _cut_at_stop(self, seq: Sequence, accepted: list[int]) -> list[int]:
        """The kept tokens up to the first that ends the sequence (EOS, a stop token, max_tokens,
        max_model_len, a stop string): plain decoding would have stopped there."""
        check = self.engine.scheduler.check_stop
        eos = self.engine.eos_token_ids
        base = len(seq.token_ids)
        saved_reason = seq.stop_reason
        try:
            for i, token in enumerate(accepted[:-1]):
                seq.token_ids.append(token)
                if check(seq, token, eos) is not None:
                    return accepted[:i + 1]
        finally:
            del seq.token_ids[base:]
            seq.stop_reason = saved_reason
        return self._cut_at_stop_string(seq, accepted)

    def _cut_at_stop_string(self, seq: Sequence, accepted: list[int]) -> list[int]:
        stops = seq.params.stop_strings
        detok = self.engine.detokenizer
        if not stops or detok is None or not seq.params.detokenize or len(accepted) < 2:
            return accepted
        skip = seq.params.skip_special_tokens
        read = seq.read_offset or seq.num_prompt_tokens
        prefix = seq.prefix_offset if seq.read_offset else max(0, seq.num_prompt_tokens - PREFIX_WINDOW)
        before = detok.decode(seq.token_ids[prefix:read], skip)
        start = max(0, len(seq.text) - max(map(len, stops)) + 1)
        for i in range(len(accepted) - 1):  # (the last token is checked by the engine as usual)
            text = seq.text + detok.decode(seq.token_ids[prefix:] + accepted[:i + 1], skip)[len(before):]
            if any(text.find(s, start) != -1 for s in stops):
                return accepted[:i + 1]
        return accepted
