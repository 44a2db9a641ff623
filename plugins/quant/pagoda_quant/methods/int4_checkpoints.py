"""Pre-quantized INT4 checkpoints: GPTQ and AWQ, loaded as stored and converted once to
pagoda's kernel layout after loading.

GPTQ (``quant_method: gptq``; keys ``bits``, ``group_size``, ``desc_act``, ``sym``,
``checkpoint_format``/``format`` = ``gptq`` | ``gptq_v2``): qweight int32 [K/8, N], qzeros
int32 [K/G, N/8], scales [K/G, N], g_idx int32 [K]. The ``gptq`` format stores zero - 1.

AWQ (``quant_method: awq``; keys ``bits``/``w_bit``, ``group_size``/``q_group_size``,
``zero_point``, ``version``/``format`` = ``gemm``): qweight int32 [K, N/8] and qzeros int32
[K/G, N/8] in AWQ's interleaved nibble order, scales [K/G, N].
"""

from __future__ import annotations

import torch
from pagoda.errors import ModelLoadError

from pagoda_quant.formats import int4 as i4
from pagoda_quant.methods.base import PolicyConfig, add_param, check_group_size, declared_kv_cache_dtype, layer_name
from pagoda_quant.methods.int4 import Int4KernelLayout


def _check_packed_outputs(layer, output_sizes: list[int], what: str) -> None:
    if any(s % i4.PACK for s in output_sizes):
        raise ModelLoadError(f"{what}: layer {layer_name(layer)} has output pieces {output_sizes} per rank; packed "
                             f"zero points need multiples of {i4.PACK}")


class GptqMethod(Int4KernelLayout):
    method_name = "gptq"

    def __init__(self, group_size: int, desc_act: bool, v2_format: bool):
        self.group_size = group_size
        self.desc_act = desc_act
        self.v2 = v2_format

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        n = sum(output_sizes)
        _check_packed_outputs(layer, output_sizes, "gptq")
        row_split = getattr(layer, "parallel", None) == "row" and getattr(layer, "tp_size", 1) > 1
        if self.desc_act and row_split:
            raise ModelLoadError(f"gptq: layer {layer_name(layer)} is split over its inputs across "
                                 f"tensor_parallel_size={layer.tp_size} ranks, which act-order (desc_act: true) "
                                 f"checkpoints do not support in pagoda; use tensor_parallel_size 1")
        g = check_group_size(layer, input_size, self.group_size, "gptq")
        groups = input_size // g
        # with act order every rank needs all groups' scales: do not split them
        group_dim = None if self.desc_act else 0
        add_param(layer, "qweight", (input_size // i4.PACK, n), torch.int32,
                  input_dim=0, output_dim=1, packed_dim=0, packed_factor=i4.PACK)
        add_param(layer, "qzeros", (groups, n // i4.PACK), torch.int32,
                  input_dim=group_dim, output_dim=1, packed_dim=1, packed_factor=i4.PACK)
        add_param(layer, "scales", (groups, n), params_dtype, input_dim=group_dim, output_dim=1)
        add_param(layer, "g_idx", (input_size,), torch.int32, input_dim=0, weight_loader=self._g_idx_loader(layer))
        self.group = g

    @staticmethod
    def _g_idx_loader(layer):
        """Fused pieces share their input, so GPTQ gives them one act order; check that."""
        seen: list = []

        def load(param, loaded, shard_id=None):
            if getattr(layer, "tp_size", 1) > 1 and getattr(layer, "parallel", None) == "row":
                size = param.shape[0]
                loaded = loaded.narrow(0, layer.tp_rank * size, size)
            if seen and not torch.equal(param.data, loaded.to(param.dtype)):
                raise ModelLoadError(f"gptq: the pieces of fused layer {layer_name(layer)} have different g_idx "
                                     f"(act orders); pagoda computes them as one matmul and needs one order")
            param.data.copy_(loaded)
            seen.append(shard_id)

        return load

    def process_weights_after_loading(self, layer):
        zeros = i4.unpack_cols(layer.qzeros.data).to(torch.int32)
        if not self.v2:
            zeros = zeros + 1  # the original GPTQ format stores zero - 1
        scales = layer.scales.data
        k = layer.g_idx.numel()
        g_idx = layer.g_idx.data.long()
        expected = torch.arange(k, device=g_idx.device) // self.group
        qweight, perm = layer.qweight.data, None
        if not self.desc_act:
            # a rank's slice of the rows starts at its first group
            if not torch.equal(g_idx - g_idx.min(), expected):
                raise ModelLoadError(f"gptq: layer {layer_name(layer)} has a g_idx that is not sequential although "
                                     f"quantization_config.desc_act is false")
        elif not torch.equal(g_idx, expected):
            # act order: sort the input rows by group so that each group is contiguous
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], expected):
                raise ModelLoadError(f"gptq: layer {layer_name(layer)} has a g_idx that does not assign "
                                     f"{self.group} input rows to each group")
            qweight = i4.pack_rows(i4.unpack_rows(qweight).index_select(0, perm))
        for name in ("qzeros", "g_idx"):
            del layer._parameters[name]
        self.install(layer, qweight, scales, zeros.to(scales.dtype), perm)


