"""Prompt lookup (method "ngram"): the tokens that followed the last earlier occurrence of the
sequence's final n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) are the draft.
No model, no state: the draft is a point mass (its distribution q is 1 on the drafted token)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    deterministic = True  # the drafts are not sampled: rejection sampling uses q = one-hot

    def __init__(self, lookup_min: int, lookup_max: int):
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose_one(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens continuing ``tokens`` (prompt + output so far); [] when no suffix recurs."""
        n_tokens = len(tokens)
        if k <= 0 or n_tokens < self.lookup_min + 1:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.lookup_max, n_tokens - 1), self.lookup_min - 1, -1):
            # windows that start at 0 .. n_tokens - n - 1: every occurrence before the suffix itself
            windows = sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent occurrence
                return arr[start:start + k].tolist()
        return []

    def propose(self, seqs: list, ks: list[int], engine) -> tuple[dict[int, list[int]], dict]:
        """Drafts by seq_id (only sequences with a match), and no draft distributions."""
        del engine
        drafts = {}
        for seq, k in zip(seqs, ks):
            found = self.propose_one(seq.token_ids, k)
            if found:
                drafts[seq.seq_id] = found
        return drafts, {}

    def forget(self, seq_id: int) -> None:
        pass
