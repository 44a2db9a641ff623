"""``mlu_chunked``: paged attention over K/V tiles, in plain torch operations.

Each sequence's cached keys and values are read ``tile_size`` tokens at a time through its
block table and folded into the output with an online softmax (running max ``m``, running
sum ``l``, rescaled accumulator), so no step materialises scores over the whole context: the
working set is one tile of K and V plus a [queries, tile] score block. Queries of a prefill
chunk are processed in blocks of ``tile_size`` as well, and a query block skips the tiles past
its causal horizon (and, with a sliding window, before its window).

Everything is indexing, einsum, exp and max, which torch_mlu implements for the ``mlu``
device; the same code runs on the CPU, where it is tested against transformers.
The cache layout is the MLU's head-major one (see ``pagoda_mlu.paged_cache``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from pagoda.errors import ConfigError, PluginError
from pagoda.forward_context import AttentionMetadata, get_forward_context
from pagoda.interfaces import AttentionBackend, AttentionSpec
from pagoda.kernels import get_op
from pagoda.layers.attention import is_quantized_kv_cache

from pagoda_mlu.paged_cache import STORE_OP, gather_tokens, head_major_cache_shape

# Tokens per K/V tile. For a 128-dim head in float16 one tile of K plus V is 128 KiB per KV
# head, and bigger tiles mean fewer (launch-bound) torch_mlu kernels per step; not yet tuned
# on hardware: `python -m pagoda_mlu.check --sweep-tiles` measures it on a real MLU.
DEFAULT_TILE_SIZE = 256


def tiled_paged_attention(q: torch.Tensor, q_pos: torch.Tensor, block_tables: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, tile_size: int,
                          start: int, end: int, sliding_window: int | None = None,
                          soft_cap: float | None = None, kv_scales: dict | None = None) -> torch.Tensor:
    """Causal attention of queries over cached keys, one K/V tile at a time.

    q [B, Q, nq, d]; q_pos [B, Q] absolute position of each query (it sees keys at positions
    <= its own, and > q_pos - sliding_window with a window); block_tables [B, W];
    k_cache/v_cache one half of the head-major cache [num_blocks, nk, block_size, d(v)].
    Keys at positions [start, end) are visited; the caller picks the range that covers every
    query's visible keys. ``kv_scales`` ({"k_scale", "v_scale"}, an fp8 cache) multiply what is
    read. Returns [B, Q, nq, dv] in q's dtype (computed in float32).
    """
    b, nq_len, nq, d = q.shape
    nk = k_cache.shape[1]
    group, dv = nq // nk, v_cache.shape[-1]
    qf = q.float().view(b, nq_len, nk, group, d).permute(0, 2, 3, 1, 4)  # [B, nk, g, Q, d]
    m = torch.full((b, nk, group, nq_len), float("-inf"), device=q.device)
    l_sum = torch.zeros((b, nk, group, nq_len), device=q.device)
    acc = torch.zeros((b, nk, group, nq_len, dv), device=q.device)
    last_pos = q_pos.amax(dim=1, keepdim=True)  # [B, 1]: a row's keys past this were never written
    for s in range(start, end, tile_size):
        pos = torch.arange(s, min(s + tile_size, end), device=q.device)  # [n] key positions
        rows = pos.unsqueeze(0).expand(b, -1)
        keys = gather_tokens(k_cache, block_tables, rows).float()  # [B, n, nk, d]
        # Unwritten slots may hold anything, nan included, and 0 * nan is nan: zero them (their
        # scores are masked below). Only the shorter rows of a decode batch reach such slots.
        values = gather_tokens(v_cache, block_tables, rows).float()
        values = values.masked_fill((rows > last_pos)[..., None, None], 0.0)
        if kv_scales is not None:
            keys, values = keys * kv_scales["k_scale"], values * kv_scales["v_scale"]
        scores = torch.einsum("bhgqd,bnhd->bhgqn", qf, keys) * scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        allowed = pos.view(1, 1, -1) <= q_pos.unsqueeze(-1)  # [B, Q, n]
        if sliding_window:
            allowed &= pos.view(1, 1, -1) > (q_pos - sliding_window).unsqueeze(-1)
        scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
        m_new = torch.maximum(m, scores.amax(dim=-1))
        # A query that sees no key of this tile (nor of any earlier one) keeps m = -inf;
        # shift by 0 instead so exp() gives 0 rather than nan.
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(scores - shift.unsqueeze(-1))
        alpha = torch.exp(m - shift)
        l_sum = l_sum * alpha + p.sum(dim=-1)
        acc = acc * alpha.unsqueeze(-1) + torch.einsum("bhgqn,bnhd->bhgqd", p, values)
        m = m_new
    out = acc / l_sum.unsqueeze(-1)  # every query sees at least its own key: l_sum > 0
    return out.permute(0, 3, 1, 2, 4).reshape(b, nq_len, nq, dv).to(q.dtype)


def parse_tile_size(options: dict, backend: str) -> int:
    unknown = sorted(set(options) - {"tile_size"})
    if unknown:
        raise ConfigError(f"attention_options: attention backend {backend!r} has no option "
                          f"{', '.join(map(repr, unknown))} (options: tile_size)")
    value = options.get("tile_size", DEFAULT_TILE_SIZE)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"attention_options.tile_size must be a positive integer (tokens per K/V tile), "
                          f"got {value!r}")
    return value


class MluChunkedAttention(AttentionBackend):
    """Multi-head (grouped-query) attention, and MLA over the latent cache (see ``forward_mla``)."""

    name = "mlu_chunked"
    priority = 5  # above the core's torch reference (0) where it is auto-selected: the MLU
    platforms = ("mlu", "cpu")
    auto_platforms = ("mlu",)  # on the CPU it runs when named (tests, debugging)
    kinds = ("mha", "mla")
    supports_graphs = False  # the tile loops follow host-side lengths

    def __init__(self, tile_size: int = DEFAULT_TILE_SIZE):
        self.tile_size = tile_size

    def configure(self, options: dict) -> MluChunkedAttention:
        configured = copy.copy(self)
        configured.tile_size = parse_tile_size(options, self.name)
        return configured

    def kv_cache_shape(self, spec: AttentionSpec, num_blocks: int, block_size: int) -> tuple[int, ...]:
        if spec.kind == "mla":  # [num_blocks, block_size, L + R], the core's latent layout
            return super().kv_cache_shape(spec, num_blocks, block_size)
        return head_major_cache_shape(num_blocks, block_size, spec.num_kv_heads, spec.head_size)

    def store(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
              kv_scales: dict | None = None) -> None:
        if kv_scales is None:
            get_op(STORE_OP)(k, v, kv_cache, slots)
        else:
            get_op(STORE_OP)(k, v, kv_cache, slots, kv_scales["k_scale"], kv_scales["v_scale"])

    def _no_probe(self) -> None:
        if get_forward_context().attention_probe is not None:
            raise PluginError(f"attention backend {self.name!r} never forms full attention maps; "
                              f"use attention_backend: torch (or torch_mla) to record them")

    def forward(self, layer, q, k, v, kv_cache, meta: AttentionMetadata):
        self._no_probe()
        spec: AttentionSpec = layer.spec
        t = q.shape[0]
        nq, nk, hs = spec.num_heads, spec.num_kv_heads, spec.head_size
        q, k, v = q.view(t, nq, hs), k.view(t, nk, hs), v.view(t, nk, hs)
        # An fp8 cache holds k / k_scale with the layer's scales (pagoda.layers.attention).
        scales = getattr(layer, "kv_scales", None) if is_quantized_kv_cache(kv_cache) else None
        self.store(k, v, kv_cache, meta.slot_mapping[:t], scales)
        out = torch.empty_like(q)
        self.attend(q, k, v, out, kv_cache, meta, spec, scales)
        return out.view(t, nq * hs)

    def forward_mla(self, layer, q_nope, q_pe, kv_c_normed, k_pe, kv_cache, meta: AttentionMetadata):
        """MLA (contract in ``pagoda.layers.mla``), every row in the absorbed form: the latent
        cache is one shared KV head of width L+R whose values are its first L dims, so the
        same tiles serve decodes and prefill chunks. Returns [T, N, V]."""
        self._no_probe()
        spec: AttentionSpec = layer.spec
        t, lora = q_nope.shape[0], spec.kv_lora_rank
        # an fp8 cache holds entry / k_scale (one scale for latent and k_pe, pagoda.layers.mla)
        scale = layer.kv_scales["k_scale"] if is_quantized_kv_cache(kv_cache) else None
        if scale is None:
            get_op("store_mla_cache")(kv_c_normed, k_pe, kv_cache, meta.slot_mapping[:t])
        else:
            get_op("store_mla_cache")(kv_c_normed, k_pe, kv_cache, meta.slot_mapping[:t], scale)
        scales = None if scale is None else {"k_scale": scale, "v_scale": scale}
        w_uk, w_uv = layer.absorbed_weights()  # [N, P, L], [N, V, L]
        q = torch.cat((torch.einsum("qhp,hpl->qhl", q_nope, w_uk), q_pe), dim=-1)  # [T, N, L+R]
        keys = kv_cache.unsqueeze(1)  # [num_blocks, 1, block_size, L+R]: head-major, one head
        values = keys[..., :lora]
        out = q.new_empty(t, q.shape[1], lora)
        self.decode_rows(q, out, keys, values, meta, spec, scales)
        self.prefill_rows(q, out, keys, values, meta, spec, range(meta.num_decodes, meta.num_seqs), scales)
        return torch.einsum("qhl,hvl->qhv", out, w_uv)

    def attend(self, q, k, v, out, kv_cache, meta: AttentionMetadata, spec: AttentionSpec,
               kv_scales: dict | None = None) -> None:
        """Fill ``out`` [T, nq, hs] for every row of the batch (k/v are already cached)."""
        seqs = range(meta.num_decodes, meta.num_seqs)
        self.decode_rows(q, out, kv_cache[0], kv_cache[1], meta, spec, kv_scales)
        self.prefill_rows(q, out, kv_cache[0], kv_cache[1], meta, spec, seqs, kv_scales)

    def decode_rows(self, q, out, k_cache, v_cache, meta: AttentionMetadata, spec: AttentionSpec,
                    kv_scales: dict | None = None) -> None:
        """All one-token sequences at once: rows 0..num_decodes-1 of the batch."""
        nd = meta.num_decodes
        if nd == 0:
            return
        lens = meta.seq_lens_cpu[:nd]
        q_pos = (meta.seq_lens[:nd].long() - 1).unsqueeze(1)  # [nd, 1]
        start = max(0, min(lens) - spec.sliding_window) if spec.sliding_window else 0
        out[:nd] = tiled_paged_attention(
            q[:nd].unsqueeze(1), q_pos, meta.block_tables[:nd], k_cache, v_cache, spec.scale,
            self.tile_size, start, max(lens), spec.sliding_window, spec.logits_soft_cap, kv_scales).squeeze(1)

    def prefill_rows(self, q, out, k_cache, v_cache, meta: AttentionMetadata, spec: AttentionSpec,
                     seqs: Iterable[int], kv_scales: dict | None = None) -> None:
        """Each prefill chunk of ``seqs`` on its own, its queries in blocks of tile_size."""
        starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for i in seqs:
            qs, qe, length = starts[i], starts[i + 1], lens[i]
            context = length - (qe - qs)
            for b0 in range(qs, qe, self.tile_size):
                b1 = min(b0 + self.tile_size, qe)
                first, last = context + b0 - qs, context + b1 - qs  # positions of this query block
                q_pos = torch.arange(first, last, device=q.device).unsqueeze(0)
                lo = max(0, first - spec.sliding_window + 1) if spec.sliding_window else 0
                out[b0:b1] = tiled_paged_attention(
                    q[b0:b1].unsqueeze(0), q_pos, meta.block_tables[i:i + 1], k_cache, v_cache,
                    spec.scale, self.tile_size, lo, last, spec.sliding_window, spec.logits_soft_cap,
                    kv_scales)[0]