class AwqMethod(Int4KernelLayout):
    method_name = "awq"

    def __init__(self, group_size: int):
        self.group_size = group_size

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        n = sum(output_sizes)
        _check_packed_outputs(layer, output_sizes, "awq")
        g = check_group_size(layer, input_size, self.group_size, "awq")
        add_param(layer, "qweight", (input_size, n // i4.PACK), torch.int32,
                  input_dim=0, output_dim=1, packed_dim=1, packed_factor=i4.PACK)
        add_param(layer, "qzeros", (input_size // g, n // i4.PACK), torch.int32,
                  input_dim=0, output_dim=1, packed_dim=1, packed_factor=i4.PACK)
        add_param(layer, "scales", (input_size // g, n), params_dtype, input_dim=0, output_dim=1)

    def process_weights_after_loading(self, layer):
        q = i4.unpack_cols(layer.qweight.data, i4.AWQ_ORDER)  # [K, N]
        zeros = i4.unpack_cols(layer.qzeros.data, i4.AWQ_ORDER)
        scales = layer.scales.data
        del layer._parameters["qzeros"]
        self.install(layer, i4.pack_rows(q), scales, zeros.to(scales.dtype))


def _experts_unsupported(method: str, prefix: str) -> ModelLoadError:
    return ModelLoadError(f"{method}: quantized MoE experts ({prefix}) in {method.upper()} checkpoints are not "
                          f"supported; quantize the full-precision model at load instead (quantization: int4, or "
                          f"a policy with kind: experts)")


def _bits(cfg: dict, *keys: str) -> None:
    for key in keys:
        if key in cfg and cfg[key] != 4:
            raise ModelLoadError(f"config.json quantization_config.{key}={cfg[key]!r}: pagoda loads 4-bit "
                                 f"checkpoints only")


def _group(cfg: dict, *keys: str) -> int:
    for key in keys:
        if key in cfg and cfg[key] is not None:
            value = cfg[key]
            if not isinstance(value, int) or (value <= 0 and value != -1):
                raise ModelLoadError(f"config.json quantization_config.{key}={value!r} must be a positive "
                                     f"integer or -1")
            return value
    return 128


class GptqConfig(PolicyConfig):
    name = "gptq"

    def __init__(self, cfg: dict):
        _bits(cfg, "bits")
        fmt = str(cfg.get("checkpoint_format") or cfg.get("format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ModelLoadError(f"config.json quantization_config.checkpoint_format={fmt!r} is not supported "
                                 f"(gptq, gptq_v2)")
        if cfg.get("modules_in_block_to_quantize"):
            raise ModelLoadError("config.json quantization_config.modules_in_block_to_quantize is not supported: "
                                 "pagoda quantizes every linear layer of a GPTQ checkpoint's blocks")
        super().__init__(cfg.get("modules_to_not_convert"), "modules_to_not_convert")
        self.group_size = _group(cfg, "group_size")
        self.kv_cache = declared_kv_cache_dtype(cfg)
        self.desc_act = bool(cfg.get("desc_act", False))
        self.v2 = fmt == "gptq_v2"

    def linear_method(self, layer, prefix):
        return GptqMethod(self.group_size, self.desc_act, self.v2)

    def moe_method(self, layer, prefix):
        raise _experts_unsupported("gptq", prefix)

    def describe(self) -> str:
        return f"gptq 4-bit, group {self.group_size}{', act-order' if self.desc_act else ''}"


class AwqConfig(PolicyConfig):
    name = "awq"

    def __init__(self, cfg: dict):
        _bits(cfg, "bits", "w_bit")
        version = str(cfg.get("version") or cfg.get("format") or "gemm").lower()
        if version != "gemm":
            raise ModelLoadError(f"config.json quantization_config.version={version!r}: pagoda reads AWQ's GEMM "
                                 f"layout only")
        if cfg.get("zero_point", True) is False:
            raise ModelLoadError("config.json quantization_config.zero_point=false: pagoda reads AWQ checkpoints "
                                 "with zero points only")
        super().__init__(cfg.get("modules_to_not_convert"), "modules_to_not_convert")
        self.group_size = _group(cfg, "group_size", "q_group_size")
        self.kv_cache = declared_kv_cache_dtype(cfg)

    def linear_method(self, layer, prefix):
        return AwqMethod(self.group_size)

    def moe_method(self, layer, prefix):
        raise _experts_unsupported("awq", prefix)

    def describe(self) -> str:
        return f"awq 4-bit, group {self.group_size}"
