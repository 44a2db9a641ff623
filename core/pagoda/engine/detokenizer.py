"""Incremental detokenization for a batch of sequences, and stop-string checks.

Each sequence keeps two offsets into its token ids: text up to ``read_offset`` is final,
and decoding restarts at ``prefix_offset`` (a few tokens earlier) so that tokenizers
whose pieces depend on their left neighbour (SentencePiece spaces, multi-byte characters
split over tokens) produce the right delta. Where the tokenizer is a ``tokenizers.Tokenizer`` (every fast
HF tokenizer, and GGUF models' own), each sequence keeps a ``tokenizers.decoders.DecodeStream`` instead,
primed with the prompt's last tokens: one Rust call a step for a sequence's new tokens (half the window
path's two decodes, with no windows cut in Python: 0.08 against 0.13 ms for 64 sequences a step on the
development machine's CPU; the server's engine thread spent about 12% of its time detokenizing on an H100:
docs/benchmarks.md). A stream that fails (its library refuses a prefix) leaves the sequence to the windows,
which also flush the bytes a finished sequence's stream still holds (an incomplete character).
"""

from __future__ import annotations

from pagoda.engine.sequence import Sequence, SequenceStatus

PREFIX_WINDOW = 5


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
        self._stream_class = _decode_stream_class(self.backend)  # None: windows only

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
        windowed = range(len(seqs))
        if self._stream_class is not None:
            windowed = []
            for i, seq in enumerate(seqs):
                delta = self._stream_step(seq)
                if delta is None:
                    windowed.append(i)
                else:
                    deltas[i] = delta
        for skip in (True, False):
            idx = [i for i in windowed if seqs[i].params.skip_special_tokens == skip]
            if not idx:
                continue
            windows = []
            for i in idx:
                seq = seqs[i]
                _start_offsets(seq)
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

    def _stream_step(self, seq: Sequence) -> str | None:
        """The sequence's delta from its stream (made on its first step); None: the window path's to make."""
        state = seq.decode_stream
        if state is None:
            state = self._start_stream(seq)
        if state is False:  # (no stream for it: windows)
            return None
        ids, fed = seq.token_ids, state[1]
        # (the whole of this runs per sequence and step: the usual case without calls)
        end = len(ids) if seq.status is not SequenceStatus.FINISHED_STOPPED else _text_end(seq)
        text = None
        if end > fed:
            try:  # (one id as an int: a list costs the binding half as much again)
                text = state[0].step(self.backend, ids[fed] if end == fed + 1 else ids[fed:end])
            except Exception:  # noqa: BLE001 - e.g. a decode that does not extend the text before it
                seq.decode_stream = False
                return None
            state[1] = end
        if text:
            seq.text += text
            seq.prefix_offset, seq.read_offset = seq.read_offset, end
            return text
        if seq.read_offset < end and seq.is_finished:  # bytes the stream holds back: the windows flush them
            return None
        return ""

    def _start_stream(self, seq: Sequence) -> list | bool:
        """A stream primed with the prompt's last tokens (False where that context ends inside a character: a
        stream primed with it would hand the context's text out as its first delta; the windows slice it off)."""
        _start_offsets(seq)
        context, skip = seq.token_ids[seq.prefix_offset:seq.read_offset], seq.params.skip_special_tokens
        if self.backend.decode(context, skip_special_tokens=skip).endswith("\ufffd"):
            seq.decode_stream = False
        else:  # (the stream, the tokens it was given)
            seq.decode_stream = [self._stream_class(ids=context, skip_special_tokens=skip), seq.read_offset]
        return seq.decode_stream

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._decode_batch([token_ids], skip_special_tokens)[0]


def _start_offsets(seq: Sequence) -> None:
    """A sequence's offsets before its first text: everything up to the prompt's end is read, and decoding starts
    a few prompt tokens earlier."""
    if seq.read_offset == 0:
        seq.read_offset = seq.num_prompt_tokens
        seq.prefix_offset = max(0, seq.num_prompt_tokens - PREFIX_WINDOW)


def _decode_stream_class(backend):
    """tokenizers' ``DecodeStream`` where ``backend`` is a ``tokenizers.Tokenizer`` and the stream can be primed
    with ids (tokenizers 0.22), else None."""
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    if not isinstance(backend, Tokenizer):
        return None
    try:
        DecodeStream(ids=[], skip_special_tokens=True)
    except TypeError:  # (an older tokenizers: no priming)
        return None
    return DecodeStream


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
