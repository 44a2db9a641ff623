"""Building blocks for model files: parallel/quantizable linear layers, rotary embedding
with every scaling, RMSNorm, gated activations, vocab-parallel embedding and LM head,
attention over the paged cache (multi-head, MLA and DeepSeek's sparse MLA), the MoE layer and its
routing."""

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
from pagoda.layers.mla import MLAAttention
from pagoda.layers.moe import FusedMoE, FusedMoEMethod, UnquantizedFusedMoEMethod, expert_params_mapping
from pagoda.layers.moe_routing import Routing
from pagoda.layers.norm import RMSNorm
from pagoda.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_of
from pagoda.layers.sparse_mla import SparseMLAAttention

__all__ = [
    "Attention", "ColumnParallelLinear", "FusedMoE", "FusedMoEMethod", "GatedActivation", "LinearBase",
    "MLAAttention", "MergedColumnParallelLinear", "ParallelLMHead", "QKVParallelLinear", "RMSNorm",
    "ReplicatedLinear", "RotaryEmbedding", "Routing", "RowParallelLinear", "SiluAndMul", "SparseMLAAttention",
    "UnquantizedFusedMoEMethod", "UnquantizedLinearMethod", "VocabParallelEmbedding", "expert_params_mapping",
    "get_rope", "rope_parameters_of", "set_weight_attrs",
]
