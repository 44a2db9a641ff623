"""Building blocks for model files: parallel/quantizable linear layers, rotary embedding
with every scaling, RMSNorm, gated activations, vocab-parallel embedding and LM head,
attention over the paged cache."""

from pagoda.layers.activation import GatedActivation, SiluAndMul
from pagoda.layers.attention import Attention
from pagoda.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagoda.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
    set_weight_attrs,
)
from pagoda.layers.norm import RMSNorm
from pagoda.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_of

__all__ = [
    "Attention", "ColumnParallelLinear", "GatedActivation", "LinearBase", "MergedColumnParallelLinear",
    "ParallelLMHead", "QKVParallelLinear", "RMSNorm", "ReplicatedLinear", "RotaryEmbedding",
    "RowParallelLinear", "SiluAndMul", "UnquantizedLinearMethod", "VocabParallelEmbedding", "get_rope",
    "rope_parameters_of", "set_weight_attrs",
]
