"""Per-step state the layers read while the model runs: attention metadata and the backend.

Model code never takes attention metadata as an argument; the runner sets the context
around ``model.forward(input_ids, positions)`` and the Attention layer reads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """A flattened batch: ``num_decodes`` one-token sequences first, then prefill chunks.

    Device tensors:
      query_start_loc [B+1] int32  token offsets of each sequence in the batch
      seq_lens        [B]   int32  tokens in the cache after this step (context + new)
      block_tables    [B, max_blocks] int32  cache block ids, padded with 0
      slot_mapping    [T]   int64  cache slot (block * block_size + offset) of each new token
    Host copies (``*_cpu``, python lists) serve reference backends and metadata building.
    """

    num_tokens: int
    num_seqs: int
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    for_graph: bool = False  # captured in a graph: host values may be stale, use tensors only
    # (with for_graph) a captured batch that mixes prefill chunks with decodes (pagoda.engine.mixed_graphs):
    # num_tokens / num_seqs are capacities and num_decodes is known on the device only (the backend's state)
    mixed_graph: bool = False
    backend_data: Any = None

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    @property
    def num_prefills(self) -> int:
        return self.num_seqs - self.num_decodes


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    backends: dict[str, Any]  # attention kind ("mha"/"mla") -> selected AttentionBackend
    # Per-token sequence length the token is computed at: max(prompt length, position + 1)
    # (the whole prompt for prompt tokens, however it is chunked; position + 1 for generated
    # tokens, also when recomputed after preemption). Read by length-dependent rotary scaling.
    token_seq_lens: torch.Tensor | None = None
    # MoE layers add per-expert token counts here: layer prefix -> LongTensor [num_experts]
    expert_counts: dict[str, torch.Tensor] = field(default_factory=dict)
    # (tokens, top_k) -> per-pair count weights, shared by the step's MoE layers (layers.moe)
    moe_pair_weights: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    # debug hook: attention-map captures (pagoda attention-map); None in normal runs
    attention_probe: Any = None
    # attention kind -> the metadata its backend prepared (``backend_data`` is per backend); kinds
    # missing here read ``attn_metadata``
    metadata_by_kind: dict[str, AttentionMetadata] = field(default_factory=dict)
    # (kind, KV cache group > 0) -> that group's metadata: its own block tables and slot mapping
    # (``pagoda.engine.kv_groups``; models mixing sliding-window and global layers)
    group_metadata: dict[tuple[str, int], AttentionMetadata] = field(default_factory=dict)
    # the step's LoRA adapters (pagoda.lora.manager.LoRAMapping: token -> slot); None without adapters
    lora: Any = None

    def metadata_for(self, kind: str, group: int = 0) -> AttentionMetadata | None:
        if group:
            return self.group_metadata[(kind, group)]
        return self.metadata_by_kind.get(kind, self.attn_metadata)


def prepared_context(meta: AttentionMetadata, backends: dict[str, Any],
                     group_tables: list[tuple[torch.Tensor, torch.Tensor]] | None = None, **kw: Any) -> ForwardContext:
    """A ForwardContext where each selected backend has run ``prepare`` on its own view of the
    step's metadata (a model with both MHA and MLA layers keeps both backends' data), and on
    each further KV cache group's view (``group_tables``: (block_tables, slot_mapping) of
    groups 1..)."""
    by_kind, by_group = {}, {}
    for kind, backend in backends.items():
        own = meta if len(backends) == 1 else dataclasses.replace(meta)
        own.backend_data = backend.prepare(own)
        by_kind[kind] = own
        for group, (tables, slots) in enumerate(group_tables or (), 1):
            view = dataclasses.replace(meta, block_tables=tables, slot_mapping=slots)
            view.backend_data = backend.prepare(view)
            by_group[(kind, group)] = view
    return ForwardContext(attn_metadata=meta, backends=backends, metadata_by_kind=by_kind, group_metadata=by_group,
                          **kw)


_CONTEXT: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("no forward context: model.forward must run inside pagoda's ModelRunner "
                           "(or pagoda.forward_context.set_forward_context)")
    return _CONTEXT


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ctx
    try:
        yield ctx
    finally:
        _CONTEXT = prev
