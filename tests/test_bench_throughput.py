"""pagoda bench throughput: the shapes, the roofline against BENCH_ANCHORS, and a CPU run that
writes the documented JSON (with the decode profile and the HF baseline)."""

import json

import pytest
from pagoda.bench.roofline import Ceilings, Workload, workload_floor
from pagoda.bench.shapes import SHAPES, shape_config
from pagoda.cli.main import main
from pagoda.testing import make_tiny_checkpoint

ANCHOR_CEILINGS = Ceilings(4.25e12, 786e12, False)


def _qwen3_counts():
    # Qwen3-0.6B: 28 layers of (q 2048 + k 1024 + v 1024 + o 2048) x 1024 + MLP 3 x 1024 x 3072, tied
    # 151936 x 1024 embedding, norms
    layer = 1024 * (2048 + 1024 + 1024) + 2048 * 1024 + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128
    params = 28 * layer + 151936 * 1024 + 1024
    return {"weight_bytes": 2 * params, "matmul_params_per_token": 28 * layer, "lm_head_params": 151936 * 1024}


def test_roofline_reproduces_the_anchor_limit():
    kv_bytes = 28 * 2 * 8 * 128 * 2  # layers x (K, V) x kv heads x head_dim x bf16
    floor = workload_floor(Workload(256, 512, 256), _qwen3_counts(), kv_bytes, shape_config("qwen3-0.6b"),
                           ANCHOR_CEILINGS)
    assert floor["bound_by"] == "bytes"
    assert floor["bound_output_tok_s"] == pytest.approx(54475, rel=2e-3)  # BENCH_ANCHORS.md


def test_shapes_are_the_anchor_configs():
    qwen = shape_config("qwen3-0.6b")
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.num_key_value_heads, qwen.head_dim) == (1024, 28, 8, 128)
    moe = shape_config("qwen3-30b-a3b")
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.norm_topk_prob) == (128, 8, 768,
                                                                                                        True)
    ds = shape_config("deepseek-v3-4l")
    assert (ds.num_hidden_layers, ds.first_k_dense_replace, ds.n_routed_experts, ds.kv_lora_rank) == (4, 3, 256, 512)
    gemma = shape_config("gemma3-1b")  # google/gemma-3-1b-it
    assert (gemma.hidden_size, gemma.num_hidden_layers, gemma.head_dim, gemma.sliding_window) == (1152, 26, 256, 512)
    assert gemma.layer_types.count("full_attention") == 4 and gemma.layer_types[5] == "full_attention"
    oss = shape_config("gpt-oss-20b")  # openai/gpt-oss-20b
    assert (oss.num_local_experts, oss.num_experts_per_tok, oss.sliding_window, oss.head_dim) == (32, 4, 128, 64)
    assert oss.rope_parameters["rope_type"] == "yarn" and oss.layer_types[:2] == ["sliding_attention", "full_attention"]
    vl = shape_config("qwen2.5-vl-3b")  # Qwen/Qwen2.5-VL-3B-Instruct
    assert (vl.get_text_config().hidden_size, vl.get_text_config().num_hidden_layers, vl.vision_config.depth,
            vl.vision_config.fullatt_block_indexes, vl.image_token_id) == (2048, 36, 32, [7, 15, 23, 31], 151655)
    assert set(SHAPES) == {"qwen3-0.6b", "phi3-mini", "qwen3-30b-a3b", "deepseek-v3-4l", "gemma3-1b", "gpt-oss-20b",
                           "qwen2.5-vl-3b"}


def test_roofline_counts_window_layers_up_to_their_window():
    """Per-layer KV reads and attention FLOPs stop growing at a layer's window."""
    config = shape_config("gpt-oss-20b")
    counts = {"weight_bytes": 0, "matmul_params_per_token": 0, "lm_head_params": 0}
    per_layer = 2 * 8 * 64 * 2  # K and V x kv heads x head_dim x bf16
    work = Workload(4, 512, 256)
    full = workload_floor(work, counts, per_layer * 24, config, ANCHOR_CEILINGS)
    mixed = workload_floor(work, counts, [(per_layer, 128 if i % 2 == 0 else None) for i in range(24)], config,
                           ANCHOR_CEILINGS)
    # a decode step of a window layer reads 128 tokens instead of 512..767
    assert mixed["decode_bytes"] == pytest.approx(full["decode_bytes"] * (128 + 639.5) / (2 * 639.5))
    assert mixed["flops"] < full["flops"]


