"""Speculative method "eagle3": an EAGLE-3 head (fc over three target layers' hidden states, one decoder
layer over [embedding, hidden], a draft vocabulary mapped by d2t) drafts; greedy outputs stay those of
plain decoding and of transformers, with chunked prefill and preemption; a head built to agree with the
target has every draft kept, which checks the aux hidden states, the d2t mapping and the chaining."""

import pytest
import torch
from pagoda import LLM, SamplingParams
from pagoda.errors import ConfigError
from pagoda.speculative.acceptance import accept_sampled
from pagoda.testing import check_greedy, hf_greedy_tokens, make_tiny_checkpoint, random_prompts
from pagoda.testing.eagle3 import make_eagle3_head
from safetensors.torch import load_file, save_file

VOCAB = 260
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def write_head(path, hidden: int, intermediate: int, draft_ids: torch.Tensor, seed: int = 0,
               tensors: dict | None = None, **config) -> str:
    return make_eagle3_head(path, VOCAB, hidden, intermediate, draft_ids, seed, tensors, **config)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("target"), seed=3, **TINY)


def test_eagle3_random_head_greedy_equals_transformers_with_chunked_prefill_and_preemption(target, tmp_path):
    draft_ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:200].sort().values
    head = write_head(tmp_path / "head", 64, 96, draft_ids, eagle_config={"eagle_aux_hidden_state_layer_ids":
                                                                          [0, 1, 3]})
    prompts = random_prompts(4, VOCAB, 6, 40, seed=5)
    expected = hf_greedy_tokens(target, prompts, 20)
    result, llm = check_greedy(target, prompts, 20, expected=expected, engine={"speculative_config": {
        "method": "eagle3", "model": head, "num_speculative_tokens": 3}})
    result.assert_passed()
    stats = llm.get_stats()["speculative"]
    assert stats["draft_tokens"] > 0 and len(stats["per_position_acceptance"]) == 3, stats
    proposer = llm.engine.speculative.proposer
    assert type(proposer.runner.model).__name__ == "LlamaForCausalLMEagle3" and proposer.layer_ids == (0, 1, 3)
    assert proposer.runner.model.embed_tokens.weight is llm.engine.runner.model.model.embed_tokens.weight


def test_eagle3_sampled_and_mixed_requests(target, tmp_path):
    # a short max_position_embeddings in the head (as trained heads have) still covers the target's positions
    head = write_head(tmp_path / "head", 64, 96, torch.arange(0, VOCAB, 2), seed=2, max_position_embeddings=16)
    llm = LLM(model=str(target), device="cpu", dtype="float32", block_size=8, num_kv_blocks=64,
              enable_prefix_caching=False, speculative_config={"method": "eagle3", "model": head,
                                                                "num_speculative_tokens": 2})
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


def agreeing_pair(path, seed: int = 0):
    """A target whose next token is a fixed permutation g of the current one, and a head that predicts it.

    Target: one-hot embeddings, every o_proj/down_proj zero but the last layer's (the residual stream is
    the embedding at every layer but the output), lm_head the permutation matrix of g. Head
    (norm_before_residual): fc passes the aux hidden state e(x_p) through; its MLP maps a state dominated
    by e(a) to a much larger e(g(a)), its attention output is zero; so out = e(x_p) + M e(x_{p+1}), whose
    logits peak at g(x_{p+1}) = x_{p+2}, and each chained step moves one token further. Its vocabulary is
    the target's, reversed through d2t."""
    hidden = 264  # >= VOCAB: one-hot embeddings
    cfg = {**TINY, "hidden_size": hidden, "intermediate_size": 32, "num_key_value_heads": 4}
    target = make_tiny_checkpoint("llama", path / "target", seed=seed, **cfg)
    g = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))
    perm = torch.zeros(hidden, hidden)
    perm[g, torch.arange(VOCAB)] = 1.0  # perm @ e(a) = e(g(a))
    t = load_file(str(target / "model.safetensors"))
    for name, tensor in t.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    # the last layer writes into the 4 dimensions lm_head ignores: its output is not the aux states the head
    # reads (vLLM's default for 4 layers: the inputs of layers 2, 2, 1), which only agree if those are read
    t["model.layers.3.mlp.down_proj.weight"][VOCAB:] = 100 * torch.randn(hidden - VOCAB, cfg["intermediate_size"])
    t["model.embed_tokens.weight"] = torch.eye(VOCAB, hidden)
    t["model.norm.weight"] = torch.ones(hidden)
    t["lm_head.weight"] = perm[:VOCAB].clone()
    save_file(t, str(target / "model.safetensors"), metadata={"format": "pt"})
    reversed_ids = torch.arange(VOCAB - 1, -1, -1)
    ones = torch.ones(hidden)
    head = write_head(path / "head", hidden, hidden, reversed_ids, seed=seed, norm_before_residual=True, tensors={
        "fc.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, 2 * hidden)], dim=1),
        "midlayer.self_attn.o_proj.weight": torch.zeros(hidden, hidden),
        "midlayer.mlp.gate_proj.weight": torch.eye(hidden), "midlayer.mlp.up_proj.weight": torch.eye(hidden),
        "midlayer.mlp.down_proj.weight": 10 * perm,
        "lm_head.weight": perm[:VOCAB][reversed_ids].clone(), "norm.weight": ones,
        "midlayer.hidden_norm.weight": ones, "midlayer.post_attention_layernorm.weight": ones})
    return str(target), head


