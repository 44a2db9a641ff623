"""The adapters an engine serves: a CPU cache of loaded adapters and a device slot pool.

``max_loras`` slots hold adapters on the device; a step's adapters are made resident before
it runs, evicting the least recently used adapter that the step does not need (the scheduler
never runs more distinct adapters in one step than there are slots). ``max_cpu_loras``
adapters stay parsed in host memory (least recently used dropped first; a dropped one is
read from its directory again when next asked for).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagoda.kernels.host_upload import upload
from pagoda.lora.layers import LoRALinearMethod, install_lora, shard_lora_piece
from pagoda.lora.ops import token_tiles
from pagoda.lora.peft_format import LoRAAdapter, LoRAError, load_peft_adapter
from pagoda.lora.request import LoRARequest

logger = logging.getLogger("pagoda")


@dataclass
class LoRAMapping:
    """What the layers read from ``ForwardContext.lora`` for one step."""

    token_slots: torch.Tensor  # [T] int64 on the device: the slot of each token's adapter, -1 for the base
    active: bool  # any token uses an adapter (else the layers skip the update)
    # the kernels' work list (pagoda.lora.ops): [T] int64 tokens sorted by slot (stable) and [3, NT]
    # int64 tiles of them that share one adapter; None: the kernels work them out themselves
    token_order: torch.Tensor | None = None
    tiles: torch.Tensor | None = None


class LoRAManager:
    def __init__(self, model: nn.Module, stacked, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None,
                 dtype: torch.dtype, device: torch.device):
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.device = device
        self.layers = install_lora(model, stacked, max_loras, max_lora_rank, dtype, device)
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()  # id -> parsed adapter, LRU first
        self.known: dict[int, LoRARequest] = {}  # every id seen: where to reload it from
        self.slots: OrderedDict[int, int] = OrderedDict()  # id -> slot, LRU first
        self.loads = 0  # adapters read from disk (tests check eviction and reload)

    # ------------------------------------------------------------------ host side
    def load(self, request: LoRARequest) -> LoRAAdapter:
        """Parse and check an adapter (from the CPU cache when there). Raises LoRAError."""
        seen = self.known.get(request.lora_int_id)
        if seen is not None and (seen.lora_path, seen.lora_name) != (request.lora_path, request.lora_name):
            raise LoRAError(f"lora_int_id {request.lora_int_id} is already adapter {seen.lora_name!r} at "
                            f"{seen.lora_path!r}; give {request.lora_name!r} its own id")
        adapter = self.cpu.get(request.lora_int_id)
        if adapter is not None:
            self.cpu.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_peft_adapter(request.lora_path, request.lora_name, request.lora_int_id)
        self.loads += 1
        if adapter.rank > self.max_lora_rank:
            raise LoRAError(f"LoRA adapter {request.lora_name!r} has rank r={adapter.rank}, more than "
                            f"max_lora_rank={self.max_lora_rank} (raise max_lora_rank)")
        missing = sorted(set(adapter.weights) - set(self.layers))
        if missing:
            raise LoRAError(f"LoRA adapter {request.lora_name!r} targets module(s) {missing[:3]} that are not "
                            f"linear layers of this model (adaptable: q/k/v/o_proj, gate/up/down_proj)")
        for module, (a, b) in adapter.weights.items():
            layer, _ = self.layers[module]
            want = (layer.output_sizes[self.layers[module][1]], layer.input_size)
            if (b.shape[0], a.shape[1]) != want:
                raise LoRAError(f"LoRA adapter {request.lora_name!r}: module {module!r} is [{b.shape[0]}, "
                                f"{a.shape[1]}] in the adapter but [{want[0]}, {want[1]}] in the model (an adapter "
                                f"of another base model?)")
        self.known[request.lora_int_id] = request
        self.cpu[request.lora_int_id] = adapter
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)
        return adapter

    def remove(self, lora_int_id: int) -> None:
        """Drop an adapter (unloaded by the server): its CPU copy and its slot. Its id stays known
        (sequences still running with it reload it; ids are never reused)."""
        self.cpu.pop(lora_int_id, None)
        slot = self.slots.pop(lora_int_id, None)
        if slot is not None:
            self._clear(slot)

    # ------------------------------------------------------------------ device side
    def _clear(self, slot: int) -> None:
        for layer, _ in self.layers.values():
            layer.quant_method.clear_slot(slot)

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        self._clear(slot)
        for module, (a, b) in adapter.weights.items():
            layer, piece = self.layers[module]
            method: LoRALinearMethod = layer.quant_method
            a_local, b_local, offset = shard_lora_piece(layer, piece, a, b * adapter.scaling)
            method.write_piece(slot, piece, a_local.to(self.device), b_local.to(self.device), offset)

    def activate(self, requests: list[LoRARequest]) -> dict[int, int]:
        """Make these adapters resident (at most ``max_loras`` distinct); id -> slot."""
        wanted = {r.lora_int_id: r for r in requests}
        if len(wanted) > self.max_loras:
            raise LoRAError(f"a step uses {len(wanted)} adapters, more than max_loras={self.max_loras}")
        for lora_id in wanted:
            if lora_id in self.slots:
                self.slots.move_to_end(lora_id)
        for lora_id, request in wanted.items():
            if lora_id in self.slots:
                continue
            used = set(self.slots.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(i for i in self.slots if i not in wanted)
                slot = self.slots.pop(victim)
                logger.debug("lora: adapter %d leaves slot %d for %d", victim, slot, lora_id)
            self._write(slot, self.load(request))
            self.slots[lora_id] = slot
        return {i: self.slots[i] for i in wanted}

    def sequence_slots(self, plan) -> np.ndarray | None:
        """The slot of each planned row's adapter (-1: the base), its adapters made resident (registered
        here by ``load``: the plan names them by id); None when no row uses one."""
        ids = [r.lora_int_id for r in plan.rows]
        if not any(ids):
            return None
        slots = self.activate([self.known[i] for i in dict.fromkeys(ids) if i])
        return np.fromiter((slots[i] if i else -1 for i in ids), np.int64, len(ids))

    def mapping(self, plan) -> LoRAMapping | None:
        """The step's token -> slot map (None when no planned row uses an adapter)."""
        per_seq = self.sequence_slots(plan)
        if per_seq is None:
            return None
        counts = np.fromiter((r.num_new_tokens for r in plan.rows), np.int64, len(plan.rows))
        token_slots = np.repeat(per_seq, counts)
        order = np.argsort(token_slots, kind="stable")
        tiles = token_tiles(token_slots[order])
        t = len(token_slots)
        packed = upload(np.concatenate([token_slots, order, tiles.ravel()]), self.device)  # one copy
        return LoRAMapping(packed[:t], True, packed[t:2 * t], packed[2 * t:].view(3, -1))