def test_cpu_run_of_a_window_model(tmp_path, capsys):
    """A model with window layers and KV cache groups through the benchmark (the roofline reads its
    per-layer windows)."""
    model = make_tiny_checkpoint("gpt_oss", tmp_path / "m", seed=1, vocab_size=320, hidden_size=64,
                                 intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                 sliding_window=8, max_position_embeddings=128)
    out = tmp_path / "r.json"
    assert main(["bench", "throughput", "--model", str(model), "--device", "cpu", "--num-prompts", "2",
                 "--input-len", "16", "--output-len", "8", "--ignore-eos", "--repeats", "1",
                 "--bandwidth-gbs", "10", "--matmul-tflops", "0.1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["model"]["architecture"] == "GptOssForCausalLM" and res["best"]["output_tokens"] == 16


def test_cpu_run_writes_the_result_file(tmp_path, capsys):
    model = make_tiny_checkpoint("qwen3", tmp_path / "m", seed=1, vocab_size=320, hidden_size=64,
                                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    out = tmp_path / "r.json"
    code = main(["bench", "throughput", "--model", str(model), "--device", "cpu", "--num-prompts", "3",
                 "--input-len", "8", "--output-len", "12", "--ignore-eos", "--repeats", "2", "--profile",
                 "--baseline", "hf", "--bandwidth-gbs", "10", "--matmul-tflops", "0.1", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "output tok/s" in printed and "roofline" in printed and "HF transformers" in printed
    res = json.loads(out.read_text())
    assert res["schema"] == "pagoda.bench.throughput/1"
    assert len(res["runs"]) == 2 and res["best"]["output_tok_s"] == max(r["output_tok_s"] for r in res["runs"])
    assert all(r["output_tokens"] == 36 and r["input_tokens"] == 24 for r in res["runs"])
    assert set(res["best"]["times"]) >= {"prefill", "decode", "schedule", "postprocess", "steps"}
    assert res["roofline"]["ceilings"] == {"bandwidth": 1e10, "matmul_flops": 1e11, "measured": False}
    bound = res["roofline"]["bound_output_tok_s"]
    assert res["fraction_of_bound"] == pytest.approx(res["best"]["output_tok_s"] / bound)
    assert res["profile"]["batch"] == 3 and res["profile"]["step_seconds"]["wall"] > 0
    assert res["profile"]["prefill_step"]["tokens"] == 24  # the three 8-token prompts in one step
    assert res["profile"]["prefill_step"]["kernels"]["busy_seconds"] > 0
    host = res["profile"]["host_step"]  # the next step (the first decode step here) under cProfile
    assert host["tokens"] == 3 and host["wall_seconds"] > 0 and len(host["top_own_seconds"]) == 10
    assert sum(seconds for _, _, seconds in host["top_own_seconds"]) <= host["wall_seconds"]
    assert res["baseline"]["engine"] == "transformers" and res["baseline"]["output_tokens"] == 36
    assert res["engine_config"]["max_model_len"] == 20  # input + output unless given
    assert res["model"]["kv_cache_dtype"] == res["dtype"] and "KV cache" not in printed.splitlines()[0]


def test_header_names_a_quantized_kv_cache():
    """A cache kept in another type than the model's (``--kv-cache-dtype fp8``) is named in the
    printed header, so that its numbers are not read as the model dtype's."""
    from pagoda.bench.throughput import _kv_cache_note

    assert _kv_cache_note({"dtype": "bfloat16", "model": {"kv_cache_dtype": "float8_e4m3fn"}}) == \
        ", KV cache float8_e4m3fn"
    assert _kv_cache_note({"dtype": "bfloat16", "model": {"kv_cache_dtype": "bfloat16"}}) == ""
    assert _kv_cache_note({"dtype": "bfloat16", "model": {}}) == ""  # result files written before the field


def test_unknown_shape_and_model_with_shape_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "throughput", "--shape", "llama-7b"])
    assert main(["bench", "throughput", "--shape", "qwen3-0.6b", "--model", str(tmp_path), "--device", "cpu"]) == 1
    assert "either --model or --shape" in capsys.readouterr().err


def test_structured_outputs_run(tmp_path, capsys):
    """--structured-outputs: every request under the bench's JSON schema (here sampled: --temperature); the run
    reports the masks' cost."""
    model = make_tiny_checkpoint("llama", tmp_path / "m", seed=2, tokenizer=True, vocab_size=300, hidden_size=32,
                                 intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=128)
    out = tmp_path / "r.json"
    code = main(["bench", "throughput", "--model", str(model), "--device", "cpu", "--num-prompts", "3",
                 "--input-len", "8", "--output-len", "12", "--repeats", "1", "--structured-outputs", "json",
                 "--temperature", "0.7",
                 "--bandwidth-gbs", "10", "--matmul-tflops", "0.1", "--json", str(out)])
    assert code == 0
    res = json.loads(out.read_text())
    assert res["workload"]["structured_outputs"] == "json" and res["workload"]["temperature"] == 0.7
    run = res["runs"][0]
    # (cumulative: the warm-up ran under the same grammar, so that its one-time costs stay out of the runs)
    assert 3 <= run["output_tokens"] <= 36 and run["grammar_mask"]["mask_rows"] >= run["output_tokens"] + 3
