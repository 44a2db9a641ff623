"""Incremental detokenization for a batch of sequences, and stop-string checks.

Each sequence keeps two offsets into its token ids: text up to ``read_offset`` is final,
and decoding restarts at ``prefix_offset`` (a few tokens earlier) so that tokenizers
whose pieces depend on their left neighbour (SentencePiece spaces, multi-byte characters
split over tokens) produce the right delta. Each window is one call of the Rust tokenizer.
"""

from __future__ import annotations

from pagoda.engine.sequence import Sequence, SequenceStatus

PREFIX_WINDOW = 5


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)

    def _decode_batch(self, batch: list[list[int]], skip_special: bool) -> list[str]:
        # One Rust call per window rather than the tokenizers' ``decode_batch``: a step's windows are a few
        # tokens each, and decode_batch hands them to its thread pool (unless TOKENIZERS_PARALLELISM=false),
        # whose threads then compete with the engine's. 2-core development CPU: 128 windows 112 against 130
        # us; the engine's offline step at batch 64 (scripts/host_step_cost.py) 3.35-3.43 ms against 3.56-3.57
        # with decode_batch on its pool (3.32-3.35 with the pool off, as every GPU measurement ran).
        decode = (self.backend or self.tokenizer).decode
        return [decode(ids, skip_special_tokens=skip_special) for ids in batch]

    def step(self, seqs: list[Sequence]) -> list[str]:
        """Append each sequence's newly readable text to ``seq.text``; return the deltas."""
        deltas = [""] * len(seqs)
        for skip in (True, False):
            idx = [i for i, s in enumerate(seqs) if s.params.skip_special_tokens == skip]
            if not idx:
                continue
            windows = []
            for i in idx:
                seq = seqs[i]
                if seq.read_offset == 0:
                    seq.read_offset = seq.num_prompt_tokens
                    seq.prefix_offset = max(0, seq.num_prompt_tokens - PREFIX_WINDOW)
                windows.append(seq.token_ids[seq.prefix_offset:seq.read_offset])
                windows.append(seq.token_ids[seq.prefix_offset:_text_end(seq)])
            texts = self._decode_batch(windows, skip)
            for n, i in enumerate(idx):
                seq = seqs[i]
                before, after = texts[2 * n], texts[2 * n + 1]
                # A trailing U+FFFD is a character still split over tokens: wait for the rest,
                # unless the sequence has ended.
                if len(after) > len(before) and (seq.is_finished or not after.endswith("\ufffd")):
                    delta = after[len(before):]
                    seq.text += delta
                    deltas[i] = delta
                    seq.prefix_offset = seq.read_offset
                    seq.read_offset = seq.num_tokens
        return deltas

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._decode_batch([token_ids], skip_special_tokens)[0]


def _text_end(seq: Sequence) -> int:
    """Where the text's tokens end: a stop token (EOS, a stop_token_ids entry, or the stop token a
    complete grammar accepted) that ended the sequence is not text, unless
    include_stop_str_in_output (as in vLLM; it matters when special tokens are kept)."""
    if (seq.status is SequenceStatus.FINISHED_STOPPED and not isinstance(seq.stop_reason, str)
            and not seq.params.include_stop_str_in_output and seq.num_tokens > seq.num_prompt_tokens):
        return seq.num_tokens - 1
    return seq.num_tokens


def find_stop_string(seq: Sequence, delta: str) -> str | None:
    """If a stop string now appears in the text, trim the text and return the string."""
    stops = seq.params.stop_strings
    if not stops or not delta:
        return None
    longest = max(len(s) for s in stops)
    start = max(0, len(seq.text) - len(delta) - longest + 1)
    found = [(pos, stop) for stop in stops if (pos := seq.text.find(stop, start)) != -1]
    if not found:
        return None
    pos, stop = min(found)
    end = pos + len(stop) if seq.params.include_stop_str_in_output else pos
    seq.text = seq.text[:end]
    return stop
