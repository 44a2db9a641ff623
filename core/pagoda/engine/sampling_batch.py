"""What the sampler reads of each row that samples: a ``SamplingRow`` per row, in row order (the batch).

The sampler never sees a live ``Sequence``: the engine's side (``StepPlan.sampling_rows``, the step pipeline,
speculative decoding) copies out what choosing a token needs, when the token is chosen. A row holds its
request's parameters and seed, its grammar matcher (the mask's source; the engine advances it between steps),
and its history for penalties, bad words, ``min_tokens`` and logits processors: the sequence's own token list
and counts, read and never written (the engine appends to them only after the step's tokens are chosen).
No torch.
"""

from __future__ import annotations

from typing import NamedTuple

from pagoda.sampling_params import SamplingParams


class SamplingRow(NamedTuple):
    """One row that samples (a tuple: cheap to make, for every such row of every step that samples on the host
    or under grammar masks)."""

    seq_id: int  # its own generator's key (a request with a seed), prompt logprobs' key
    params: SamplingParams
    seed: int | None
    grammar: object | None  # its structured-output grammar matcher, while it constrains the output
    grammar_opening: tuple | None  # (token id, ...): a token the first output token may be besides the grammar's
    token_ids: list[int]  # prompt + output so far (read only)
    num_prompt_tokens: int
    output_counts: dict[int, int] | None  # generated token -> count (penalties)
    bad_words_ids: list[list[int]] | None  # token sequences of the request's bad_words
    finished: bool  # the sequence ended after this step was launched (its token is thrown away)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def as_if_generated(self, extra: list[int]) -> SamplingRow:
        """This row as it would be with ``extra`` tokens generated after its current ones (speculative decoding
        processes each draft position's logits so)."""
        if not extra:
            return self
        counts = self.output_counts
        if counts is not None:
            counts = dict(counts)
            for t in extra:
                counts[t] = counts.get(t, 0) + 1
        return self._replace(token_ids=self.token_ids + list(extra), output_counts=counts)


def sampling_rows(seqs) -> list[SamplingRow]:
    """The rows of ``seqs`` (live ``Sequence`` objects, engine side) as they stand now."""
    new_row = tuple.__new__  # (SamplingRow's own __new__ is one Python call more per row)
    return [new_row(SamplingRow, (s.seq_id, s.params, s.seed, s.grammar, s.grammar_opening, s.token_ids,
                                  len(s.prompt_token_ids), s.output_counts, s.bad_words_ids, s.status.finished))
            for s in seqs]
