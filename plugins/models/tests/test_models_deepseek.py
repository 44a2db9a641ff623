"""DeepSeek-V3 against transformers: MLA with a latent KV cache, grouped sigmoid routing."""

import pytest
import torch
from pagoda import LLM, SamplingParams
from pagoda.attention.torch_mla import TorchMLAAttention
from pagoda.testing import (
    assert_greedy_matches,
    assert_kv_bytes_per_token,
    assert_prompt_logits_match,
    assert_weights_consumed,
    hf_expert_counts,
    make_tiny_checkpoint,
    random_prompts,
)
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

VOCAB = 320
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=256, moe_intermediate_size=32, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, first_k_dense_replace=1)
YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
VARIANTS = {
    # q_lora, YaRN with mscale (softmax scale too), interleaved rope, 4 groups of 4 experts keeping 2,
    # a random e_score_correction_bias, one shared expert, and an MTP layer in the checkpoint
    "q_lora-yarn-groups": dict(TINY, q_lora_rank=32, n_routed_experts=16, num_experts_per_tok=3, n_group=4,
                               topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, rope_parameters=YARN,
                               rope_interleave=True),
    # no q_lora (q_proj), plain rope, not interleaved, one group, two shared experts, no renormalisation
    "no_q_lora-plain": dict(TINY, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
                            topk_group=1, n_shared_experts=2, norm_topk_prob=False, routed_scaling_factor=1.5,
                            rope_interleave=False),
}
LOGIT_TOL = 1e-4  # float32, absolute and relative; observed differences are ~1e-6


def _add_mtp_layer(path, num_layers):
    """Real checkpoints carry the multi-token-prediction layer as model.layers.{num_layers}.*"""
    tensors = load_file(str(path / "model.safetensors"))
    extra = {name.replace(f"layers.{num_layers - 1}.", f"layers.{num_layers}."): t.clone()
             for name, t in tensors.items() if f"layers.{num_layers - 1}." in name}
    extra[f"model.layers.{num_layers}.eh_proj.weight"] = torch.zeros(64, 128)
    extra[f"model.layers.{num_layers}.enorm.weight"] = torch.ones(64)
    save_file({**tensors, **extra}, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    fields = VARIANTS[request.param]
    path = make_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp(request.param), seed=4,
                                randomize_buffers=True, **fields)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    if request.param.startswith("q_lora"):
        _add_mtp_layer(path, fields["num_hidden_layers"])
    return path, hf, fields


def test_prompt_logits_match_transformers(tiny):
    path, hf, _ = tiny
    assert hf.model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8)
    # one prompt longer than the YaRN original length
    assert_prompt_logits_match(llm, path, random_prompts(2, VOCAB, 9, 90, seed=3), hf_model=hf, atol=LOGIT_TOL,
                               rtol=LOGIT_TOL)


def test_greedy_batch_with_chunked_prefill_and_preemption(tiny):
    path, hf, _ = tiny
    prompts = random_prompts(6, VOCAB, 5, 45, seed=7)
    assert max(map(len, prompts)) > 24  # longer than the step budget below: chunked
    # 10 blocks of 8 tokens for six sequences of up to 77 tokens: the helper asserts that a
    # sequence was preempted and that every KV block was freed
    assert_greedy_matches(path, prompts, 32, hf_model=hf, engine=dict(num_kv_blocks=10, block_size=8,
                                                                      max_num_batched_tokens=24, max_model_len=80,
                                                                      enable_prefix_caching=False))


def test_kv_cache_holds_the_latent(tiny):
    """Per token and layer the cache holds kv_lora_rank + qk_rope_head_dim values, not K and V."""
    path, _, fields = tiny
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        llm = LLM(model=str(path), device="cpu", dtype=dtype, num_kv_blocks=16, block_size=8, max_model_len=128)
        runner = llm.engine.runner
        latent = fields["kv_lora_rank"] + fields["qk_rope_head_dim"]
        assert_kv_bytes_per_token(llm, expected=fields["num_hidden_layers"] * latent * size)
        assert_kv_bytes_per_token(llm)  # what pagoda.testing infers from the config agrees
        assert all(tuple(c.shape) == (16, 8, latent) for c in runner.kv_caches)
        assert {layer.spec.kind for layer in runner.attn_layers} == {"mla"}
        assert runner.backends["mla"].name == "torch_mla"


def test_every_checkpoint_tensor_is_loaded(tiny):
    """Also the multi-token-prediction layer the q_lora checkpoint carries: read (and skipped)."""
    path, _, _ = tiny
    assert_weights_consumed(path)


def test_expert_counts_match_the_routers_choices(tiny):
    path, hf, fields = tiny
    prompts = random_prompts(4, VOCAB, 4, 30, seed=11)
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8,
              enable_prefix_caching=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    fed = [p + o.outputs[0].token_ids[:-1] for p, o in zip(prompts, outs)]
    expected = {name.replace(".gate", ".experts"): counts for name, counts in hf_expert_counts(path, fed, hf).items()}
    assert list(expected) == ["model.layers.1.mlp.experts"]  # layer 0 is dense (first_k_dense_replace)
    assert llm.get_stats()["expert_load"]["layers"] == expected


def test_absorbed_decode_equals_expanded_attention():
    """The two MLA paths of the torch backend (latent attention with absorbed projections for
    decodes, expanded K/V for prefills) compute the same attention."""
    gen = torch.Generator().manual_seed(0)
    n, p, r, v, lora, s = 3, 8, 4, 6, 10, 9
    q_nope, q_pe = torch.randn(2, n, p, generator=gen), torch.randn(2, n, r, generator=gen)
    latent, rope = torch.randn(s, lora, generator=gen), torch.randn(s, r, generator=gen)
    w = torch.randn(n, p + v, lora, generator=gen)
    w_uk, w_uv = w[:, :p], w[:, p:]
    absorbed, _ = TorchMLAAttention._absorbed(q_nope, q_pe, latent, rope, w_uk, w_uv, 0.3, s - 2)
    expanded, _ = TorchMLAAttention._expanded(q_nope, q_pe, latent, rope, w_uk, w_uv, 0.3, s - 2)
    torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=1e-5)
    # and both equal attention written out with expanded per-head keys and values
    k = torch.cat((torch.einsum("sl,hpl->hsp", latent, w_uk), rope.expand(n, s, r)), -1)
    vals = torch.einsum("sl,hvl->hsv", latent, w_uv)
    scores = torch.einsum("qhd,hsd->hqs", torch.cat((q_nope, q_pe), -1), k) * 0.3
    scores[:, 0, s - 1] = float("-inf")  # the first query sits one position before the last key
    ref = torch.einsum("hqs,hsv->qhv", scores.softmax(-1), vals)
    torch.testing.assert_close(absorbed, ref, atol=1e-5, rtol=1e-5)
