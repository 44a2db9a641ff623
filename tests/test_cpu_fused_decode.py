"""The CPU's fused decode (pagoda.kernels.cpu_decoder): every layer of a decode step in one C call, with the
GGUF weights' int8 dot-product kernels given as C functions. It must generate exactly what the per-op path
does (PAGODA_CPU_FUSED_DECODE=0) on the same file, through chunked prefill, preemption and mixed batches,
for the Llama family's variants (Llama, Qwen2's q/k/v biases, Qwen3's q/k norms, a K-quant file whose
fused q/k/v projection has parts of two block types), and must actually run (its steps are counted)."""

import pytest
from pagoda import LLM, SamplingParams
from pagoda.kernels import cpu_decoder, cpu_ops
from pagoda.testing import make_tiny_checkpoint, random_prompts
from pagoda.testing.gguf_files import write_gguf_from_checkpoint, write_tiny_llama_gguf

pytestmark = pytest.mark.skipif(cpu_ops._lib() is None, reason="the CPU C kernels could not be built here")

BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
# 10 blocks of 8 slots for 4 prompts of up to 40 tokens + 12: the scheduler preempts; 16-token steps chunk
KW = dict(device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=10, block_size=8, max_num_batched_tokens=16)
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


@pytest.fixture
def fused_steps(monkeypatch):
    """Counts the steps the fused stack computed."""
    counted = {"steps": 0}
    run = cpu_decoder.CpuDecoderStack.run

    def counting(self, hidden, positions):
        out = run(self, hidden, positions)
        counted["steps"] += out is not None
        return out

    monkeypatch.setattr(cpu_decoder.CpuDecoderStack, "run", counting)
    return counted


def _generate(path, prompts, monkeypatch, fused: bool):
    monkeypatch.setenv("PAGODA_CPU_FUSED_DECODE", "1" if fused else "0")
    llm = LLM(model=str(path), **KW)
    outs = llm.generate(prompts, PARAMS)
    stack = llm.engine.runner.model.model.fused_decode._stack
    return outs, stack


def _compare(path, prompts, monkeypatch, fused_steps, exact: bool):
    per_op, none = _generate(path, prompts, monkeypatch, fused=False)
    assert none is None and fused_steps["steps"] == 0  # turned off: never built
    fused, stack = _generate(path, prompts, monkeypatch, fused=True)
    assert isinstance(stack, cpu_decoder.CpuDecoderStack)
    assert fused_steps["steps"] >= PARAMS.max_tokens - 1  # every all-decode step went through C
    for a, b in zip(per_op, fused):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for tok in la:
                if exact:  # the same C functions in the same order: the same floats
                    assert la[tok].logprob == lb[tok].logprob
                else:
                    assert la[tok].logprob == pytest.approx(lb[tok].logprob, abs=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fused_decode_generates_what_the_per_op_path_does(arch, tmp_path, monkeypatch, fused_steps):
    extra = {"head_dim": 16} if arch == "qwen3" else {}
    hf = make_tiny_checkpoint(arch, tmp_path / "hf", seed=3, **BASE, **extra)
    path = write_gguf_from_checkpoint(hf, tmp_path / "model-Q8_0.gguf", ggml_type="Q8_0")
    prompts = random_prompts(4, 320, 10, 40, seed=4)
    # Qwen3's q/k norms: the per-op path normalises in torch, the fused one in C (float32 rounding apart)
    _compare(path, prompts, monkeypatch, fused_steps, exact=arch != "qwen3")


def test_fused_decode_with_k_quants_of_two_types_in_one_projection(tmp_path, monkeypatch, fused_steps):
    types = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q8_0", "output": "Q8_0"}
    path = write_tiny_llama_gguf(tmp_path / "model-Q4_K_M.gguf", types, default_type="Q4_K")
    llm_parts = LLM(model=str(path), **KW).engine.runner.model.model.layers[0].fused_decode_parts()
    assert len(cpu_decoder._linear_parts(llm_parts.qkv)) == 2  # q and k in Q4_K, v in Q6_K: two C calls
    prompts = random_prompts(3, 200, 5, 30, seed=5)
    _compare(path, prompts, monkeypatch, fused_steps, exact=True)


def test_layers_without_c_weights_keep_the_per_op_path(tmp_path, monkeypatch, fused_steps):
    hf = make_tiny_checkpoint("llama", tmp_path / "hf", seed=3, **BASE)
    llm = LLM(model=str(hf), **KW)  # float32 weights: no quantization method gives C functions
    llm.generate(random_prompts(2, 320, 5, 10, seed=1), SamplingParams(temperature=0, max_tokens=4))
    assert llm.engine.runner.model.model.fused_decode._stack is None and fused_steps["steps"] == 0


def test_a_position_outside_the_rotary_table_is_an_error_not_a_read(tmp_path, monkeypatch):
    from pagoda.forward_context import get_forward_context

    path = write_tiny_llama_gguf(tmp_path / "model.gguf", {}, hidden=64, intermediate=128)
    llm = LLM(model=str(path), **KW)
    model = llm.engine.runner.model.model
    seen = {}

    def probe(self, hidden, positions):  # the real stack, called with a position past the table
        seen["ctx"] = get_forward_context()
        bad = positions.clone()
        bad[-1] = self.dims.npos
        return real(self, hidden, bad)

    real = cpu_decoder.CpuDecoderStack.run
    monkeypatch.setattr(cpu_decoder.CpuDecoderStack, "run", probe)
    with pytest.raises(IndexError, match="cos/sin table"):
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
    assert "ctx" in seen and isinstance(model.fused_decode._stack, cpu_decoder.CpuDecoderStack)
