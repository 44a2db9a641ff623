"""`pagoda bench latency` (vllm bench latency's flags) on a tiny model, and its baselines' errors."""

import json

from pagoda.bench.baselines import latency_summary
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
