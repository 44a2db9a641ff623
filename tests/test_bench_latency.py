"""`pagoda bench latency` (vllm bench latency's flags) on a tiny model, its baselines' errors, --shape
and the decode floor."""

import json

import pytest
from pagoda.bench.baselines import latency_summary
from pagoda.bench.roofline import Ceilings, Workload, decode_step_floor, workload_floor
from pagoda.bench.shapes import SHAPES, shape_config
from pagoda.cli.main import main as pagoda_main
from pagoda.testing import make_tiny_checkpoint


def test_latency_summary_percentiles():
    s = latency_summary([[0.1, 0.2, 0.4], [0.3, 0.35]])
    assert s["ttft"]["p50"] == 200.0 and s["e2e"]["p50"] == 375.0
    assert abs(s["itl"]["p50"] - 100.0) < 1e-9  # gaps 100, 200 and 50 ms


def test_bench_latency_runs_and_writes_json(tmp_path, capsys):
    model = make_tiny_checkpoint("llama", tmp_path / "m", seed=0, vocab_size=128, hidden_size=64,
                                 intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2)
    out = tmp_path / "lat.json"
    rc = pagoda_main(["bench", "latency", "--model", str(model), "--device", "cpu", "--batch-size", "3",
                      "--input-len", "8", "--output-len", "5", "--num-iters", "2", "--num-iters-warmup", "1",
                      "--num-kv-blocks", "16", "--baseline", "llama.cpp", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "batch latency" in text and "itl ms" in text
    res = json.loads(out.read_text())
    assert res["schema"] == "pagoda.bench.latency/1" and len(res["batch_latency_s"]["runs"]) == 2
    assert res["workload"]["batch_size"] == 3 and res["requests_ms"]["itl"]["p50"] > 0
    assert res["output_tok_s"] > 0
    # a safetensors model has no llama.cpp baseline: the error is recorded, pagoda's numbers stand
    assert "gguf" in res["baselines"]["llama.cpp"]["error"]


def test_bench_latency_reports_the_decode_floor(tmp_path):
    """The floor is the weights plus the batch's KV cache at the mean decode context, over the bandwidth
    (measured here on the CPU), and the fraction is floor / p50 inter-token latency."""
    model = make_tiny_checkpoint("llama", tmp_path / "m", seed=0, vocab_size=128, hidden_size=64,
                                 intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2)
    out = tmp_path / "lat.json"
    assert pagoda_main(["bench", "latency", "--model", str(model), "--device", "cpu", "--batch-size", "2",
                        "--input-len", "8", "--output-len", "5", "--num-iters", "1", "--num-iters-warmup", "0",
                        "--num-kv-blocks", "16", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    floor = res["floor"]
    assert floor["bandwidth_measured"] and 1e8 < floor["bandwidth"] < 1e13  # a torch copy on this CPU
    # float32 K and V of 2 heads x 16 in one layer, 2 sequences at the mean context 8 + (5 - 1) / 2
    assert floor["kv_bytes"] == 2 * 2 * 16 * 4 * 2 * 10
    assert floor["step_bytes"] == floor["weight_bytes"] + floor["kv_bytes"]
    assert floor["itl_ms"] == pytest.approx(1000 * floor["step_bytes"] / floor["bandwidth"])
    assert res["fraction_of_floor"] == pytest.approx(floor["itl_ms"] / res["requests_ms"]["itl"]["p50"])
    assert 0 < res["fraction_of_floor"] < 1  # a 0.2 MB model: the engine's step costs far more than its bytes


TINY_QWEN3 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=320,
                  tie_word_embeddings=True, max_position_embeddings=128, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def test_bench_latency_runs_a_shape(tmp_path, monkeypatch, capsys):
    """--shape builds the named shape with random weights, as bench throughput does (every real shape is
    too large for a quick CPU test: a tiny one is registered for it); the floor counts its weights."""
    monkeypatch.setitem(SHAPES, "tiny-qwen3", TINY_QWEN3)
    out = tmp_path / "lat.json"
    assert pagoda_main(["bench", "latency", "--shape", "tiny-qwen3", "--device", "cpu", "--batch-size", "3",
                        "--input-len", "8", "--output-len", "4", "--num-iters", "1", "--num-iters-warmup", "0",
                        "--num-kv-blocks", "16", "--bandwidth-gbs", "10", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "tiny-qwen3" in text.splitlines()[0] and "floor itl ms" in text and "given" in text
    res = json.loads(out.read_text())
    assert res["shape"] == "tiny-qwen3" and res["engine_config"]["load_format"] == "dummy"
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64 + 2 * 16  # q k v o, MLP, norms, q/k norms
    params = 2 * layer + 320 * 64 + 64  # tied embedding, final norm
    kv = 3 * (8 + 1.5) * 2 * (2 * 2 * 16 * 4)  # 3 sequences at the mean context, 2 layers of float32 K and V
    floor = res["floor"]
    assert (floor["weight_bytes"], floor["kv_bytes"], floor["bandwidth"]) == (4 * params, kv, 1e10)
    assert not floor["bandwidth_measured"]
    assert floor["itl_ms"] == pytest.approx((4 * params + kv) / 1e10 * 1e3)


def test_bench_latency_shape_arguments_are_checked(tmp_path, capsys):
    with pytest.raises(SystemExit):
        pagoda_main(["bench", "latency", "--shape", "llama-7b"])
    assert pagoda_main(["bench", "latency", "--shape", "qwen3-0.6b", "--model", str(tmp_path), "--device",
                        "cpu"]) == 1
    assert "either --model or --shape" in capsys.readouterr().err


def test_decode_step_floor_reads_window_layers_up_to_their_window():
    """One decode step's KV bytes at the mean context; a window layer stops at its window. Over the
    output length the steps add up to the throughput roofline's decode bytes."""
    config = shape_config("gpt-oss-20b")
    counts = {"weight_bytes": 1000, "matmul_params_per_token": 0, "lm_head_params": 0}
    work = Workload(4, 512, 256)
    layers = [(100.0, 128 if i % 2 == 0 else None) for i in range(24)]
    floor = decode_step_floor(work, counts, layers, config, 1e9, True)
    assert floor["kv_bytes"] == pytest.approx(4 * 12 * 100 * (128 + 512 + 127.5))
    assert floor["itl_ms"] == pytest.approx((1000 + floor["kv_bytes"]) / 1e9 * 1e3)
    total = workload_floor(work, counts, layers, config, Ceilings(1e9, 1e12, False))["decode_bytes"]
    assert floor["step_bytes"] * 256 == pytest.approx(total)
    full = decode_step_floor(work, counts, 24 * 100.0, config, 1e9, True)  # one number: every layer full
    assert full["kv_bytes"] == pytest.approx(4 * 24 * 100 * (512 + 127.5))
