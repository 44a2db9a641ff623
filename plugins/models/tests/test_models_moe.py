"""Qwen2-MoE and Qwen3-MoE against transformers, and the core MoE pieces (routing, fused_moe,
expert weight loading, expert statistics)."""

import json

import pytest
import torch
from pagoda import LLM, SamplingParams
from pagoda.engine.expert_stats import expert_load_summary
from pagoda.kernels.reference import fused_moe
from pagoda.layers import FusedMoE, Routing
from pagoda.testing import (
    assert_greedy_matches,
    assert_kv_bytes_per_token,
    assert_prompt_logits_match,
    assert_weights_consumed,
    hf_expert_counts,
    hf_prompt_logits,
    make_tiny_checkpoint,
    random_prompts,
)
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

VOCAB = 320
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, moe_intermediate_size=32)
VARIANTS = {
    # shared expert with its sigmoid gate; layer 1 dense through mlp_only_layers
    "qwen2_moe-shared": ("qwen2_moe", dict(TINY, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                                           shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    # no shared expert (size 0), renormalised top-k, only odd layers sparse (decoder_sparse_step 2)
    "qwen2_moe-noshared": ("qwen2_moe", dict(TINY, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                                             shared_expert_intermediate_size=0, norm_topk_prob=True,
                                             decoder_sparse_step=2)),
    "qwen3_moe": ("qwen3_moe", dict(TINY, head_dim=32, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True)),
}
# shared_expert_intermediate_size=0 makes transformers build empty Linear layers
pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
LOGIT_TOL = 1e-4  # float32, absolute and relative; observed differences are ~1e-6


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    model_type, fields = VARIANTS[request.param]
    path = make_tiny_checkpoint(model_type, tmp_path_factory.mktemp(request.param), seed=2, **fields)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, hf


def test_prompt_logits_match_transformers(tiny):
    path, hf = tiny
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8)
    assert_prompt_logits_match(llm, path, random_prompts(2, VOCAB, 7, 40, seed=3), hf_model=hf, atol=LOGIT_TOL,
                               rtol=LOGIT_TOL)
    assert_kv_bytes_per_token(llm)


def test_greedy_batch_with_chunked_prefill_and_preemption(tiny):
    path, hf = tiny
    prompts = random_prompts(6, VOCAB, 5, 45, seed=7)
    assert max(map(len, prompts)) > 24  # longer than the step budget below: chunked
    # 10 blocks of 8 tokens for six sequences of up to 77 tokens: the helper asserts that a
    # sequence was preempted and that every KV block was freed
    assert_greedy_matches(path, prompts, 32, hf_model=hf, engine=dict(num_kv_blocks=10, block_size=8,
                                                                      max_num_batched_tokens=24, max_model_len=80,
                                                                      enable_prefix_caching=False))


def test_every_checkpoint_tensor_is_loaded(tiny):
    """Every per-expert tensor (and the shared expert's, with its gate) is read and lands in a parameter."""
    path, _ = tiny
    assert_weights_consumed(path)


def test_expert_counts_match_the_routers_choices(tiny):
    """Per-layer expert loads reported by the engine equal a count made by hooking
    transformers' routers over the same tokens (each prompt plus the generated tokens
    that were fed back, i.e. all but the last)."""
    path, hf = tiny
    prompts = random_prompts(5, VOCAB, 4, 30, seed=11)
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8,
              max_num_batched_tokens=16, enable_prefix_caching=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    stats = llm.get_stats()
    assert stats["num_preemptions"] == 0
    fed = [p + o.outputs[0].token_ids[:-1] for p, o in zip(prompts, outs)]
    expected = {name.replace(".gate", ".experts"): counts for name, counts in hf_expert_counts(path, fed, hf).items()}
    load = stats["expert_load"]
    assert load["layers"] == expected
    k = hf.config.num_experts_per_tok
    assert all(sum(c) == k * sum(map(len, fed)) for c in expected.values())
    per_layer = [max(c) / (sum(c) / len(c)) for c in expected.values()]
    assert load["max_over_mean"] == pytest.approx(sum(per_layer) / len(per_layer))
    assert load["active_share"] == pytest.approx(
        sum(v > 0 for c in expected.values() for v in c) / sum(len(c) for c in expected.values()))
    assert load["total"] == [sum(col) for col in zip(*expected.values())]


# ---------------------------------------------------------------------------- core pieces
def test_fused_moe_reference_matches_a_per_token_loop():
    gen = torch.Generator().manual_seed(0)
    t, h, i, e, k = 7, 16, 12, 5, 2
    hidden = torch.randn(t, h, generator=gen)
    w13, w2 = torch.randn(e, 2 * i, h, generator=gen), torch.randn(e, h, i, generator=gen)
    weights = torch.rand(t, k, generator=gen)
    ids = torch.randint(0, e, (t, k), generator=gen)
    ids[0, 1] = -1  # an expert held by another expert-parallel rank: contributes nothing
    expected = torch.zeros(t, h)
    for tok in range(t):
        for j in range(k):
            if ids[tok, j] < 0:
                continue
            w = w13[ids[tok, j]]
            gate_up = w @ hidden[tok]
            act = torch.nn.functional.silu(gate_up[:i]) * gate_up[i:]
            expected[tok] += weights[tok, j] * (w2[ids[tok, j]] @ act)
    torch.testing.assert_close(fused_moe(hidden, w13, w2, weights, ids, "silu"), expected, atol=1e-4, rtol=1e-4)


def _same_choices(ours, theirs):
    (w_a, id_a), (w_b, id_b) = ours, theirs
    order_a, order_b = id_a.argsort(dim=-1), id_b.argsort(dim=-1)
    assert torch.equal(id_a.gather(1, order_a), id_b.gather(1, order_b))
    torch.testing.assert_close(w_a.gather(1, order_a), w_b.float().gather(1, order_b), atol=1e-6, rtol=1e-5)


def test_softmax_routing_matches_qwen_router():
    config = AutoConfig.for_model("qwen2_moe", hidden_size=32, num_experts=16, num_experts_per_tok=4,
                                  norm_topk_prob=True)
    router = Qwen2MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(50, 32)
    _, weights, ids = router(x)
    routing = Routing(num_experts=16, top_k=4, scoring="softmax", renormalize=True)
    _same_choices(routing.select(x @ router.weight.t()), (weights, ids))


def test_grouped_sigmoid_routing_matches_deepseek_router():
    config = AutoConfig.for_model("deepseek_v3", hidden_size=32, n_routed_experts=16, num_experts_per_tok=4,
                                  n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    router.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(50, 32)
    _, weights, ids = router(x)
    routing = Routing(num_experts=16, top_k=4, scoring="sigmoid", renormalize=True, num_groups=4, topk_groups=2,
                      scaling_factor=2.5)
    chosen = routing.select(x @ router.weight.t(), router.e_score_correction_bias)
    _same_choices(chosen, (weights, ids))
    groups = chosen[1] // 4  # every token's experts come from at most topk_group groups
    assert all(len(set(row.tolist())) <= 2 for row in groups)


def test_expert_weights_split_over_tensor_parallel_ranks(monkeypatch):
    """Each rank loads its slice of every expert's gate/up rows and down columns; the ranks'
    partial outputs sum to the unsplit layer's output (what the all-reduce computes)."""
    import pagoda.layers.moe as moe

    gen = torch.Generator().manual_seed(1)
    e, h, i = 4, 16, 8
    gate, up, down = (torch.randn(e, i, h, generator=gen), torch.randn(e, i, h, generator=gen),
                      torch.randn(e, h, i, generator=gen))
    routing = Routing(num_experts=e, top_k=2)

    def build(rank, size):
        monkeypatch.setattr(moe, "get_tp_rank", lambda: rank)
        monkeypatch.setattr(moe, "get_tp_size", lambda: size)
        layer = FusedMoE(routing, h, i, reduce_results=False, params_dtype=torch.float32)
        for x in range(e):
            layer.weight_loader(layer.w13_weight, gate[x], "w1", x)
            layer.weight_loader(layer.w13_weight, up[x], "w3", x)
            layer.weight_loader(layer.w2_weight, down[x], "w2", x)
        return layer

    full, shards = build(0, 1), [build(r, 2) for r in range(2)]
    assert shards[1].w13_weight.shape == (e, i, h) and shards[1].w2_weight.shape == (e, h, i // 2)
    torch.testing.assert_close(shards[1].w13_weight[:, : i // 2], gate[:, i // 2:])
    hidden, logits = torch.randn(5, h, generator=gen), torch.randn(5, e, generator=gen)
    torch.testing.assert_close(sum(s(hidden, logits) for s in shards), full(hidden, logits), atol=1e-5, rtol=1e-5)


def test_stacked_expert_tensors_load(tmp_path):
    """Checkpoints holding transformers 5's stacked layout (``experts.gate_up_proj`` [E, 2I, H],
    ``experts.down_proj`` [E, H, I]) load as well as per-expert ones."""
    model_type, fields = VARIANTS["qwen3_moe"]
    source = make_tiny_checkpoint(model_type, tmp_path / "per-expert", seed=5, **fields)
    hf = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    state = {name: t.contiguous() for name, t in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    save_file(state, str(stacked / "model.safetensors"))
    (stacked / "config.json").write_text(json.dumps(json.loads((source / "config.json").read_text())))
    llm = LLM(model=str(stacked), device="cpu", dtype="float32", num_kv_blocks=8, block_size=8, max_model_len=64)
    prompt = random_prompts(1, VOCAB, 20, 20, seed=4)[0]
    torch.testing.assert_close(llm.prompt_logits(prompt), hf_prompt_logits(source, prompt, model=hf),
                               atol=LOGIT_TOL, rtol=LOGIT_TOL)


def test_expert_load_summary_figures():
    summary = expert_load_summary({"b": torch.tensor([0, 4, 0, 0]), "a": torch.tensor([1, 1, 1, 1])})
    assert summary["layers"] == {"a": [1, 1, 1, 1], "b": [0, 4, 0, 0]}
    assert summary["total"] == [1, 5, 1, 1]
    assert summary["max_over_mean"] == pytest.approx((1.0 + 4.0) / 2)
    assert summary["active_share"] == pytest.approx(5 / 8)
    assert expert_load_summary({}) is None
