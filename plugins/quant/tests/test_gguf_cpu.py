"""GGUF blocks kept quantized on the CPU: every supported type's packed matmul against its dequantized
float reference, and a K-quant file (written with the gguf package) against its dequantized model."""

import gguf
import numpy as np
import pytest
import torch
from pagoda import LLM, SamplingParams
from pagoda.testing.gguf_files import random_blocks, write_tiny_llama_gguf
from pagoda_quant.formats.gguf_blocks import SUPPORTED, decode, to_planes
from pagoda_quant.kernels import cpu_int8dot
from pagoda_quant.kernels.cpu_int4pack import DEQUANT_ROWS, PackedPlane, planes_linear
from pagoda_quant.kernels.cpu_int8dot import I8, Q4, DotWeight, dot_linear

needs_int8dot = pytest.mark.skipif(not cpu_int8dot.available(), reason="no C compiler or no AVX2/FMA on this CPU")

# The kernel takes bfloat16 activations and bfloat16 (scale, zero) pairs: each product carries
# about 2^-8 relative error, so a K-long dot product is off by ~2^-8 of the sum of |x w| at worst.
REL = 2 ** -7


@pytest.mark.parametrize("ggml_type", SUPPORTED)
def test_decoded_codes_are_the_gguf_weights_exactly(ggml_type):
    raw = random_blocks(48, 512, ggml_type, np.random.default_rng(1))
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[ggml_type])
    codes = decode(torch.from_numpy(raw), ggml_type)
    np.testing.assert_array_equal(codes.dequantize().numpy(), want)
    planes = to_planes(codes)  # the int4 digit planes sum to the same weights (float32 rounding only)
    total = sum(((p.codes.float() - 8).view(48, -1, 32) * p.scale[..., None] + p.zero[..., None]).view(48, -1)
                for p in planes)
    np.testing.assert_allclose(total.numpy(), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("rows", [1, 5, DEQUANT_ROWS + 3])  # the int4 kernel, and the widened float GEMM
@pytest.mark.parametrize("ggml_type", SUPPORTED)
def test_packed_matmul_matches_the_dequantized_reference(ggml_type, rows):
    rng = np.random.default_rng(2)
    raw = random_blocks(96, 512, ggml_type, rng)
    weight = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[ggml_type]))
    planes = [PackedPlane(p.codes, p.scale, p.zero) for p in to_planes(decode(torch.from_numpy(raw), ggml_type))]
    x = torch.from_numpy(rng.standard_normal((rows, 512)).astype(np.float32))
    bias = torch.randn(96)
    got = planes_linear(x, planes, bias)
    want = x @ weight.t() + bias
    bound = REL * (x.abs() @ weight.abs().t()) + 1e-6
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    assert bool(((got - want).abs() <= bound).all()), float(((got - want).abs() / bound).max())
    ids = torch.tensor([0, 31, 32, 95, 7])  # an embedding lookup decodes just these rows
    rows_got = sum(p.rows(ids) for p in planes)
    torch.testing.assert_close(rows_got, weight[ids], atol=REL * float(weight.abs().max()), rtol=0)


@needs_int8dot
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 3, 4, 9])  # row tiles of 4, and a partial one
@pytest.mark.parametrize("ggml_type", SUPPORTED)
def test_int8_dot_matmul_is_the_reference_with_int8_activations(ggml_type, rows, threads):
    """The dot-product kernel computes the dequantized weights times activations rounded to int8 per 32
    inputs (scale max|x| / 127): its error is within what that rounding allows, sum |w| s / 2."""
    rng = np.random.default_rng(3)
    raw = random_blocks(40, 512, ggml_type, rng)  # 40 rows: two tasks of 16 and a partial one
    weight = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[ggml_type]))
    dot = DotWeight.from_codes(decode(torch.from_numpy(raw), ggml_type))
    assert dot.layout == (Q4 if ggml_type in ("Q4_0", "Q4_1", "Q4_K") else I8)
    # float16 scales where the file's are (exact), float32 for K-quants' products; no offsets for Q8_0
    k_quant = ggml_type.endswith("_K")
    assert dot.scale.dtype == (torch.float32 if k_quant else torch.float16)
    assert (dot.offset is None) == (ggml_type == "Q8_0")
    torch.testing.assert_close(dot.widen(), weight, rtol=1e-6, atol=1e-6 * float(weight.abs().max()))
    assert torch.equal(dot.widen(), dot.widen_reference())  # the C widening (prefill) is torch's, bit for bit
    ids = torch.tensor([0, 17, 39, 5])
    torch.testing.assert_close(dot.rows(ids), weight[ids], rtol=1e-6, atol=1e-6 * float(weight.abs().max()))
    x = torch.from_numpy(rng.standard_normal((rows, 512)).astype(np.float32))
    x[0, :32] *= 50  # one group of large values: its scale must not spill into the others
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = dot_linear(x, dot)
    finally:
        torch.set_num_threads(before)
    step = x.view(rows, -1, 32).abs().amax(-1) / 127  # [rows, K/32]
    bound = 0.5 * weight.abs() @ step.repeat_interleave(32, dim=1).t()  # [N, rows]
    want = x.double() @ weight.double().t()
    slack = 1e-5 * (x.abs() @ weight.abs().t())
    assert got.shape == (rows, 40) and bool(((got - want).abs() <= bound.t() * 1.001 + slack).all())
    assert float((got - want).abs().max()) > 0  # the activations really are rounded (not a float path)


