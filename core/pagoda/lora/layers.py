"""The LoRA update on pagoda's linear layers: ``y = base(x) + expand(shrink(x))`` per row's adapter.

Each adapted ``LinearBase`` gets its quant method wrapped by ``LoRALinearMethod``: the base GEMM
runs once for the whole batch (quantized or not), then the kernel op ``lora_fused`` (shrink and
expand in one op: one launch on CUDA) adds every token's low-rank update from the slot its
sequence's adapter occupies (``ForwardContext.lora``). A platform without ``lora_fused`` runs its
``lora_shrink`` then its ``lora_expand``.
The update is added before a row-parallel layer's all-reduce and before a column-parallel
layer's gather, so tensor parallelism shards A and B as the base weight is sharded:
column-parallel layers keep A whole and split B's rows, row-parallel layers split A's columns
and keep B whole.

Fused layers (qkv_proj, gate_up_proj) stack their pieces: piece i's A occupies rank rows
``i*max_rank..`` of the slot's A and its B the matching block of the block-diagonal B.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda import kernels
from pagoda.errors import PluginError
from pagoda.forward_context import get_forward_context
from pagoda.interfaces import QuantMethod
from pagoda.layers.linear import LinearBase
from pagoda.lora.ops import two_kernel_update


def lora_update_op():
    """The platform's ``lora_fused`` where a plugin registers one; else the platform's ``lora_shrink`` then
    ``lora_expand``. (The core's ``pagoda.lora.ops.lora_fused`` reference is not registered for every platform:
    it would outrank a platform's own shrink and expand kernels.)"""
    try:
        return kernels.get_op("lora_fused")
    except PluginError:
        return two_kernel_update(kernels.get_op("lora_shrink"), kernels.get_op("lora_expand"))


class LoRALinearMethod(QuantMethod):
    """The layer's own method, then the LoRA update of the step's adapters."""

    def __init__(self, base: QuantMethod, num_slots: int, num_pieces: int, max_rank: int, input_size: int,
                 output_size: int, dtype: torch.dtype, device: torch.device):
        self.base = base
        self.num_pieces, self.max_rank = num_pieces, max_rank
        width = num_pieces * max_rank
        self.a_stack = torch.zeros(num_slots, width, input_size, dtype=dtype, device=device)  # [S, R, K]
        self.b_stack = torch.zeros(num_slots, output_size, width, dtype=dtype, device=device)  # [S, N, R]
        self.update = None  # the update op, resolved at the first step (kernels.activate comes first)

    def __getattr__(self, name):  # anything else a caller asks of the method is the base's
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def apply(self, layer, x, bias):
        y = self.base.apply(layer, x, bias)
        mapping = get_forward_context().lora
        if mapping is None or not mapping.active:
            return y
        shape = y.shape
        x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, shape[-1])
        if self.update is None:
            self.update = lora_update_op()
        # b_stack is block-diagonal over the pieces (write_piece): a kernel may skip the zero blocks
        pieces = tuple(layer.output_partition_sizes) if self.num_pieces > 1 else None
        return self.update(x2, y2, self.a_stack, self.b_stack, mapping.token_slots, mapping.token_order,
                           mapping.tiles, pieces).reshape(shape)

    # -- slots
    def clear_slot(self, slot: int) -> None:
        self.a_stack[slot].zero_()
        self.b_stack[slot].zero_()

    def write_piece(self, slot: int, piece: int, a: torch.Tensor, b: torch.Tensor, row_offset: int) -> None:
        """a [r, K_local], b [N_piece_local, r] (scaling folded in) into the slot."""
        r = a.shape[0]
        col = piece * self.max_rank
        self.a_stack[slot, col:col + r].copy_(a)
        self.b_stack[slot, row_offset:row_offset + b.shape[0], col:col + r].copy_(b)


def shard_lora_piece(layer: LinearBase, piece: int, a: torch.Tensor, b: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """This rank's (A, B, row offset in the layer's local output) of one piece of an adapted
    layer, sharded as the layer's weight: column-parallel splits B's rows (KV heads replicated
    over ranks take the head this rank holds), row-parallel splits A's columns."""
    sizes = layer.output_partition_sizes
    offset = sum(sizes[:piece])
    if layer.parallel == "column" and layer.tp_size > 1:
        size = sizes[piece]
        index = layer.tp_rank
        names = getattr(layer, "shard_names", ())
        if names and names[piece] in ("k", "v") and getattr(layer, "kv_replicas", 1) > 1:
            index = layer.tp_rank // layer.kv_replicas
        b = b.narrow(0, index * size, size)
    elif layer.parallel == "row" and layer.tp_size > 1:
        size = layer.input_size_per_partition
        a = a.narrow(1, layer.tp_rank * size, size)
    return a, b, offset


def piece_index(layer: LinearBase, shard_id) -> int:
    if shard_id is None:
        return 0
    return shard_id if isinstance(shard_id, int) else layer.shard_names.index(shard_id)


def adaptable_layers(model: nn.Module, stacked) -> dict[str, tuple[LinearBase, int]]:
    """Checkpoint module name (``model.layers.0.self_attn.q_proj``) -> (pagoda layer, piece) for
    every linear layer of the model; ``stacked``: (fused part, checkpoint part, shard id) as the
    model's weight loader uses (``pagoda.loader.weights.LLAMA_STACKED``)."""
    found: dict[str, tuple[LinearBase, int]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase):
            continue
        leaf = name.rsplit(".", 1)[-1]
        pieces = [(ckpt, shard) for fused, ckpt, shard in stacked if fused == leaf]
        if pieces and len(pieces) == len(module.output_sizes):
            for ckpt, shard in pieces:
                found[name[: len(name) - len(leaf)] + ckpt] = (module, piece_index(module, shard))
        elif len(module.output_sizes) == 1:
            found[name] = (module, 0)
    return found


def install_lora(model: nn.Module, stacked, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> dict[str, tuple[LinearBase, int]]:
    """Wrap the quant method of every adaptable linear layer (``layer.quant_method`` becomes a
    ``LoRALinearMethod``); returns ``adaptable_layers``."""
    found = adaptable_layers(model, stacked)
    for layer, _ in found.values():
        if isinstance(layer.quant_method, LoRALinearMethod):
            continue
        layer.quant_method = LoRALinearMethod(layer.quant_method, num_slots, len(layer.output_sizes), max_rank,
                                              layer.input_size_per_partition, sum(layer.output_partition_sizes),
                                              dtype, device)
    return found
