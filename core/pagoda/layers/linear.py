"""Linear layers that know their tensor-parallel shard and ask the quantizer for a method.

Column-parallel layers split the output dimension over the ranks, row-parallel layers the
input dimension (then all-reduce). Every parameter carries a ``weight_loader`` that takes
the full checkpoint tensor (and, for fused layers, which shard it is) and copies this
rank's slice; quantized methods mark their parameters with ``output_dim``/``input_dim``
(None when not split along that dim) and ``packed_factor`` for packed layouts.

Quantized layouts: ``packed_dim``/``packed_factor`` say that one stored element along that
dim covers ``packed_factor`` logical rows/columns (eight 4-bit values in an int32, or one
block scale per 128 rows), so fused-piece offsets along it are divided by the factor;
``per_shard=True`` marks a parameter holding one value per fused piece (FP8 per-tensor
scales), loaded at the piece's index. A method may give a parameter its own ``weight_loader``.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda import kernels
from pagoda.distributed import (
    get_tp_rank,
    get_tp_size,
    tensor_parallel_all_gather,
    tensor_parallel_all_reduce,
)
from pagoda.errors import ModelLoadError
from pagoda.interfaces import QuantConfig, QuantMethod


def set_weight_attrs(param: nn.Parameter, **attrs) -> None:
    for key, value in attrs.items():
        setattr(param, key, value)


class UnquantizedLinearMethod(QuantMethod):
    """Plain ``x @ W.T + b`` in the model dtype (the platform's ``linear`` kernel op)."""

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype),
                              requires_grad=False)
        set_weight_attrs(weight, output_dim=0, input_dim=1)
        layer.register_parameter("weight", weight)

    def apply(self, layer, x, bias):
        return kernels.get_op("linear")(x, layer.weight, bias)


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ModelLoadError(f"{what}={total} is not divisible by tensor_parallel_size={parts}")
    return total // parts


def check_shape(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if param.shape != loaded.shape:
        raise ModelLoadError(f"weight {name!r} has shape {tuple(loaded.shape)} in the checkpoint but the "
                             f"model expects {tuple(param.shape)} (check config.json against the weights)")


class LinearBase(nn.Module):
    """``output_sizes`` are the full (unsharded) sizes of the fused pieces, in order."""

    parallel: str | None = None  # "column", "row" or None (replicated)

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quant_config: QuantConfig | None = None, prefix: str = "",
                 params_dtype: torch.dtype | None = None):
        super().__init__()
        self.prefix = prefix
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size, self.output_sizes = input_size, list(output_sizes)
        self.output_size = sum(output_sizes)
        tp = self.tp_size
        if self.parallel == "column":
            self.input_size_per_partition = input_size
            self.output_partition_sizes = [_divide(s, tp, f"{prefix} output size") for s in output_sizes]
        elif self.parallel == "row":
            self.input_size_per_partition = _divide(input_size, tp, f"{prefix} input size")
            self.output_partition_sizes = list(output_sizes)
        else:
            self.input_size_per_partition = input_size
            self.output_partition_sizes = list(output_sizes)
        self.params_dtype = params_dtype or torch.get_default_dtype()
        method = quant_config.get_method(self, prefix) if quant_config is not None else None
        self.quant_method: QuantMethod = method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, self.input_size_per_partition, self.output_partition_sizes,
                                         self.params_dtype)
        for param in self.parameters(recurse=False):
            if getattr(param, "weight_loader", None) is None:  # a quant method may bring its own
                param.weight_loader = self.weight_loader
        if bias:
            rows = sum(self.output_partition_sizes) if self.parallel != "row" else self.output_size
            self.bias = nn.Parameter(torch.empty(rows, dtype=self.params_dtype), requires_grad=False)
            set_weight_attrs(self.bias, output_dim=0 if self.parallel != "row" else None, input_dim=None)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    # -- loading
    def _shard_offset(self, shard_id) -> tuple[int, int]:
        """(offset, size) of a fused piece in this rank's output rows."""
        index = shard_id if isinstance(shard_id, int) else self.shard_names.index(shard_id)
        sizes = self.output_partition_sizes
        return sum(sizes[:index]), sizes[index]

    shard_names: tuple = ()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if getattr(param, "per_shard", False):
            # one value per fused piece (e.g. an FP8 per-tensor scale): param [num_pieces]
            index = 0 if shard_id is None else (shard_id if isinstance(shard_id, int)
                                                else self.shard_names.index(shard_id))
            if loaded.numel() != 1:
                raise ModelLoadError(f"{self.prefix}: expected one value per piece, got shape {tuple(loaded.shape)}")
            param.data[index].copy_(loaded.reshape(()))
            return
        output_dim = getattr(param, "output_dim", None)
        input_dim = getattr(param, "input_dim", None)
        packed = getattr(param, "packed_factor", 1)
        packed_dim = getattr(param, "packed_dim", None)
        target = param.data
        if shard_id is not None and output_dim is not None:
            offset, size = self._shard_offset(shard_id)
            if packed_dim == output_dim:
                offset, size = offset // packed, size // packed
            target = target.narrow(output_dim, offset, size)
        if self.parallel == "column" and output_dim is not None and self.tp_size > 1:
            size = target.shape[output_dim]
            loaded = loaded.narrow(output_dim, self.tp_rank * size, size)
        if self.parallel == "row" and input_dim is not None and self.tp_size > 1:
            size = target.shape[input_dim]
            loaded = loaded.narrow(input_dim, self.tp_rank * size, size)
        if loaded.dim() == 0 and target.numel() == 1:
            loaded = loaded.reshape(target.shape)
        check_shape(target, loaded, self.prefix + (f" ({shard_id})" if shard_id is not None else ""))
        target.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, **kw):
        super().__init__(input_size, [output_size], **kw)


