"""A step's SchedulerOutput as int64 words, and its mirror on the other ranks.

Rank 0 schedules; the other ranks keep a mirror ``Sequence`` per live sequence and rebuild
the same ``SchedulerOutput``, so that every rank runs the very same ``ModelRunner.execute``
(eager or graphs) on identical inputs. Mirrored: every field the runner reads from a
sequence — ``seq_id``, ``token_ids``, the prompt length, ``num_computed_tokens``,
``block_table`` (and the other KV cache groups' ``group_block_tables``, each as long) and
``num_preemptions`` (decode graphs key their incremental block tables on it). Token ids travel
once: a sequence's first step carries all its tokens, later steps only the ones appended since;
a ``PENDING_TOKEN`` (the step pipeline's stand-in for a token still on the device) travels again,
as the real token, with the next step, replacing the mirror's copy from ``first_sent`` on.
Block tables travel whole (preemption and prefix caching rewrite them). Sequences the engine
forgot are freed on the next step.

Words: ``[n, num_decodes, num_batched_tokens, num_freed]``, then n rows of ``(seq_id,
num_computed_tokens, num_new_tokens, flags, num_prompt_tokens, num_preemptions, num_sent_tokens,
num_blocks, first_sent)`` (flags: 1 = samples, 2 = wants prompt logprobs, bits 2..: the LoRA adapter
id, 0 for the base model), then the sent tokens, the block tables (``num_blocks`` entries of each
group, group 0 first) and the freed ids.
"""

from __future__ import annotations

import numpy as np

from pagoda.engine.scheduler import PENDING_TOKEN, ScheduledSeq, SchedulerOutput
from pagoda.engine.sequence import Sequence, SequenceStatus
from pagoda.sampling_params import SamplingParams

HEAD = 4
COLUMNS = 9


class StepEncoder:
    """Rank 0: remembers how many tokens of each sequence the other ranks have."""

    def __init__(self) -> None:
        self._sent: dict[int, int] = {}
        self._freed: list[int] = []

    def forget(self, seq_id: int) -> None:
        if self._sent.pop(seq_id, None) is not None:
            self._freed.append(seq_id)

    def encode(self, out: SchedulerOutput, persistent: bool = True) -> np.ndarray:
        """``persistent=False``: a one-off step (scoring) whose sequences the mirrors do not keep."""
        items = out.scheduled
        n = len(items)
        rows = np.empty((n, COLUMNS), np.int64)
        tokens: list[int] = []
        blocks: list[int] = []
        for i, it in enumerate(items):
            seq = it.seq
            sent = self._sent.get(seq.seq_id, 0) if persistent else 0
            new = seq.token_ids[sent:]
            if persistent:  # a pending last token is sent again once it is known
                pending = bool(seq.token_ids) and seq.token_ids[-1] == PENDING_TOKEN
                self._sent[seq.seq_id] = seq.num_tokens - pending
            flags = int(it.sample) | (2 if seq.wants_prompt_logprobs else 0) | (seq.lora_int_id << 2)
            rows[i] = (seq.seq_id, seq.num_computed_tokens, it.num_new_tokens, flags, seq.num_prompt_tokens,
                       seq.num_preemptions, len(new), len(seq.block_table), sent)
            tokens += new
            blocks += seq.block_table
            for table in seq.group_block_tables:
                blocks += table
        freed, self._freed = self._freed, []
        head = np.array([n, out.num_decodes, out.num_batched_tokens, len(freed)], np.int64)
        return np.concatenate([head, rows.reshape(-1), np.asarray(tokens, np.int64), np.asarray(blocks, np.int64),
                               np.asarray(freed, np.int64)])


_PARAMS = SamplingParams()  # mirrors never sample: rank 0 does


class StepDecoder:
    """Ranks > 0: the mirror sequences, by seq_id."""

    def __init__(self, num_groups: int = 1, lora_lookup=None) -> None:
        self.seqs: dict[int, Sequence] = {}
        self.num_groups = num_groups  # KV cache groups (pagoda.engine.kv_groups)
        self.lora_lookup = lora_lookup  # LoRA adapter id -> its LoRARequest (registered on this rank)

    def decode(self, words: np.ndarray, persistent: bool = True) -> tuple[SchedulerOutput, list[int]]:
        """(the SchedulerOutput to run, the seq ids rank 0 forgot)."""
        n, num_decodes, num_batched, num_freed = (int(v) for v in words[:HEAD])
        rows = words[HEAD:HEAD + n * COLUMNS].reshape(n, COLUMNS).tolist()
        pos = HEAD + n * COLUMNS
        num_tokens = sum(r[6] for r in rows)
        tokens = words[pos:pos + num_tokens].tolist()
        pos += num_tokens
        groups = self.num_groups
        num_blocks = sum(r[7] for r in rows) * groups
        blocks = words[pos:pos + num_blocks].tolist()
        pos += num_blocks
        freed = words[pos:pos + num_freed].tolist()
        for seq_id in freed:
            self.seqs.pop(seq_id, None)
        scheduled = []
        t = b = 0
        for seq_id, computed, num_new, flags, num_prompt, preemptions, num_sent, num_bt, first_sent in rows:
            sent = tokens[t:t + num_sent]
            t += num_sent
            seq = self.seqs.get(seq_id) if persistent else None
            if seq is None:
                seq = Sequence("", 0, sent[:num_prompt], _PARAMS, seq_id=seq_id, token_ids=sent,
                               status=SequenceStatus.RUNNING)
                if persistent:
                    self.seqs[seq_id] = seq
            elif sent:
                del seq.token_ids[first_sent:]  # (a pending token sent before, now known)
                seq.token_ids.extend(sent)
            seq.num_computed_tokens = computed
            seq.num_preemptions = preemptions
            seq.wants_prompt_logprobs = bool(flags & 2)
            seq.lora_request = self.lora_lookup(flags >> 2) if flags >> 2 else None
            seq.block_table = blocks[b:b + num_bt]
            if groups > 1:
                seq.group_block_tables = [blocks[b + g * num_bt:b + (g + 1) * num_bt] for g in range(1, groups)]
            b += num_bt * groups
            scheduled.append(ScheduledSeq(seq, num_new, bool(flags & 1)))
        return SchedulerOutput(scheduled, num_decodes, num_batched), freed
