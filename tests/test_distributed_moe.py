"""Tensor and expert parallelism of MoE models on CPU (gloo, 2 processes): Qwen2-MoE and
DeepSeek-V3 against transformers, a balanced placement with replicated experts, and the
placement and dispatch pieces."""

import json

import pytest
import torch
from pagoda import LLM, SamplingParams
from pagoda.distributed.expert_parallel import ExpertShard
from pagoda.distributed.expert_placement import (
    ExpertPlacement,
    balanced_holders,
    balanced_placement,
    contiguous_holders,
    imbalance,
    placement_report,
    rank_loads,
)
from pagoda.errors import ConfigError
from pagoda.testing import hf_greedy_tokens, make_tiny_checkpoint, random_prompts

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")]
VOCAB = 320
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            max_position_embeddings=256, moe_intermediate_size=32)
# shared expert with its sigmoid gate, a dense layer in between (mlp_only_layers)
QWEN = dict(BASE, num_hidden_layers=3, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
            shared_expert_intermediate_size=48, mlp_only_layers=[1])
# MLA with q_lora, sigmoid grouped top-k with a correction bias, one shared expert, a dense first layer
DEEPSEEK = dict(BASE, num_hidden_layers=2, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8,
                qk_nope_head_dim=16, v_head_dim=12, first_k_dense_replace=1, q_lora_rank=32, n_routed_experts=16,
                num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5)
# chunked prefill; no preemption or prefix cache, so every token is computed exactly once
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=48, block_size=8, max_num_batched_tokens=24,
              max_model_len=80, enable_prefix_caching=False)
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = random_prompts(5, VOCAB, 5, 40, seed=7)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = make_tiny_checkpoint("qwen2_moe", tmp_path_factory.mktemp("qwen2_moe"), seed=2, **QWEN)
    return path, hf_greedy_tokens(path, PROMPTS, 20)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    path = make_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("deepseek_v3"), seed=2,
                                randomize_buffers=True, **DEEPSEEK)
    return path, hf_greedy_tokens(path, PROMPTS, 20)


def _run(path, **parallel):
    llm = LLM(model=str(path), tensor_parallel_size=2, **ENGINE, **parallel)
    try:
        return llm, _tokens(llm.generate(PROMPTS, GREEDY)), llm.get_stats()
    finally:
        llm.shutdown()


def _check_counts(stats, top_k: int) -> None:
    """Every computed token is counted once per chosen expert, whichever rank computed it."""
    tokens = sum(map(len, PROMPTS)) + stats["generated_tokens"] - len(PROMPTS)  # the last token is not fed back
    for counts in stats["expert_load"]["layers"].values():
        assert sum(counts) == tokens * top_k


def test_qwen2_moe_tp2_matches_transformers(qwen):
    path, ref = qwen
    llm, tokens, stats = _run(path)
    assert tokens == ref
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert experts.w13_weight.shape == (8, 2 * 16, 64)  # every expert, half its intermediate size
    _check_counts(stats, 2)


def test_qwen2_moe_ep2_matches_transformers(qwen):
    path, ref = qwen
    llm, tokens, stats = _run(path, enable_expert_parallel=True)
    assert tokens == ref
    experts = llm.engine.runner.model.model.layers[0].mlp.experts
    assert experts.expert_shard.local_experts == [0, 1, 2, 3]
    assert experts.w13_weight.shape == (4, 2 * 32, 64)  # half the experts, whole
    _check_counts(stats, 2)


def test_deepseek_v3_tp2_matches_transformers(deepseek):
    path, ref = deepseek
    llm, tokens, stats = _run(path)
    assert tokens == ref
    attn = llm.engine.runner.model.model.layers[0].self_attn
    assert attn.num_heads == 2 and llm.engine.runner.spec_summary()[0].latent_dim == 16 + 8  # latent replicated
    _check_counts(stats, 3)