@needs_int8dot
def test_int8_dot_results_do_not_depend_on_the_thread_count_or_the_batch():
    """Rows are independent: a row's output is the same alone, in a batch, and with two threads."""
    rng = np.random.default_rng(4)
    dot = DotWeight.from_codes(decode(torch.from_numpy(random_blocks(70, 256, "Q4_K", rng)), "Q4_K"))
    x = torch.randn(6, 256)
    alone = torch.cat([dot_linear(x[i:i + 1], dot) for i in range(6)])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        together = dot_linear(x, dot)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(alone, together)


K_QUANTS = {"token_embd": "Q4_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
            "ffn_gate": "Q5_K", "ffn_up": "Q5_K", "ffn_down": "Q6_K", "output": "Q6_K"}


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory):
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-Q4_K_M.gguf", K_QUANTS, seed=0)


@pytest.fixture(params=["int8dot", "int4pack"])
def kernel(request, monkeypatch):
    """Each CPU kernel in turn (PAGODA_CPU_GGUF_KERNEL=int4pack turns the dot-product kernel off)."""
    if request.param == "int8dot" and not cpu_int8dot.available():
        pytest.skip("no C compiler or no AVX2/FMA on this CPU")
    monkeypatch.setenv("PAGODA_CPU_GGUF_KERNEL", request.param)
    return request.param


def test_k_quant_file_generates_the_dequantized_models_greedy_tokens(k_quant_file, kernel):
    kw = dict(model=str(k_quant_file), device="cpu", max_model_len=128, num_kv_blocks=32, block_size=8)
    packed = LLM(**kw)
    reference = LLM(**kw, quantization="none")  # the float path: every block widened at load
    model = packed.engine.runner.model
    assert model.quant_config.name == "gguf" and reference.engine.runner.model.quant_config is None
    qkv = model.model.layers[0].self_attn.qkv_proj
    if kernel == "int8dot":  # q+k Q4_K: 4-bit codes; v Q6_K: signed bytes in groups of 16
        assert [(s.dot.layout, s.dot.group) for s in qkv.gguf_segments] == [(Q4, 32), (I8, 16)]
        assert model.lm_head.gguf_segments[0].dot is not None
    else:  # q+k Q4_K: one plane; v Q6_K: two halves x2
        assert [len(s.planes) for s in qkv.gguf_segments] == [1, 4]
        assert model.lm_head.gguf_segments[0].planes is not None
    assert not hasattr(qkv, "weight")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["hello there", "the cat in the hat", "abc"]
    ours = [o.outputs[0].token_ids for o in packed.generate(prompts, greedy)]
    theirs = [o.outputs[0].token_ids for o in reference.generate(prompts, greedy)]
    assert ours == theirs
    ids = packed.engine.tokenize("the cat in the hat")
    a, b = packed.prompt_logits(ids), reference.prompt_logits(ids)
    assert float((a - b).abs().max()) < 0.05 * float(b.abs().max())


def test_packed_weights_stay_near_the_files_size(k_quant_file, kernel):
    """Resident weight bytes of the linear layers: 4-bit or 8-bit codes and float32 scales per group (the
    dot-product kernel), or 4-bit planes and bf16 scales (torch's int4 kernel)."""
    model = LLM(model=str(k_quant_file), device="cpu", max_model_len=128, num_kv_blocks=8).engine.runner.model
    layer = model.model.layers[0]
    packed = sum(m.quant_method.weight_bytes(m) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                          layer.mlp.gate_up_proj, layer.mlp.down_proj))
    reader = gguf.GGUFReader(str(k_quant_file))
    stored = sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith("blk.0.") and t.name.endswith(
        ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
         "ffn_up.weight", "ffn_down.weight")))
    float32 = 4 * sum(int(np.prod(t.shape)) for t in reader.tensors if t.name.startswith("blk.0.")
                      and "norm" not in t.name)
    # 4-bit planes: Q4_K 1, Q5_K 2, Q6_K 4 (groups of 16 take two passes); dot-product layouts: Q4_K
    # 0.75 bytes per weight, Q5_K 1.25, Q6_K 1.5: about twice this file, well under float32
    assert packed < 2.2 * stored and packed < float32 / 2.5


