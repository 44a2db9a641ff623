"""The transformers fallback against transformers itself, on tiny random models of architectures pagoda has no
native class for: prompt logits, greedy tokens through chunked prefill, preemption and prefix caching, every
tensor loaded, the KV cache size; how the class is chosen (model_impl); the listing; two ranks (gloo)."""

import pytest
import torch
from pagoda import LLM, SamplingParams
from pagoda.cli.main import main
from pagoda.errors import ModelLoadError
from pagoda.plugins import get_registry
from pagoda.testing import (
    assert_greedy_matches,
    assert_kv_bytes_per_token,
    assert_prompt_logits_match,
    assert_weights_consumed,
    hf_greedy_tokens,
    hf_prompt_logits,
    make_tiny_checkpoint,
    random_prompts,
)
from pagoda.transformers_fallback.model import TransformersForCausalLM

VOCAB = 320
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
# what each tiny model exercises besides grouped-query attention
VARIANTS = {
    "olmo2": dict(TINY),  # q/k RMSNorm over all heads, post-norms
    "granite": dict(TINY, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
                    logits_scaling=4.0),  # every multiplier, logits divided in transformers' head code
    "stablelm": dict(TINY, use_parallel_residual=True, qk_layernorm=True, use_qkv_bias=True,
                     partial_rotary_factor=0.5),  # LayerNorm, per-head q/k LayerNorm, partial rotary
    "cohere": dict(TINY, logit_scale=0.5, use_qk_norm=False, tie_word_embeddings=True),  # logits times a scale
    "gpt_neox": dict(TINY, num_key_value_heads=None, use_parallel_residual=True),  # fused query_key_value
    "olmoe": dict(TINY, num_experts=16, num_experts_per_tok=2),  # per-expert tensors stacked (2 before 10)
    "opt": dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=256),  # learned positions, LayerNorm, head code calls model.decoder
}
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=64, block_size=8)
STRESS = dict(num_kv_blocks=10, block_size=8, max_num_batched_tokens=24, max_model_len=80, enable_prefix_caching=False)


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    name = request.param
    fields = {k: v for k, v in VARIANTS[name].items() if v is not None}
    return name, make_tiny_checkpoint(name, tmp_path_factory.mktemp(name), seed=1, **fields)


def test_prompt_logits_and_cache_size_match_transformers(tiny):
    _, path = tiny
    llm = LLM(model=str(path), **ENGINE)
    assert isinstance(llm.engine.runner.model, TransformersForCausalLM)  # no native class: the fallback
    assert_prompt_logits_match(llm, path, random_prompts(2, VOCAB, 9, 40, seed=3))
    assert_kv_bytes_per_token(llm)


def test_greedy_batch_with_chunked_prefill_and_preemption(tiny):
    _, path = tiny
    assert_greedy_matches(path, random_prompts(6, VOCAB, 5, 45, seed=7), 32, engine=STRESS)


def test_greedy_with_prefix_caching(tiny):
    """Prompts that share blocks: the later ones reuse the cached KV of the first (hits counted)."""
    _, path = tiny
    base = random_prompts(1, VOCAB, 30, 30, seed=11)[0]
    prompts = [base, base[:24] + [7, 8, 9], base[:16] + [5] * 10, base]
    expected = hf_greedy_tokens(path, prompts, 16)
    llm = LLM(model=str(path), **dict(ENGINE, enable_prefix_caching=True, max_num_seqs=1))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16,
                                                                                ignore_eos=True))]
    assert got == expected
    assert llm.get_stats()["prefix_cache_hit_tokens"] >= 16 + 16 + 24


def test_every_checkpoint_tensor_is_loaded(tiny):
    _, path = tiny
    assert_weights_consumed(path)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"), seed=3, **TINY)


def test_model_impl_chooses_native_or_transformers(llama, tmp_path_factory):
    prompts = random_prompts(3, VOCAB, 5, 30, seed=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    native = LLM(model=str(llama), **ENGINE)
    assert type(native.engine.runner.model).__name__ == "LlamaForCausalLM"  # a native class wins under auto
    fallback = LLM(model=str(llama), model_impl="transformers", **ENGINE)
    assert isinstance(fallback.engine.runner.model, TransformersForCausalLM)
    assert [o.outputs[0].token_ids for o in fallback.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in native.generate(prompts, params)]
    torch.testing.assert_close(fallback.prompt_logits(prompts[0]), native.prompt_logits(prompts[0]),
                               atol=2e-4, rtol=2e-4)
    olmo2 = make_tiny_checkpoint("olmo2", tmp_path_factory.mktemp("olmo2-impl"), seed=1, **TINY)
    with pytest.raises(ModelLoadError, match="Olmo2ForCausalLM has no native pagoda implementation.*model_impl"):
        LLM(model=str(olmo2), model_impl="pagoda", **ENGINE)


def test_int4_through_the_fallback_equals_native_int4(llama):
    """The fallback's linears are pagoda's: a quantization method applies to them as to a native model's."""
    quant = {"method": "int4", "group_size": 16}
    native = LLM(model=str(llama), quantization=quant, **ENGINE)
    fallback = LLM(model=str(llama), quantization=quant, model_impl="transformers", **ENGINE)
    prompt = random_prompts(1, VOCAB, 20, 20, seed=9)[0]
    torch.testing.assert_close(fallback.prompt_logits(prompt), native.prompt_logits(prompt), atol=2e-4, rtol=2e-4)
    assert not torch.allclose(fallback.prompt_logits(prompt), hf_prompt_logits(llama, prompt), atol=1e-3)


@pytest.mark.parametrize("model_type, fields, message", [
    ("mamba", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2), "MambaForCausalLM does not route its "
     "attention through the attention interface"),
    ("qwen3_next", dict(TINY, layer_types=["linear_attention", "full_attention"]), "Qwen3NextForCausalLM"),
    ("bert", dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4), "is an encoder"),
    ("olmo2", dict(TINY, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
     "longest position in the whole batch"),
])
def test_what_the_fallback_cannot_run_is_explained(tmp_path, model_type, fields, message):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **fields)
    config.architectures = [{"bert": "BertLMHeadModel", "mamba": "MambaForCausalLM", "olmo2": "Olmo2ForCausalLM",
                             "qwen3_next": "Qwen3NextForCausalLM"}[model_type]]
    config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as err:
        LLM(model=str(tmp_path), load_format="dummy", **ENGINE)
    assert message in str(err.value) and "is not supported" in str(err.value)


