"""The core rotary embedding against transformers' rotary modules, for every scaling.

Each case builds an HF config, runs transformers' own rotary module (which goes through
``ROPE_INIT_FUNCTIONS`` and, for LongRoPE and dynamic NTK, its per-length update) on a
sequence of ``seq_len`` tokens, applies it to random q/k the way the HF model does, and
checks pagoda's ``RotaryEmbedding`` (built from ``rope_parameters_of(config)``) rotates them
the same, with ``ForwardContext.token_seq_lens`` set to that sequence length.
"""

import pytest
import torch
from pagoda.forward_context import ForwardContext, set_forward_context
from pagoda.layers import get_rope, rope_parameters_of
from transformers import AutoConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3RotaryEmbedding,
    apply_rotary_pos_emb_interleave,
)
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as apply_partial_rotary

LLAMA = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
LONG_FACTORS = dict(short_factor=[1.0 + 0.05 * i for i in range(16)], long_factor=[1.0 + 0.6 * i for i in range(16)])

# name -> (model_type, config fields, rotary module, [sequence lengths to check])
CASES = {
    "default": ("llama", dict(LLAMA, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
                LlamaRotaryEmbedding, [128]),
    "linear": ("llama", dict(LLAMA, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
               LlamaRotaryEmbedding, [128]),
    # dynamic NTK: the plain frequencies up to max_position_embeddings; pagoda's long table is
    # transformers' frequencies at max_position_embeddings * factor
    "dynamic": ("llama", dict(LLAMA, max_position_embeddings=64,
                              rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
                LlamaRotaryEmbedding, [40, 64, 128]),
    "yarn": ("llama", dict(LLAMA, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                   "original_max_position_embeddings": 32}),
             LlamaRotaryEmbedding, [128]),
    "yarn-betas-attention-factor": (
        "llama", dict(LLAMA, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                              "original_max_position_embeddings": 32, "beta_fast": 16,
                                              "beta_slow": 2, "attention_factor": 1.3, "truncate": False}),
        LlamaRotaryEmbedding, [128]),
    "llama3": ("llama", dict(LLAMA, rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 32}),
               LlamaRotaryEmbedding, [128]),
    "longrope": ("phi3", dict(LLAMA, original_max_position_embeddings=32, pad_token_id=0,
                              rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, **LONG_FACTORS)),
                 Phi3RotaryEmbedding, [20, 32, 33, 128]),
    "longrope-partial": ("phi3", dict(LLAMA, original_max_position_embeddings=32, pad_token_id=0,
                                      rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                           partial_rotary_factor=0.5,
                                                           short_factor=LONG_FACTORS["short_factor"][:8],
                                                           long_factor=LONG_FACTORS["long_factor"][:8])),
                         Phi3RotaryEmbedding, [32, 100]),
}
DEEPSEEK = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, qk_rope_head_dim=16,
                qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=16, q_lora_rank=None, max_position_embeddings=128)
DEEPSEEK_CASES = {
    "deepseek-yarn-mscale": dict(DEEPSEEK, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                            "original_max_position_embeddings": 32, "beta_fast": 32,
                                                            "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.7}),
    "deepseek-default": dict(DEEPSEEK, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


def _pagoda_rotate(rope, positions, q, k, seq_len):
    lens = torch.full_like(positions, seq_len, dtype=torch.int32)
    with set_forward_context(ForwardContext(attn_metadata=None, backends={}, token_seq_lens=lens)):
        return rope(positions, q.clone(), k.clone())


@pytest.mark.parametrize("name", list(CASES))
def test_rotary_matches_transformers(name):
    model_type, fields, hf_cls, seq_lens = CASES[name]
    config = AutoConfig.for_model(model_type, **fields)
    head_dim = config.hidden_size // config.num_attention_heads
    params = rope_parameters_of(config)
    rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    rope = get_rope(head_dim, rotary_dim, config.max_position_embeddings, params, is_neox_style=True)
    gen = torch.Generator().manual_seed(0)
    for seq_len in seq_lens:
        positions = torch.arange(seq_len)
        q = torch.randn(seq_len, 2 * head_dim, generator=gen)
        k = torch.randn(seq_len, head_dim, generator=gen)
        cos, sin = hf_cls(config)(q, positions[None])
        hq, hk = apply_partial_rotary(q.view(1, seq_len, 2, head_dim).transpose(1, 2),
                                      k.view(1, seq_len, 1, head_dim).transpose(1, 2), cos, sin)
        pq, pk = _pagoda_rotate(rope, positions, q, k, seq_len)
        torch.testing.assert_close(pq, hq.transpose(1, 2).reshape(seq_len, -1), atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(pk, hk.transpose(1, 2).reshape(seq_len, -1), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("name", list(DEEPSEEK_CASES))
def test_deepseek_rotary_matches_transformers(name, interleave):
    config = AutoConfig.for_model("deepseek_v3", rope_interleave=interleave, **DEEPSEEK_CASES[name])
    dim, seq_len = config.qk_rope_head_dim, 128
    rope = get_rope(dim, dim, config.max_position_embeddings, rope_parameters_of(config), is_neox_style=not interleave)
    gen = torch.Generator().manual_seed(1)
    positions = torch.arange(seq_len)
    q = torch.randn(seq_len, 2 * dim, generator=gen)
    k = torch.randn(seq_len, dim, generator=gen)
    cos, sin = DeepseekV3RotaryEmbedding(config)(q, positions[None])
    apply = apply_rotary_pos_emb_interleave if interleave else apply_rotary_pos_emb
    hq, hk = apply(q.view(1, seq_len, 2, dim).transpose(1, 2), k.view(1, seq_len, 1, dim).transpose(1, 2), cos, sin)
    hq, hk = hq.transpose(1, 2), hk.transpose(1, 2)
    pq, pk = _pagoda_rotate(rope, positions, q, k, seq_len)
    pq, pk = pq.view(seq_len, 2, dim), pk.view(seq_len, 1, dim)
    if interleave:  # transformers returns the rotated pairs de-interleaved: [evens | odds]
        pq, pk = torch.cat((pq[..., 0::2], pq[..., 1::2]), -1), torch.cat((pk[..., 0::2], pk[..., 1::2]), -1)
    torch.testing.assert_close(pq, hq[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(pk, hk[0], atol=2e-5, rtol=1e-5)


def test_hub_and_transformers5_spellings_give_the_same_rope():
    """``rope_scaling`` + ``rope_theta`` (hub configs) and ``rope_parameters`` read the same."""
    hub = AutoConfig.for_model("phi3", **dict(LLAMA, original_max_position_embeddings=32, pad_token_id=0,
                                              rope_theta=5000.0,
                                              rope_scaling=dict(type="longrope", **LONG_FACTORS)))
    new = AutoConfig.for_model("phi3", **dict(LLAMA, original_max_position_embeddings=32, pad_token_id=0,
                                              rope_parameters=dict(rope_type="longrope", rope_theta=5000.0,
                                                                   **LONG_FACTORS)))
    a, b = rope_parameters_of(hub), rope_parameters_of(new)
    assert a["rope_type"] == b["rope_type"] == "longrope"
    assert a["rope_theta"] == b["rope_theta"] == 5000.0
    ra, rb = (get_rope(32, 32, 128, p) for p in (a, b))
    assert torch.equal(ra.cos_sin_cache, rb.cos_sin_cache)
