"""Which drafted tokens a sequence keeps, and the token that follows them.

Row j of a verification (j = 0 .. k) holds the target's logits after the sequence's tokens plus
the first j drafted tokens. Each row gets the request's own processing (penalties, logit bias,
bad words, min_tokens, plugin processors) as if those j drafts had been generated, then the same
temperature, top-k, top-p and min-p as plain sampling (``pagoda.engine.sampler``): the distribution p_j
the request would sample from at that point.

- greedy: drafts are kept while each equals the argmax of its row; the next token is the argmax
  of the first row that disagrees (or of the last row): exactly plain decoding's tokens.
- sampled: standard speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023).
  Draft j, drawn from the proposer's q_j, is kept with probability min(1, p_j(x) / q_j(x)); at the
  first rejection a token is drawn from the residual max(0, p_j - q_j) (normalised), and after k
  kept drafts one more from p_k. Every token so produced follows the target's p exactly. A
  proposer that drafts without sampling (n-gram) has q_j = one-hot(draft).
"""

from __future__ import annotations

import torch

from pagoda.engine.sampler import _filtered_probs, row_argmax
from pagoda.engine.sampling_batch import SamplingRow
from pagoda.logits_processors import process_row


def processed_rows(logits: torch.Tensor, row: SamplingRow, drafts: list[int], stop_token_ids: set[int],
                   processors: dict) -> torch.Tensor:
    """logits [m, V] (m <= len(drafts) + 1), row j after ``row``'s sequence + drafts[:j]: each row's request
    processing applied in float32 (a copy)."""
    work = logits.float().clone()
    if row.params.needs_processing:
        for j in range(work.shape[0]):
            process_row(work[j], row.as_if_generated(drafts[:j]), stop_token_ids, processors)
    return work


def sampling_probs(work: torch.Tensor, params) -> torch.Tensor:
    """The distribution a sampled request draws from, per row [m, V]: temperature, then top-k,
    top-p and min-p (``pagoda.engine.sampler``'s own filter)."""
    return _filtered_probs(work / params.temperature, [params] * work.shape[0])


def accept_greedy(work: torch.Tensor, drafts: list[int]) -> tuple[list[int], int]:
    """(the tokens the step yields, how many drafts were kept) from processed rows [k + 1, V]."""
    best = row_argmax(work).tolist()
    kept = 0
    while kept < len(drafts) and drafts[kept] == best[kept]:
        kept += 1
    return drafts[:kept] + [best[kept]], kept


def accept_sampled(p: torch.Tensor, drafts: list[int], q: torch.Tensor | None,
                   generator: torch.Generator) -> tuple[list[int], int]:
    """Rejection sampling. p [k + 1, V]: target probabilities; q [k, V] the draft's (None: one-hot
    drafts); returns (tokens, drafts kept)."""
    k = len(drafts)
    device = p.device
    if k:
        idx = torch.arange(k, device=device)
        tokens = torch.tensor(drafts, device=device)
        p_d = p[idx, tokens]
        q_d = q[idx, tokens] if q is not None else torch.ones_like(p_d)
        u = torch.rand(k, generator=generator, device=device, dtype=p.dtype)
        rejected = (u * q_d >= p_d).tolist()  # keep with probability min(1, p/q)
        kept = next((j for j, r in enumerate(rejected) if r), k)
    else:
        kept = 0
    if kept == k:
        dist = p[k]
    else:
        if q is not None:
            dist = (p[kept] - q[kept]).clamp_min(0)
        else:
            dist = p[kept].clone()
            dist[drafts[kept]] = 0
        if not bool(dist.sum() > 0):  # p == q: a rejection has probability 0; guard rounding
            dist = p[kept]
    last = int(torch.multinomial(dist / dist.sum(), 1, generator=generator).item())
    return drafts[:kept] + [last], kept