def test_eagle3_drafts_what_the_target_decodes_when_built_to(tmp_path):
    target, head = agreeing_pair(tmp_path)
    prompts = random_prompts(3, VOCAB, 6, 20, seed=8)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32", block_size=8, num_kv_blocks=64)
    want = [o.outputs[0].token_ids for o in LLM(model=target, **kw).generate(prompts, params)]
    llm = LLM(model=target, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3},
              **kw)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    stats = llm.get_stats()["speculative"]
    assert stats["acceptance_rate"] == 1.0 and stats["mean_accepted_length"] > 3.5, stats


def test_eagle3_errors_name_the_key(target, tmp_path):
    kw = dict(device="cpu", dtype="float32", num_kv_blocks=16)
    with pytest.raises(ConfigError, match="needs an EAGLE-3 head"):
        LLM(model=str(target), speculative_config={"method": "eagle3", "model": str(target)}, **kw)
    gemma = make_tiny_checkpoint("gemma2", tmp_path / "gemma", seed=1, vocab_size=VOCAB, hidden_size=32,
                                 intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                                 num_key_value_heads=2, head_dim=16)
    with pytest.raises(ConfigError, match="needs a target that exposes its layers' hidden states"):
        LLM(model=str(gemma), speculative_config={"method": "eagle3", "model": write_head(
            tmp_path / "h32", 32, 64, torch.arange(VOCAB))}, **kw)
    head = write_head(tmp_path / "bad", 64, 96, torch.arange(VOCAB),
                      eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 9]})
    with pytest.raises(ConfigError, match="eagle_aux_hidden_state_layer_ids"):
        LLM(model=str(target), speculative_config={"method": "eagle3", "model": head}, **kw)


def test_rejection_sampling_is_exact_with_a_draft_vocabulary():
    """An EAGLE-3 head's q is zero outside its draft vocabulary (-inf logits after the d2t scatter): the
    kept tokens still follow the target's p, tokens outside the draft vocabulary included (they come from
    the residual max(0, p - q)). Tolerance 0.025 per probability at 8000 draws (about 4.5 standard
    deviations); keeping every draft would be off by > 0.2."""
    gen = torch.Generator().manual_seed(0)
    draws = 8000
    p = torch.tensor([[0.3, 0.1, 0.1, 0.3, 0.2], [0.2] * 5])
    q = torch.softmax(torch.tensor([[2.0, 1.0, 0.5, float("-inf"), float("-inf")]]), dim=-1)  # tokens 3, 4: none
    first = torch.zeros(5)
    for d in torch.multinomial(q, draws, replacement=True, generator=gen).T.tolist():
        tokens, kept = accept_sampled(p, d, q, gen)
        assert tokens[:kept] == d[:kept]
        first[tokens[0]] += 1
    assert (first / draws - p[0]).abs().max() < 0.025, first / draws


def test_a_failing_drafter_costs_speed_not_requests(target, tmp_path):
    """The head raising inside its step (after the target's forward) and inside another step's proposal:
    every request still gets plain decoding's tokens, and the blocks of the head's shadows are given back."""
    head = write_head(tmp_path / "head", 64, 96, torch.arange(0, VOCAB, 2), seed=2)
    prompts = random_prompts(3, VOCAB, 6, 20, seed=6)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    params = [greedy, SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True), greedy]
    kw = dict(device="cpu", dtype="float32", block_size=8, num_kv_blocks=64, enable_prefix_caching=False)
    plain = LLM(model=str(target), **kw).generate(prompts, greedy)
    llm = LLM(model=str(target), **kw, speculative_config={"method": "eagle3", "model": head,
                                                          "num_speculative_tokens": 2})
    decoder, proposer = llm.engine.speculative, llm.engine.speculative.proposer
    chain, calls = proposer._draft_chain, []

    def draft_chain(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return chain(*args)

    proposer._draft_chain = draft_chain
    got = llm.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert decoder.drafter_failures == 1 and not proposer.shadows
    proposer._draft_chain = chain
    proposer.propose = lambda *a: (_ for _ in ()).throw(RuntimeError("drafter down"))
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got][::2] == [plain[0].outputs[0].token_ids,
                                                          plain[2].outputs[0].token_ids]
    assert all(o.outputs[0].finish_reason == "length" for o in got)
    assert decoder.drafter_failures > 1 and llm.get_stats()["kv_blocks_used"] == 0
    # a head whose logits turn to NaN: the sampled request's draft distribution is refused by name
    del proposer.propose
    failures, head = decoder.drafter_failures, proposer.runner.model
    head.compute_logits = lambda hidden: torch.full((hidden.shape[0], VOCAB), float("nan"))
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got][::2] == [plain[0].outputs[0].token_ids,
                                                          plain[2].outputs[0].token_ids]
    assert decoder.drafter_failures > failures and llm.get_stats()["kv_blocks_used"] == 0