def test_mixed_fused_layer_and_unsupported_types_fall_back_to_float(tmp_path, kernel):
    """A Q2_K tensor (no packed decoder) arrives dequantized and computes in float beside packed pieces."""
    path = write_tiny_llama_gguf(tmp_path / "mixed.gguf", {"attn_q": "Q2_K", "attn_k": "Q8_0", "attn_v": "F16",
                                                           "ffn_up": "Q4_0"}, default_type="Q5_0", tied=True)
    kw = dict(model=str(path), device="cpu", max_model_len=64, num_kv_blocks=16, block_size=8)
    packed, reference = LLM(**kw), LLM(**kw, quantization="none")
    qkv = packed.engine.runner.model.model.layers[1].self_attn.qkv_proj
    assert [s.planes is None and s.dot is None for s in qkv.gguf_segments] == [True, False, True]
    ids = [5, 80, 120, 33, 9]
    a, b = packed.prompt_logits(ids), reference.prompt_logits(ids)
    assert float((a - b).abs().max()) < 0.05 * float(b.abs().max())


def test_packed_planes_are_cached_and_mapped_on_the_next_load(k_quant_file, tmp_path, monkeypatch, caplog, kernel):
    """The first load writes the file's packed planes to the cache; the next maps them (nothing packed,
    the file not rewritten) and generates the same tokens; a broken cache file is packed again and
    replaced; PAGODA_GGUF_CACHE=0 writes nothing."""
    from pagoda_quant.methods import gguf_cache

    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    kw = dict(model=str(k_quant_file), device="cpu", max_model_len=128, num_kv_blocks=32, block_size=8)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = ["hello there", "the cat in the hat"]
    packed_calls = []
    original = gguf_cache.PackedCache.put
    monkeypatch.setattr(gguf_cache.PackedCache, "put", lambda self, *a: (packed_calls.append(a[0]), original(self, *a)))

    first = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, greedy)]
    files = list((tmp_path / "cache" / "gguf-packed").glob("*.pt"))
    assert len(files) == 1 and packed_calls  # every packed layer, the LM head included
    assert "lm_head" in packed_calls
    written = files[0].stat().st_mtime_ns
    packed_calls.clear()
    llm = LLM(**kw)
    assert not packed_calls and files[0].stat().st_mtime_ns == written  # mapped, nothing packed or written
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == first

    files[0].write_bytes(b"not a cache")
    with caplog.at_level("WARNING", logger="pagoda"):
        again = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, greedy)]
    assert again == first and "could not be read" in caplog.text and packed_calls
    assert files[0].stat().st_size > 1000  # replaced by a good one

    monkeypatch.setenv("PAGODA_GGUF_CACHE", "0")
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "off"))
    LLM(**kw)
    assert not (tmp_path / "off").exists()


@pytest.fixture
def prefill_dtype_env(monkeypatch):
    """Sets PAGODA_CPU_PREFILL_DTYPE (and forgets the cached choice before and after)."""
    cpu_int8dot.prefill_dtype.cache_clear()

    def choose(value: str):
        monkeypatch.setenv("PAGODA_CPU_PREFILL_DTYPE", value)
        cpu_int8dot.prefill_dtype.cache_clear()

    yield choose
    monkeypatch.undo()
    cpu_int8dot.prefill_dtype.cache_clear()


def test_prefill_dtype_is_bfloat16_only_where_the_cpu_multiplies_it(prefill_dtype_env, monkeypatch):
    cases = ((True, False, torch.bfloat16), (False, True, torch.bfloat16), (False, False, torch.float32))
    for amx, avx512_bf16, want in cases:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v, raising=False)
        prefill_dtype_env("auto")
        assert cpu_int8dot.prefill_dtype() is want
    prefill_dtype_env("float32")
    assert cpu_int8dot.prefill_dtype() is torch.float32
    prefill_dtype_env("fp8")
    from pagoda.errors import ConfigError

    with pytest.raises(ConfigError, match="PAGODA_CPU_PREFILL_DTYPE='fp8'"):
        cpu_int8dot.prefill_dtype()


@pytest.mark.skipif(not cpu_int8dot.available(), reason="no C compiler or no AVX2/FMA on this CPU")
def test_bfloat16_prefill_is_the_float32_prefill_to_bfloat16_rounding(k_quant_file, prefill_dtype_env):
    """A prompt of more than DEQUANT_ROWS tokens goes through the widened weights' GEMM: in bfloat16 its
    logits differ from the float32 GEMM's (another path ran) by bfloat16's rounding, no more."""
    kw = dict(model=str(k_quant_file), device="cpu", max_model_len=512, num_kv_blocks=40, block_size=16)
    ids = np.random.default_rng(3).integers(5, 250, DEQUANT_ROWS + 72).tolist()
    logits = {}
    for dtype in ("float32", "bfloat16"):
        prefill_dtype_env(dtype)
        llm = LLM(**kw)
        assert f"{dtype} GEMM" in llm.engine.runner.model.quant_config.describe()
        logits[dtype] = llm.prompt_logits(ids)
    a, b = logits["float32"], logits["bfloat16"]
    assert not torch.equal(a, b)
    assert float((a - b).abs().max()) < 0.04 * float(a.abs().max())  # 0.020 on the machine it was written on
    assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) > 0.9
