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

Where the platform has ``lora_expand_stacked`` (pagoda-cuda), a layer with a plain weight keeps it and every
slot's A in one tensor [N + S*R, K] (``stack_weights``; ``layer.weight`` and ``a_stack`` are views of it):
a step of at most ``lora_expand_stacked.max_tokens`` tokens runs one GEMM over the whole stack, which also
computes every slot's shrink, and the op adds the expand into the GEMM's output, returned as a view with
rows of N + S*R elements (made contiguous before a row-parallel layer's all-reduce). Larger steps run the
base GEMM over the view and ``lora_fused``.

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
from pagoda.layers.linear import LinearBase, UnquantizedLinearMethod
from pagoda.lora.ops import two_kernel_update


def lora_update_op():
    """The platform's ``lora_fused`` where a plugin registers one; else the platform's ``lora_shrink`` then
    ``lora_expand``. (The core's ``pagoda.lora.ops.lora_fused`` reference is not registered for every platform:
    it would outrank a platform's own shrink and expand kernels.)"""
    try:
        return kernels.get_op("lora_fused")
    except PluginError:
        return two_kernel_update(kernels.get_op("lora_shrink"), kernels.get_op("lora_expand"))


# steps of at most this many tokens use a layer's stack, unless the op says otherwise (``max_tokens``)
STACKED_MAX_TOKENS = 256


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
        self.stacked: torch.Tensor | None = None  # [N + S*R, K]: the weight above every slot's A (stack_weights)
        self.expand_stacked = None  # the platform's lora_expand_stacked, with a stack
        self._stacked_bias: tuple[torch.Tensor, torch.Tensor] | None = None  # (bias, bias padded with zeros)

    def __getattr__(self, name):  # anything else a caller asks of the method is the base's
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def apply(self, layer, x, bias):
        mapping = get_forward_context().lora
        if mapping is None or not mapping.active:
            return self.base.apply(layer, x, bias)
        x2 = x.reshape(-1, x.shape[-1])
        # b_stack is block-diagonal over the pieces (write_piece): a kernel may skip the zero blocks
        pieces = tuple(layer.output_partition_sizes) if self.num_pieces > 1 else None
        if self.stacked is not None and x2.shape[0] <= getattr(self.expand_stacked, "max_tokens", STACKED_MAX_TOKENS):
            n = self.b_stack.shape[1]
            out = kernels.get_op("linear")(x2, self.stacked, self._padded(bias))
            y = self.expand_stacked(out, n, self.b_stack, mapping.token_slots, mapping.token_order, mapping.tiles,
                                    pieces)
            if layer.parallel == "row" and layer.tp_size > 1:
                y = y.contiguous()  # (the all-reduce takes contiguous tensors)
            return y.reshape(*x.shape[:-1], n)
        y = self.base.apply(layer, x, bias)
        shape = y.shape
        if self.update is None:
            self.update = lora_update_op()
        return self.update(x2, y.reshape(-1, shape[-1]), self.a_stack, self.b_stack, mapping.token_slots,
                           mapping.token_order, mapping.tiles, pieces).reshape(shape)

    def stack_weights(self, layer: LinearBase, expand_stacked) -> bool:
        """Put the layer's plain weight W [N, K] and every slot's A in one tensor [N + S*R, K] (W and
        ``a_stack`` become views of it) for ``expand_stacked``; False (nothing changed) for a quantized
        or otherwise special weight, or a stack with more extra rows than W has (the GEMM would then pay
        more for the slots' shrinks than the separate update costs)."""
        w = getattr(layer, "weight", None)
        s, width, k = self.a_stack.shape
        if (type(self.base) is not UnquantizedLinearMethod or not isinstance(w, torch.Tensor) or w.dim() != 2
                or w.dtype != self.a_stack.dtype or w.shape != (self.b_stack.shape[1], k) or s * width > w.shape[0]):
            return False
        n = w.shape[0]
        stacked = torch.empty(n + s * width, k, dtype=w.dtype, device=w.device)
        stacked[:n].copy_(w.data)
        stacked[n:].copy_(self.a_stack.reshape(s * width, k))
        w.data = stacked[:n]
        self.a_stack = stacked[n:].view(s, width, k)
        self.stacked, self.expand_stacked = stacked, expand_stacked
        return True

    def _padded(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        """The layer's bias with zeros for the stack's extra columns (made once)."""
        if bias is None:
            return None
        if self._stacked_bias is None or self._stacked_bias[0] is not bias:
            pad = bias.new_zeros(self.stacked.shape[0] - bias.shape[0])
            self._stacked_bias = (bias, torch.cat([bias, pad]))
        return self._stacked_bias[1]

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
    expand_stacked = lora_stacked_op()
    for layer, _ in found.values():
        if isinstance(layer.quant_method, LoRALinearMethod):
            continue
        method = LoRALinearMethod(layer.quant_method, num_slots, len(layer.output_sizes), max_rank,
                                  layer.input_size_per_partition, sum(layer.output_partition_sizes), dtype, device)
        layer.quant_method = method
        if expand_stacked is not None:
            method.stack_weights(layer, expand_stacked)
    return found


def lora_stacked_op():
    """The platform's ``lora_expand_stacked`` (None where no plugin registers one: the core does not, its
    reference ``pagoda.lora.ops.lora_expand_stacked`` states the op's result)."""
    try:
        op = kernels.get_op("lora_expand_stacked")
    except PluginError:
        return None
    return op
