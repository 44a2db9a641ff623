"""Vocabulary-parallel embedding and LM head: rank r holds rows [r*per, (r+1)*per) of the
vocabulary (padded so every rank holds ``per`` rows)."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.distributed import (
    get_tp_rank,
    get_tp_size,
    tensor_parallel_all_gather,
    tensor_parallel_all_reduce,
)
from pagoda.layers.linear import check_shape


class VocabParallelEmbedding(nn.Module):
    # A quantization method may hold the weight in its own form (one rank only): it then provides
    # ``embed(module, input_ids)`` and, for an LM head, ``apply(module, hidden, bias)``
    # (pagoda-quant's GGUF method on the CPU keeps the file's blocks).
    quant_method = None

    def __init__(self, num_embeddings: int, embedding_dim: int, prefix: str = "",
                 params_dtype: torch.dtype | None = None):
        super().__init__()
        self.prefix = prefix
        self.num_embeddings = num_embeddings
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.per_partition = -(-num_embeddings // self.tp_size)
        self.start = self.tp_rank * self.per_partition
        self.end = min(num_embeddings, self.start + self.per_partition)
        self.weight = nn.Parameter(torch.empty(self.per_partition, embedding_dim,
                                               dtype=params_dtype or torch.get_default_dtype()),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        expected = (self.num_embeddings, param.shape[1])
        if tuple(loaded.shape) != expected:
            check_shape(torch.empty(expected, device="meta"), loaded, self.prefix + ".weight")
        rows = loaded[self.start:self.end]
        param.data[: rows.shape[0]].copy_(rows)
        param.data[rows.shape[0]:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embed(self, input_ids)
        if self.tp_size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        mask = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(mask, input_ids - self.start, torch.zeros_like(input_ids))
        out = nn.functional.embedding(local, self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        return tensor_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection over the (sharded) vocabulary; may share its weight with the
    embedding (``tie_word_embeddings``)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, prefix: str = "",
                 params_dtype: torch.dtype | None = None):
        super().__init__(num_embeddings, embedding_dim, prefix, params_dtype)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.per_partition, dtype=self.weight.dtype), requires_grad=False)
            self.bias.weight_loader = self._bias_loader

    def _bias_loader(self, param, loaded, shard_id=None):
        rows = loaded[self.start:self.end]
        param.data[: rows.shape[0]].copy_(rows)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, vocab] (gathered over the ranks)."""
        if self.quant_method is not None:
            logits = self.quant_method.apply(self, hidden, self.bias)
        else:
            logits = nn.functional.linear(hidden, self.weight, self.bias)
        if self.tp_size > 1:
            logits = tensor_parallel_all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings]

    def forward(self, hidden):  # pragma: no cover - use compute_logits
        return self.compute_logits(hidden)