def test_deepseek_v3_ep2_with_a_balanced_placement_matches_transformers(deepseek, tmp_path):
    path, ref = deepseek
    _, tokens, stats = _run(path, enable_expert_parallel=True)
    assert tokens == ref
    counts = stats["expert_load"]["layers"]
    placement = balanced_placement(counts, 2, redundant_per_rank=2)
    holders = placement.layers["model.layers.1.mlp.experts"]
    assert set(holders[0]) & set(holders[1]), "the hottest experts are replicated on both ranks"
    report = placement_report(counts, 2, placement)
    assert report["after"] < report["before"] and report["slots_per_rank"] == 10
    placement.save(tmp_path / "placement.json")
    llm, tokens, stats = _run(path, enable_expert_parallel=True, expert_placement=str(tmp_path / "placement.json"))
    assert tokens == ref  # replicas split their tokens between the ranks without changing the result
    assert llm.engine.runner.model.model.layers[1].mlp.experts.expert_shard.local_experts == holders[0]
    _check_counts(stats, 3)


# ---------------------------------------------------------------------------- pieces, no processes
def test_balanced_placement_lowers_the_busiest_rank_load():
    counts = [900, 30, 20, 10, 400, 5, 5, 30]  # two hot experts, both in rank 0's contiguous block
    contiguous = contiguous_holders(8, 2)
    assert contiguous == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert imbalance(counts, contiguous) == pytest.approx(960 / 700)
    holders = balanced_holders(counts, 2, redundant_per_rank=1)
    assert all(len(ids) <= 5 and len(set(ids)) == len(ids) for ids in holders)
    assert set(holders[0]) | set(holders[1]) == set(range(8))
    assert 0 in holders[0] and 0 in holders[1]  # the hottest expert got the extra slots
    loads = rank_loads(counts, holders)
    assert sum(loads) == pytest.approx(sum(counts)) and imbalance(counts, holders) < 1.05


def test_placement_file_errors_name_the_file_and_layer(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"num_ranks": 2, "layers": {"model.layers.1.mlp.experts": [[0, 1], [1, 2]]}}))
    placement = ExpertPlacement.load(bad)
    with pytest.raises(ConfigError, match=r"p.json: layer 'model.layers.1.mlp.experts': experts 3 are held by no"):
        placement.holders("model.layers.1.mlp.experts", 4)
    with pytest.raises(ConfigError, match=r"places experts on 2 ranks but the run has 4"):
        ExpertPlacement(4, placement.layers).holders("model.layers.1.mlp.experts", 4)
    assert placement.holders("model.layers.2.mlp.experts", 4) == [[0, 1], [2, 3]]  # unlisted: contiguous
    with pytest.raises(ConfigError, match="does not exist"):
        ExpertPlacement.load(tmp_path / "missing.json")


def test_placement_without_expert_parallelism_is_an_error(qwen):
    path, _ = qwen
    with pytest.raises(ConfigError, match="expert_placement 'p.json' .* needs enable_expert_parallel"):
        LLM(model=str(path), device="cpu", expert_placement="p.json")


def test_every_pair_is_computed_by_exactly_one_replica():
    holders = [[0, 1, 2, 5], [2, 3, 4, 5]]  # experts 2 and 5 on both ranks
    shards = [ExpertShard(6, holders, rank) for rank in range(2)]
    topk = torch.tensor([[2, 5], [2, 0], [5, 3], [2, 4], [1, 5]])
    local = [s.local_ids(topk) for s in shards]
    assert torch.equal((local[0] >= 0).long() + (local[1] >= 0).long(), torch.ones_like(topk))
    for rank, ids in enumerate(local):  # a local slot holds the expert the router chose
        held = torch.tensor(holders[rank])
        assert torch.equal(held[ids[ids >= 0]], topk[ids >= 0])
    computing_2 = {r for r in range(2) if (local[r][topk == 2] >= 0).any()}
    assert computing_2 == {0, 1}  # expert 2's tokens are split between its replicas
