"""Speculative method "mtp": DeepSeek-V3's multi-token-prediction layer, loaded from the checkpoint
(model.layers.{num_hidden_layers}.*), drafts; greedy outputs stay those of plain decoding and of
transformers, with chunked prefill and preemption."""

import pytest
import torch
from pagoda import LLM, SamplingParams
from pagoda.errors import ConfigError
from pagoda.testing import check_greedy, hf_greedy_tokens, make_tiny_checkpoint, random_prompts
from safetensors.torch import load_file, save_file

VOCAB = 260
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=256, moe_intermediate_size=32, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, first_k_dense_replace=1, q_lora_rank=32,
            n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
            num_nextn_predict_layers=1)


def add_mtp_layer(path, num_layers: int, seed: int = 0, bigram: bool = False) -> None:
    """A full MTP layer as real checkpoints carry it: a decoder layer (a copy of the last one), enorm,
    hnorm, eh_proj and shared_head.norm (its head and embedding: the main model's).

    ``bigram``: every layer's output projections (attention, dense, routed and shared experts) are
    zero, so the target's next token depends on the current token only, and the MTP layer's eh_proj
    passes its token embedding through: it then predicts exactly what the target will (acceptance 1
    by construction, which checks that position p reads token p + 1 and that drafts chain)."""
    tensors = load_file(str(path / "model.safetensors"))
    last, mtp = f"layers.{num_layers - 1}.", f"layers.{num_layers}."
    extra = {name.replace(last, mtp): t.clone() for name, t in tensors.items() if last in name}
    gen = torch.Generator().manual_seed(seed)
    hidden = TINY["hidden_size"]
    extra[f"model.{mtp}eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.05
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        extra[f"model.{mtp}{norm}.weight"] = torch.ones(hidden)
    if bigram:
        extra[f"model.{mtp}eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
        extra[f"model.{mtp}shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
        for name, t in [*tensors.items(), *extra.items()]:
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                t.zero_()
    save_file({**tensors, **extra}, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = make_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("mtp"), seed=4, randomize_buffers=True, **TINY)
    add_mtp_layer(path, TINY["num_hidden_layers"])
    return path


def test_mtp_greedy_equals_transformers_with_chunked_prefill_and_preemption(checkpoint):
    prompts = random_prompts(4, VOCAB, 6, 40, seed=5)
    expected = hf_greedy_tokens(checkpoint, prompts, 20)
    result, llm = check_greedy(checkpoint, prompts, 20, expected=expected,
                               engine={"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}})
    result.assert_passed()
    stats = llm.get_stats()["speculative"]
    assert stats["draft_tokens"] > 0 and len(stats["per_position_acceptance"]) == 2, stats
    assert type(llm.engine.speculative.proposer.runner.model).__name__ == "DeepSeekMTPModel"


def test_mtp_drafts_what_the_target_decodes_when_built_to(tmp_path):
    path = make_tiny_checkpoint("deepseek_v3", tmp_path, seed=4, **TINY)
    add_mtp_layer(path, TINY["num_hidden_layers"], bigram=True)
    prompts = random_prompts(3, VOCAB, 6, 20, seed=8)
    plain = LLM(model=str(path), device="cpu", dtype="float32", block_size=8, num_kv_blocks=64)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, SamplingParams(temperature=0, max_tokens=16,
                                                                                  ignore_eos=True))]
    llm = LLM(model=str(path), device="cpu", dtype="float32", block_size=8, num_kv_blocks=64,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16,
                                                                                 ignore_eos=True))]
    assert got == want
    stats = llm.get_stats()["speculative"]
    assert stats["acceptance_rate"] > 0.95 and stats["mean_accepted_length"] > 3, stats


def test_mtp_sampled_and_mixed_requests(checkpoint):
    # (no prefix cache: a sequence whose prompt is served from it does not speculate with mtp, and a seeded
    # sampled stream is reproducible for the same speculation decisions)
    llm = LLM(model=str(checkpoint), device="cpu", dtype="float32", block_size=8, num_kv_blocks=64,
              enable_prefix_caching=False, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    prompts = random_prompts(3, VOCAB, 6, 20, seed=6)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]
    a = llm.generate(prompts, params)
    b = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert [len(o.outputs[0].token_ids) for o in a] == [12, 12, 5]
    assert llm.get_stats()["kv_blocks_used"] == 0
    assert llm.get_stats()["speculative"]["draft_tokens"] > 0


def test_mtp_needs_mtp_layers(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path, seed=1, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    with pytest.raises(ConfigError, match="method 'mtp' needs a model with multi-token-prediction layers"):
        LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=16,
            speculative_config={"method": "mtp"})