def test_plugins_and_models_list_the_fallback(capsys):
    reg = get_registry()
    assert reg.models.entries["*"].provider == "pagoda-core"
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "register_models: *" in out
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM                   pagoda-models" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("Olmo2ForCausalLM "))
    assert "via transformers (olmo2; tensor parallel: yes; tested)" in line, line
    assert "MambaForCausalLM" not in out and "BertLMHeadModel" not in out


@pytest.mark.parametrize("architecture", ["Olmo2ForCausalLM", "GraniteForCausalLM", "StableLmForCausalLM",
                                          "CohereForCausalLM", "GPTNeoXForCausalLM", "OlmoeForCausalLM",
                                          "OPTForCausalLM"])
def test_check_model_passes_on_fallback_architectures(capsys, architecture):
    code = main(["check-model", architecture, "--variant", "gqa", "--max-tokens", "16"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "all checks passed (4 checks, 1 variants)" in out


def test_check_model_runs_the_fallback_on_a_native_architecture(capsys):
    code = main(["check-model", "LlamaForCausalLM", "--model-impl", "transformers", "--variant", "mha-tied",
                 "--checks", "weights,prompt_logits,kv_cache"])
    out = capsys.readouterr().out
    assert code == 0, out


# ---------------------------------------------------------------------------- two ranks (gloo)
TP_ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=12, block_size=8, max_num_batched_tokens=24,
                 max_model_len=80)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, heads_split", [("granite", True), ("olmo2", False)])
def test_two_ranks_match_transformers(tmp_path_factory, name, heads_split):
    """Granite's plan splits the heads (colwise q/k/v, rowwise o): each rank caches half of them. Olmo2's
    gathers q/k/v before its norms over all heads (colwise_gather_output, rowwise_split_input): every rank
    caches them all; its MLP is still split."""
    fields = {k: v for k, v in VARIANTS[name].items() if v is not None}
    path = make_tiny_checkpoint(name, tmp_path_factory.mktemp(f"{name}-tp"), seed=1, **fields)
    prompts = random_prompts(5, VOCAB, 5, 40, seed=7)
    expected = hf_greedy_tokens(path, prompts, 24)
    one = LLM(model=str(path), **TP_ENGINE)
    llm = LLM(model=str(path), tensor_parallel_size=2, **TP_ENGINE)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24,
                                                                                    ignore_eos=True))]
        assert got == expected
        assert llm.get_stats()["num_preemptions"] > 0
        torch.testing.assert_close(llm.prompt_logits(prompts[1]), hf_prompt_logits(path, prompts[1]),
                                   atol=1e-4, rtol=1e-4)
        ratio = llm.engine.runner.kv_bytes_per_token() / one.engine.runner.kv_bytes_per_token()
        assert ratio == (0.5 if heads_split else 1.0)
        mlp = llm.engine.runner.model.model.layers[0].mlp
        assert mlp.down_proj.weight.shape[1] == VARIANTS[name]["intermediate_size"] // 2
    finally:
        llm.shutdown()


# ---------------------------------------------------------------------------- CUDA (scripts/gpu_fallback_check.sh)
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["olmo2", "granite", "olmoe"])
def test_on_cuda_the_fallback_matches_transformers(tmp_path_factory, name):
    """On a GPU the attention calls go to the CUDA plugin's Triton paged attention: float32 greedy tokens
    through chunked prefill and preemption equal transformers' on the CPU; bfloat16 logits stay close."""
    fields = {k: v for k, v in VARIANTS[name].items() if v is not None}
    path = make_tiny_checkpoint(name, tmp_path_factory.mktemp(f"{name}-cuda"), seed=1, **fields)
    prompts = random_prompts(6, VOCAB, 5, 45, seed=7)
    assert_greedy_matches(path, prompts, 32, engine=dict(STRESS, device="cuda"))
    llm = LLM(model=str(path), device="cuda", dtype="bfloat16", num_kv_blocks=64, block_size=16)
    assert llm.engine.runner.backends["mha"].name != "torch"
    logits = llm.prompt_logits(prompts[2]).float().cpu()
    torch.testing.assert_close(logits, hf_prompt_logits(path, prompts[2]), atol=0.15, rtol=0.05)


def test_server_runs_a_fallback_model(tmp_path_factory):
    import openai
    from pagoda.config import EngineConfig
    from pagoda.server import ServerConfig, ServerThread, build_app

    path = make_tiny_checkpoint("olmo2", tmp_path_factory.mktemp("olmo2-serve"), seed=1, tokenizer=True, **TINY)
    engine = EngineConfig(model=str(path), **ENGINE)
    # (the engine in the server's process: the test reads its model)
    with ServerThread(build_app(engine, ServerConfig(served_model_name="olmo", engine_process=False))) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=30)
        chat = client.chat.completions.create(model="olmo", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.usage.completion_tokens == 4
        assert isinstance(srv.app.state.async_engine.engine.runner.model, TransformersForCausalLM)