class ColumnParallelLinear(LinearBase):
    parallel = "column"

    def __init__(self, input_size: int, output_size: int, gather_output: bool = False, **kw):
        self.gather_output = gather_output
        super().__init__(input_size, [output_size], **kw)

    def forward(self, x):
        y = super().forward(x)
        return tensor_parallel_all_gather(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one matmul (e.g. gate_up_proj): shard i of
    ``output_sizes`` is loaded with ``shard_id=i``."""

    def __init__(self, input_size: int, output_sizes: list[int], **kw):
        self.gather_output = False
        LinearBase.__init__(self, input_size, output_sizes, **kw)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; shards "q", "k", "v". KV heads are replicated when there
    are fewer of them than ranks."""

    shard_names = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, v_head_size: int | None = None, **kw):
        tp = get_tp_size()
        self.head_size, self.v_head_size = head_size, v_head_size or head_size
        self.num_heads = _divide(total_num_heads, tp, "num_attention_heads")
        self.kv_replicas = max(1, tp // total_num_kv_heads) if total_num_kv_heads < tp else 1
        self.num_kv_heads = max(1, total_num_kv_heads // tp)
        self.gather_output = False
        sizes = [self.num_heads * head_size * tp, self.num_kv_heads * head_size * tp,
                 self.num_kv_heads * self.v_head_size * tp]
        LinearBase.__init__(self, hidden_size, sizes, **kw)

    def weight_loader(self, param, loaded, shard_id=None):
        output_dim = getattr(param, "output_dim", None)
        if shard_id in ("k", "v") and self.kv_replicas > 1 and output_dim is not None:
            # rank r holds kv head r // kv_replicas: slice it here, then load unsharded
            size = loaded.shape[output_dim] * self.kv_replicas // self.tp_size
            head = self.tp_rank // self.kv_replicas
            loaded = loaded.narrow(output_dim, head * size, size)
            offset, psize = self._shard_offset(shard_id)
            target = param.data.narrow(output_dim, offset, psize)
            check_shape(target, loaded, f"{self.prefix} ({shard_id})")
            target.copy_(loaded)
            return
        super().weight_loader(param, loaded, shard_id)


class RowParallelLinear(LinearBase):
    parallel = "row"

    def __init__(self, input_size: int, output_size: int, reduce_results: bool = True, **kw):
        self.reduce_results = reduce_results
        super().__init__(input_size, [output_size], **kw)

    def forward(self, x):
        bias = self.bias if self.tp_rank == 0 else None
        y = self.quant_method.apply(self, x, bias)
        return tensor_parallel_all_reduce(y) if self.reduce_results and self.tp_size > 1 else y
