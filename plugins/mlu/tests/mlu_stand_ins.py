"""STAND-INS for Cambricon's ``torch_mlu`` and ``torch_mlu_ops``, for tests on machines without an MLU.

They are not MLU software and prove nothing about MLU hardware. ``StandInTorchMlu`` mimics the
``torch.mlu`` functions pagoda-mlu calls and records the calls; ``StandInTorchMluOps``
computes, on CPU tensors, what torch_mlu_ops' docstrings document for each function pagoda-mlu
calls (the "Math" sections of ``torch_mlu_ops/_ops.py``). Tests use them to check that
pagoda-mlu calls those functions with the arguments, layouts and conventions the documentation
describes; how the real kernels behave on an MLU is for ``python -m pagoda_mlu.check`` to find out.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch
import torch.nn.functional as F


# ---------------------------------------------------------------- torch.mlu
class StandInMluGraph:
    """Counts replays; a real MLUGraph replays the device work recorded while it captured."""

    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


class StandInTorchMlu:
    """What ``import torch_mlu`` puts at ``torch.mlu``, reduced to the calls pagoda-mlu makes."""

    def __init__(self, devices: int = 1, free: int = 0, total: int = 0, cached: int = 0, bf16: bool = True,
                 graphs: bool = False):
        self.devices, self.free, self.total, self.cached, self.bf16 = devices, free, total, cached, bf16
        self.calls: list[tuple] = []
        if graphs:
            self.MLUGraph = StandInMluGraph
            self.graph = self._graph
            self.graph_pool_handle = lambda: ("pool",)

    def is_available(self) -> bool:
        return self.devices > 0

    def device_count(self) -> int:
        return self.devices

    def set_device(self, index: int) -> None:
        self.calls.append(("set_device", index))

    def mem_get_info(self, device=None) -> tuple[int, int]:
        self.calls.append(("mem_get_info",))
        return self.free, self.total

    def synchronize(self, device=None) -> None:
        self.calls.append(("synchronize",))

    def empty_cache(self) -> None:
        # The caching allocator hands its unused blocks back to the device.
        self.calls.append(("empty_cache",))
        self.free, self.cached = self.free + self.cached, 0

    def is_bf16_supported(self) -> bool:
        return self.bf16

    @contextlib.contextmanager
    def _graph(self, mlu_graph, pool=None):
        self.calls.append(("graph begin", pool))
        yield
        self.calls.append(("graph end", pool))


def install_torch_mlu(monkeypatch, mlu: StandInTorchMlu | None, import_error: BaseException | None = None):
    """Make ``import torch_mlu`` succeed (registering ``mlu`` at torch.mlu) or raise ``import_error``."""
    if import_error is not None:
        monkeypatch.setitem(sys.modules, "torch_mlu", None)  # None in sys.modules: ImportError
        if not isinstance(import_error, ImportError):
            import importlib

            real_import = importlib.import_module

            def failing(name, *args, **kwargs):
                if name == "torch_mlu":
                    raise import_error
                return real_import(name, *args, **kwargs)

            monkeypatch.setattr(importlib, "import_module", failing)
        return
    module = types.ModuleType("torch_mlu")
    module.__version__ = "stand-in"
    monkeypatch.setitem(sys.modules, "torch_mlu", module)
    monkeypatch.setattr(torch, "mlu", mlu, raising=False)


# ---------------------------------------------------------------- torch_mlu_ops
class StandInTorchMluOps(types.ModuleType):
    """torch_mlu_ops functions as documented, in torch on the CPU; ``calls`` lists their names."""

    def __init__(self):
        super().__init__("torch_mlu_ops")
        self.calls: list[str] = []

    # fused_rms_norm(x, residual, gamma, beta, bias, eps, store_output_before_norm)
    def fused_rms_norm(self, x, residual, gamma, beta, bias, eps, store_output_before_norm, *rest, **kw):
        self.calls.append("fused_rms_norm")
        x1 = x if residual is None else x + residual
        xf = x1.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()).to(x.dtype)
        return (normed, x1) if store_output_before_norm else normed

    # apply_rotary(input, sin_cache, cos_cache, position_ids, cu_seqlens, interleaved, discrete, dynamic_ntk,
    #              max_seqlen): input_rot * sin[pos] + input * cos[pos] over the first rotary_dim dims.
    def apply_rotary(self, x, sin_cache, cos_cache, position_ids, cu_seqlens, interleaved, discrete, dynamic_ntk,
                     max_seqlen, output=None, is_inverse=False):
        self.calls.append("apply_rotary")
        assert discrete and not dynamic_ntk and position_ids.dtype == torch.int32
        rot = sin_cache.shape[-1]
        x_rot = x[..., :rot].clone()
        if interleaved:
            x1, x2 = x_rot[..., ::2].clone(), x_rot[..., 1::2].clone()
            x_rot[..., ::2], x_rot[..., 1::2] = -x2, x1
        else:
            x1, x2 = x_rot.chunk(2, dim=-1)
            x_rot = torch.cat((-x2, x1), dim=-1)
        pos = position_ids.long()
        sin, cos = sin_cache[pos].unsqueeze(1), cos_cache[pos].unsqueeze(1)
        out = x if output is None else output
        out[..., :rot] = x_rot * sin + x[..., :rot] * cos
        return out

    # reshape_paged_cache(k, v, k_cache, v_cache, slot_mapping): caches [blocks, heads, block_size, dim]
    def reshape_paged_cache(self, k, v, k_cache, v_cache, slot_mapping, direction=False):
        self.calls.append("reshape_paged_cache")
        assert slot_mapping.dtype == torch.int32 and not direction
        block_size = k_cache.shape[2]
        for i, slot in enumerate(slot_mapping.tolist()):
            if slot >= 0:
                k_cache[slot // block_size, :, slot % block_size, :] = k[i]
                v_cache[slot // block_size, :, slot % block_size, :] = v[i]
        return k_cache, v_cache

    @staticmethod
    def _attend(q, keys, values, scale, causal_offset, window_left):
        """q [Q, nq, d], keys/values [S, nk, d]; query i sees keys j <= i + offset, and with a
        left window only the window_left + 1 keys ending there."""
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1).float(), values.repeat_interleave(group, 1).float()
        scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale
        qi = torch.arange(q.shape[0])[:, None] + causal_offset
        kj = torch.arange(keys.shape[0])[None, :]
        allowed = kj <= qi
        if window_left >= 0:
            allowed &= kj >= qi - window_left
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)

    # single_query_cached_kv_attn(q, k_cache, v_cache, out, block_tables, context_lens, k_scale, v_scale,
    #     alibi, max_context_len, windows_size_left, windows_size_right, softmax_scale)
    def single_query_cached_kv_attn(self, q, k_cache, v_cache, out, block_tables, context_lens, k_scale, v_scale,
                                    alibi_slopes, max_context_len, window_left, window_right, scale, **kw):
        self.calls.append("single_query_cached_kv_attn")
        assert q.dim() == 4 and q.shape[1] == 1 and window_right == -1
        assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32
        block_size = k_cache.shape[2]
        for i, length in enumerate(context_lens.tolist()):
            blocks = block_tables[i, :-(-length // block_size)].long()
            keys = k_cache[blocks].permute(0, 2, 1, 3).reshape(-1, k_cache.shape[1], k_cache.shape[3])[:length]
            values = v_cache[blocks].permute(0, 2, 1, 3).reshape(-1, v_cache.shape[1], v_cache.shape[3])[:length]
            out[i] = self._attend(q[i], keys, values, scale, length - 1, window_left)
        return out

    # flash_attention(q, k, v, out, cu_seq_lens_q, cu_seq_lens_kv, alibi_slope, attn_bias, max_seq_len_q,
    #     max_seq_len_kv, softmax_scale, is_causal, window_size_left, window_size_right, compute_dtype, return_lse)
    def flash_attention(self, q, k, v, out, cu_q, cu_kv, alibi_slope, attn_bias, max_q, max_kv, scale, is_causal,
                        window_left=-1, window_right=-1, compute_dtype=torch.float32, return_lse=False, **kw):
        self.calls.append("flash_attention")
        assert is_causal and q.dim() == 3 and cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_kv)
        bounds = cu_q.tolist()
        for s, e in zip(bounds[:-1], bounds[1:]):
            out[s:e] = self._attend(q[s:e], k[s:e], v[s:e], scale, 0, window_left)
        return out

    # moe_gen_idx(expert_id [T, K], expert_num) -> (expand_idx, combine_idx, token_count, cusum_token_count)
    def moe_gen_idx(self, expert_id, expert_num):
        self.calls.append("moe_gen_idx")
        assert expert_id.dtype == torch.int32 and int(expert_id.max()) < expert_num and int(expert_id.min()) >= 0
        topk = expert_id.shape[1]
        flat = expert_id.reshape(-1).long()
        order = torch.argsort(flat, stable=True)  # expanded row r holds pair order[r]
        expand_idx = (order // topk).to(torch.int32)  # the token each expanded row copies
        combine_idx = torch.empty_like(order)
        combine_idx[order] = torch.arange(order.numel())  # where each (token, k) pair landed
        token_count = torch.bincount(flat, minlength=expert_num).to(torch.int32)
        cusum = torch.cat((torch.zeros(1, dtype=torch.int32), token_count.cumsum(0).to(torch.int32)))
        return expand_idx, combine_idx.to(torch.int32), token_count, cusum

    # moe_expand_input(input, gather_idx, cusum_token_count, start_expert_id, expert_size)
    def moe_expand_input(self, x, gather_idx, cusum, start_expert_id, expert_size):
        self.calls.append("moe_expand_input")
        lo, hi = int(cusum[start_expert_id]), int(cusum[start_expert_id + expert_size])
        return x[gather_idx[lo:hi].long()]

    # group_gemm(a, b [experts, n, k], group_list, expand_idx, c, alpha, beta, max_in_group_list)
    def group_gemm(self, a, b, group_list, expand_idx, c, alpha, beta, max_in_group_list, **kw):
        self.calls.append("group_gemm")
        assert expand_idx is None and c is None and group_list.shape[0] == b.shape[0]
        assert int(group_list.max()) <= max_in_group_list
        parts = a.split(group_list.tolist())
        return torch.cat([part @ b[i].t() for i, part in enumerate(parts)], dim=0)

    # active(input, act_mode, is_gated, ..., gelu_approximate): act(input[..., :C//2]) * input[..., C//2:]
    def active(self, x, act_mode, is_gated, active_coef=1.0, high_precision=False, gelu_approximate="none"):
        self.calls.append("active")
        assert is_gated
        half = x.shape[-1] // 2
        act = F.silu if act_mode == "silu" else (lambda t: F.gelu(t, approximate=gelu_approximate))
        return act(x[..., :half]) * x[..., half:]

    # moe_combine_result(input, reduce_weight, gather_ids, residual, cusum_token_count, start_expert_id,
    #     expert_size): rows outside the expert range weigh 0; sum over k of weight * row.
    def moe_combine_result(self, x, reduce_weight, gather_ids, residual, cusum, start_expert_id, expert_size,
                           bias=None, output=None):
        self.calls.append("moe_combine_result")
        assert reduce_weight.dtype == torch.float32 and residual is None and bias is None
        lo, hi = int(cusum[start_expert_id]), int(cusum[start_expert_id + expert_size])
        ids = gather_ids.long()
        inside = (ids >= lo) & (ids < hi)
        rows = x[(ids - lo).clamp(0, max(x.shape[0] - 1, 0))] if x.shape[0] else x.new_zeros(ids.numel(),
                                                                                             x.shape[1])
        rows = torch.where(inside[:, None], rows, torch.zeros_like(rows))
        t, k = reduce_weight.shape
        weighted = rows.view(t, k, -1).float() * (reduce_weight * inside.view(t, k)).unsqueeze(-1)
        return weighted.sum(1).to(x.dtype)


def install_torch_mlu_ops(monkeypatch) -> StandInTorchMluOps:
    """Put a fresh stand-in at ``import torch_mlu_ops`` (and a bare torch_mlu module if absent)."""
    from pagoda_mlu import tmo_kernels

    ops = StandInTorchMluOps()
    monkeypatch.setitem(sys.modules, "torch_mlu_ops", ops)
    if sys.modules.get("torch_mlu") is None:
        monkeypatch.setitem(sys.modules, "torch_mlu", types.ModuleType("torch_mlu"))
    tmo_kernels.tmo.cache_clear()
    monkeypatch.setattr(tmo_kernels, "_ROPE_TABLES", {})
    return ops
