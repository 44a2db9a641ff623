"""transformers' linears and embeddings replaced by pagoda's, split as ``base_model_tp_plan`` says.

Every ``nn.Linear`` of the base model becomes a pagoda linear layer, so quantization methods
apply to it and its ``weight_loader`` keeps this rank's slice of the checkpoint tensor. With
``tensor_parallel_size > 1`` the plan's style for the module's path decides the split:

| style | pagoda layer |
| --- | --- |
| ``colwise`` | ``ColumnParallelLinear``: output rows split, stays split |
| ``colwise_gather_output`` (``colwise_rep``) | ``ColumnParallelLinear(gather_output=True)`` |
| ``packed_colwise`` | two fused halves (gate and up) split each: ``MergedColumnParallelLinear`` |
| ``rowwise`` (``rowwise_rep``) | ``RowParallelLinear``: input split, all-reduced |
| ``rowwise_split_input`` | ``RowParallelLinear`` that takes the replicated input and keeps its slice |
| ``replicated_with_grad_allreduce``, ``embedding_rowwise`` | replicated / vocab-parallel (no change needed) |

The plain input embedding becomes a ``VocabParallelEmbedding`` and the LM head a
``ParallelLMHead`` (tied to it when the config ties them). Styles for expert weights
(``grouped_gemm``, ``moe_tp_experts``, ``ep_router``, ...) are not implemented: such models
run with ``tensor_parallel_size: 1``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pagoda.distributed import get_tp_size
from pagoda.errors import ModelLoadError
from pagoda.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagoda.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear

COLUMN = {"colwise": False, "colwise_gather_output": True, "colwise_rep": True}
ROW = ("rowwise", "rowwise_rep")
NO_CHANGE = ("replicated_with_grad_allreduce", "embedding_rowwise")
# with packed_colwise and rowwise_split_input: support.TP_STYLES


class RowParallelSplitInput(RowParallelLinear):
    """A row-parallel linear whose input arrives whole on every rank (e.g. after q/k norms over
    all heads): each rank multiplies its slice of the input features."""

    def forward(self, x):
        per = self.input_size_per_partition
        return super().forward(x.narrow(-1, self.tp_rank * per, per))


class PackedColumnParallelLinear(MergedColumnParallelLinear):
    """One checkpoint tensor holding two projections stacked on the output dim (gate and up):
    each half is split over the ranks like its own column-parallel projection."""

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is not None or getattr(param, "output_dim", None) is None:
            return super().weight_loader(param, loaded, shard_id)
        for index, half in enumerate(loaded.chunk(2, dim=param.output_dim)):
            super().weight_loader(param, half, index)


def plan_style(plan: dict[str, str], path: str) -> str | None:
    """The plan's style for a module path relative to the base model (``*`` matches one name part)."""
    for pattern, style in plan.items():
        if re.fullmatch(re.escape(pattern).replace(r"\*", r"[^.]+"), path):
            return style
    return None


def _linear(old: nn.Linear, style: str | None, prefix: str, quant_config: Any) -> nn.Module:
    kw = dict(bias=old.bias is not None, quant_config=quant_config, prefix=prefix, params_dtype=old.weight.dtype)
    if get_tp_size() == 1 or style is None or style in NO_CHANGE:
        return ReplicatedLinear(old.in_features, old.out_features, **kw)
    if style in COLUMN:
        return ColumnParallelLinear(old.in_features, old.out_features, gather_output=COLUMN[style], **kw)
    if style == "packed_colwise":
        if old.out_features % 2:
            raise ModelLoadError(f"{prefix}: packed_colwise needs an even output size, got {old.out_features}")
        return PackedColumnParallelLinear(old.in_features, [old.out_features // 2] * 2, **kw)
    if style in ROW:
        return RowParallelLinear(old.in_features, old.out_features, **kw)
    if style == "rowwise_split_input":
        return RowParallelSplitInput(old.in_features, old.out_features, **kw)
    raise ModelLoadError(f"{prefix}: base_model_tp_plan style {style!r} is not implemented by pagoda's transformers "
                         f"fallback; run this model with tensor_parallel_size 1")


def replace_linears(base: nn.Module, base_prefix: str, plan: dict[str, str] | None, quant_config: Any) -> None:
    """Swap every ``nn.Linear`` under ``base`` (whose checkpoint names start with ``base_prefix``)."""
    tp = get_tp_size()
    if tp > 1 and not plan:
        raise ModelLoadError("this model's transformers config has no base_model_tp_plan, so the transformers "
                             "fallback cannot split it over ranks; run it with tensor_parallel_size 1")
    plan = plan or {}
    if tp > 1:
        for path, module in base.named_modules():
            style = plan_style(plan, path) if path else None
            if style is not None and style not in NO_CHANGE and type(module) is not nn.Linear:
                raise ModelLoadError(f"{base_prefix}.{path}: base_model_tp_plan splits it ({style!r}) but it is a "
                                     f"{type(module).__name__}, which pagoda's transformers fallback cannot split; "
                                     f"run this model with tensor_parallel_size 1")
    for path, module in list(base.named_modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                full = f"{path}.{name}" if path else name
                module.add_module(name, _linear(child, plan_style(plan, full), f"{base_prefix}.{full}", quant_config))


def heads_split_of(attention: nn.Module) -> int:
    """How many ranks share an attention module's heads: all of them when a projection of it stays
    split after the matmul (plain ``colwise``), else none (its heads are computed whole)."""
    split = any(isinstance(m, ColumnParallelLinear) and not isinstance(m, PackedColumnParallelLinear)
                and not m.gather_output for m in attention.children())
    return get_tp_size() if split else 1


def replace_embeddings(hf_model: nn.Module, tied: bool) -> None:
    """Vocab-parallel input embedding and LM head (the same weight when ``tied``)."""
    names = {id(m): n for n, m in hf_model.named_modules()}
    embedding = hf_model.get_input_embeddings()
    if type(embedding) is nn.Embedding:
        parallel = VocabParallelEmbedding(embedding.num_embeddings, embedding.embedding_dim,
                                          prefix=names[id(embedding)], params_dtype=embedding.weight.dtype)
        hf_model.set_input_embeddings(parallel)
        embedding = parallel
    elif get_tp_size() > 1:
        pass  # an embedding with its own forward (e.g. scaled) stays whole on every rank
    head = hf_model.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise ModelLoadError(f"the output embedding of {type(hf_model).__name__} is a {type(head).__name__}; the "
                             f"transformers fallback needs a plain linear LM head")
    if tied and not isinstance(embedding, VocabParallelEmbedding):  # whole embedding: keep a whole, tied head
        head.weight = embedding.weight
        return
    lm_head = ParallelLMHead(head.out_features, head.in_features, bias=head.bias is not None,
                             prefix=names[id(head)], params_dtype=head.weight.dtype)
    if tied:
        lm_head.tie_to(embedding)
    hf_model.set_output_embeddings(lm_head)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the meta device (no memory, no init) and their
    buffers where torch's default device says: rotary frequencies and other computed buffers are
    real, the weights come from the checkpoint later."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def materialize(model: nn.Module, device: torch.device) -> None:
    """Parameters still on the meta device (transformers' own norms, biases, ...) get real storage
    (shared ones stay shared); the checkpoint fills them."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.device.type == "meta":
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(torch.empty_like(param, device=device), requires_grad=False)
                setattr(module, name, made[id(param)])
