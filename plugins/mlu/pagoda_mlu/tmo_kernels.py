"""pagoda's kernel ops on Cambricon's fused kernels (``torch_mlu_ops``, imported as ``tmo``).

Each function keeps the signature and meaning of the op it replaces (``pagoda.kernels.reference``
documents them) and adapts the data to the torch_mlu_ops call, following the semantics
torch_mlu_ops documents for each function (its docstrings give a "Math" section):

- ``rms_norm`` / ``fused_add_rms_norm``: ``tmo.fused_rms_norm(x, residual, gamma, beta, bias, eps,
  store_output_before_norm)`` returns ``rmsnorm(x + residual)`` and, when asked, ``x + residual``.
- ``rotary_embedding``: ``tmo.apply_rotary`` wants full-width sin/cos tables [P, rotary_dim]
  (``out = rotate(x) * sin[pos] + x * cos[pos]``), where pagoda keeps half-width cos|sin.
- ``store_kv_cache_head_major``: ``tmo.reshape_paged_cache`` writes k/v [T, nk, hs] into
  [num_blocks, nk, block_size, hs] caches at int32 slots, skipping negative ones.
- ``fused_moe``: ``moe_gen_idx`` → ``moe_expand_input`` → ``group_gemm`` (w13) → ``active``
  (gated: act(first half) * second half) → ``group_gemm`` (w2) → ``moe_combine_result``.

None of this has run on an MLU yet (docs/mlu.md); tests drive it through a stand-in module
that implements those documented semantics in torch.
"""

from __future__ import annotations

import functools

import torch

from pagoda_mlu import paged_cache
from pagoda_mlu.runtime import load_torch_mlu_ops


@functools.lru_cache(maxsize=1)
def tmo():
    return load_torch_mlu_ops()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return tmo().fused_rms_norm(x, None, weight, None, None, eps, False)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    normed, summed = tmo().fused_rms_norm(x, residual, weight, None, None, eps, True)
    return normed, summed


_ROPE_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def full_width_rope_tables(cos_sin_cache: torch.Tensor, is_neox: bool,
                           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """pagoda's [P, rot] cache (cos half | sin half) -> (sin, cos) tables [P, rot] in ``dtype``:
    halves repeated for the neox (fold) layout, each value twice for the interleaved one."""
    key = (cos_sin_cache.data_ptr(), tuple(cos_sin_cache.shape), cos_sin_cache.device, dtype, is_neox)
    tables = _ROPE_TABLES.get(key)
    if tables is None:
        half = cos_sin_cache.shape[-1] // 2
        cos, sin = cos_sin_cache[:, :half], cos_sin_cache[:, half:]
        if is_neox:
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        else:
            cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        tables = (sin.to(dtype).contiguous(), cos.to(dtype).contiguous())
        if len(_ROPE_TABLES) > 16:  # one entry per rotary layer config; never grows with steps
            _ROPE_TABLES.clear()
        _ROPE_TABLES[key] = tables
    return tables


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_size: int,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    t = q.shape[0]
    sin, cos = full_width_rope_tables(cos_sin_cache, is_neox, q.dtype)
    # q and k heads side by side as one packed sequence with per-token positions.
    qk = torch.cat((q.reshape(t, -1, head_size), k.reshape(t, -1, head_size)), dim=1)
    cu_seqlens = torch.tensor([0, t], dtype=torch.int32, device=q.device)
    qk = tmo().apply_rotary(qk, sin, cos, positions.to(torch.int32), cu_seqlens, not is_neox, True, False, t)
    nq = q.shape[1] // head_size
    return qk[:, :nq].reshape(t, -1), qk[:, nq:].reshape(t, -1)


FLOAT_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # reshape_paged_cache's cache types


def store_kv_cache_head_major(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None) -> None:
    if k_scale is not None or kv_cache.dtype not in FLOAT_CACHE_DTYPES or k.dtype != kv_cache.dtype:
        # an fp8 cache (scaled): reshape_paged_cache stores float caches only
        paged_cache.store_kv_cache_head_major(k, v, kv_cache, slot_mapping, k_scale, v_scale)
        return
    tmo().reshape_paged_cache(k.contiguous(), v.contiguous(), kv_cache[0], kv_cache[1],
                              slot_mapping.to(torch.int32))


_ACT_MODES = {"silu": ("silu", "none"), "gelu_tanh": ("gelu", "tanh")}


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    if activation not in _ACT_MODES:
        raise ValueError(f"fused_moe: activation {activation!r} is not supported ({', '.join(_ACT_MODES)})")
    act_mode, approximate = _ACT_MODES[activation]
    lib = tmo()
    num_tokens = topk_ids.shape[0]
    num_experts = w13.shape[0]
    # Ids outside [0, E) (experts of other ranks under expert parallelism) go to one extra
    # expert E that is never computed: every call below covers experts [0, E) only, and
    # moe_combine_result zeroes the weight of rows outside that range.
    ids = topk_ids.to(torch.int32)
    ids = torch.where((ids >= 0) & (ids < num_experts), ids, torch.full_like(ids, num_experts))
    expand_idx, combine_idx, token_count, cusum = lib.moe_gen_idx(ids.contiguous(), num_experts + 1)
    rows = lib.moe_expand_input(hidden, expand_idx, cusum, 0, num_experts)
    counts = token_count[:num_experts]
    gate_up = lib.group_gemm(rows, w13, counts, None, None, None, None, num_tokens)
    act = lib.active(gate_up, act_mode, True, gelu_approximate=approximate)
    down = lib.group_gemm(act, w2, counts, None, None, None, None, num_tokens)
    return lib.moe_combine_result(down, topk_weights.float().contiguous(), combine_idx, None, cusum, 0,
                                  num_experts)


OPS = {
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "rotary_embedding": rotary_embedding,
    "store_kv_cache_head_major": store_kv_cache_head_major,
    "fused_moe": fused_moe,
}
