"""``pagoda perf-diff``: a regression planted in a real ``pagoda bench throughput`` result is
flagged, differences within the runs' own spread are not, and the chart is a valid PNG."""

import copy
import json
import struct

import pytest
from pagoda.cli.main import main
from pagoda.cli.perf_diff import PLOT_PX
from pagoda.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def bench_result(tmp_path_factory):
    """A real bench result: a tiny model, three timed runs."""
    root = tmp_path_factory.mktemp("bench")
    model = make_tiny_checkpoint("llama", root / "model", vocab_size=320, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=64)
    out = root / "a.json"
    assert main(["bench", "throughput", "--model", str(model), "--num-prompts", "4", "--input-len", "8",
                 "--output-len", "4", "--ignore-eos", "--repeats", "3", "--warmup-prompts", "2",
                 "--bandwidth-gbs", "10", "--matmul-tflops", "1", "--device", "cpu", "--dtype", "float32",
                 "--json", str(out)]) == 0
    return json.loads(out.read_text())


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _within_spread(values, fractions=(0.1, 0.9, 0.5)):
    """Other runs of the same metric: inside [min, max] of ``values``."""
    lo, hi = min(values), max(values)
    return [lo + (hi - lo) * f for f in fractions[: len(values)]]


def test_planted_regression_is_flagged_and_noise_is_not(bench_result, tmp_path, capsys):
    a = bench_result
    assert len(a["runs"]) == 3 and {"ttft", "tpot", "e2e"} <= set(a["runs"][0]["latency_ms"])
    b = copy.deepcopy(a)
    # noise: every metric of B moves within A's own range over its runs
    for key in ("output_tok_s", "total_tok_s", "requests_per_s"):
        for run, value in zip(b["runs"], _within_spread([r[key] for r in a["runs"]])):
            run[key] = value
    for part in ("prefill", "decode", "schedule", "postprocess"):
        for run, value in zip(b["runs"], _within_spread([r["times"][part] for r in a["runs"]])):
            run["times"][part] = value
    # the planted regression: decode 10x slower in every run of B, so TPOT 10x higher and output
    # throughput 10x lower (times can grow without bound, so these are flagged whatever A's spread)
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    decode = median([r["times"]["decode"] for r in a["runs"]])
    throughput = [r["output_tok_s"] for r in a["runs"]]
    for run in b["runs"]:
        run["times"]["decode"] = 10 * decode
        run["output_tok_s"] = median(throughput) / 10
        for pct in ("p50", "p90", "p99"):
            run["latency_ms"]["tpot"][pct] = 10 * median([r["latency_ms"]["tpot"][pct] for r in a["runs"]])
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    plot = tmp_path / "diff.png"
    code = main(["perf-diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--plot", str(plot), "--json",
                 "--fail-on-regression"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    verdicts = {m["metric"]: m["verdict"] for m in report["metrics"]}
    regressed = {"output_tok_s", "decode_s", "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms"}
    if max(throughput) - min(throughput) >= 0.9 * median(throughput):
        # A's own runs disagree by more than the planted 90% drop: a drop that size is noise there
        regressed.discard("output_tok_s")
    assert {k for k, v in verdicts.items() if v == "regression"} == regressed
    assert all(v == "noise" for k, v in verdicts.items() if k not in regressed | {"output_tok_s"})
    assert {"total_tok_s", "prefill_s", "ttft_p50_ms", "e2e_p99_ms"} <= set(verdicts)
    assert report["notes"] == []
    assert png_size(plot) == PLOT_PX
    from matplotlib.image import imread

    assert imread(str(plot)).shape[:2] == (PLOT_PX[1], PLOT_PX[0])


def _runs(values, decode=None):
    return {"workload": {"num_prompts": 4}, "runs": [{"output_tok_s": v, "times": {"decode": d}}
                                                       for v, d in zip(values, decode or values)]}


@pytest.mark.parametrize("b_values, verdict", [
    ([95, 97, 96], "noise"),  # 4 below A's median 100; A's runs span 6
    ([90, 91, 92], "regression"),  # 9 below: beyond both ranges and 2%
    ([108, 109, 110], "improvement"),
])
def test_noise_band_is_the_runs_spread(tmp_path, capsys, b_values, verdict):
    (tmp_path / "a.json").write_text(json.dumps(_runs([100, 104, 98])))
    (tmp_path / "b.json").write_text(json.dumps(_runs(b_values)))
    assert main(["perf-diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json"]) == 0
    metrics = {m["metric"]: m for m in json.loads(capsys.readouterr().out)["metrics"]}
    assert metrics["output_tok_s"]["verdict"] == verdict
    assert metrics["output_tok_s"]["threshold"] == 6
    # decode time: lower is better, so the same numbers read the other way round
    flipped = {"noise": "noise", "regression": "improvement", "improvement": "regression"}[verdict]
    assert metrics["decode_s"]["verdict"] == flipped


def test_single_runs_use_min_change_and_mismatches_are_noted(tmp_path, capsys):
    serve = {"model": "m", "output_tokens_per_s": 100.0, "request_throughput": 2.0,
             "ttft_ms": {"p50": 10.0, "p90": 12.0, "p99": 20.0}, "tpot_ms": {"p50": 5.0, "p90": 6.0, "p99": 7.0},
             "e2e_ms": {"p50": 100.0, "p90": 120.0, "p99": 150.0}}
    slower = dict(serve, output_tokens_per_s=99.0, ttft_ms={"p50": 13.0, "p90": 12.1, "p99": 20.0})
    (tmp_path / "a.json").write_text(json.dumps(serve))
    (tmp_path / "b.json").write_text(json.dumps(slower))
    assert main(["perf-diff", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--min-change", "0.05"]) == 0
    table = capsys.readouterr().out
    assert "ttft_p50_ms" in table and "REGRESSION" in table.split("ttft_p50_ms")[1].splitlines()[0]
    assert "noise" in table.split("output_tok_s")[1].splitlines()[0]  # 1% < 5%
    (tmp_path / "c.json").write_text(json.dumps(dict(_runs([1.0]), workload={"num_prompts": 8})))
    (tmp_path / "d.json").write_text(json.dumps(_runs([1.0])))
    assert main(["perf-diff", str(tmp_path / "c.json"), str(tmp_path / "d.json")]) == 0
    assert "note: the runs differ in workload.num_prompts: 8 vs 4" in capsys.readouterr().out


def test_bad_files_are_named(tmp_path, capsys):
    (tmp_path / "x.json").write_text("{}")
    assert main(["perf-diff", str(tmp_path / "x.json"), str(tmp_path / "x.json")]) == 1
    assert "x.json: not a `pagoda bench throughput --json`" in capsys.readouterr().err
    assert main(["perf-diff", str(tmp_path / "missing.json"), str(tmp_path / "x.json")]) == 1
    assert "missing.json: cannot read" in capsys.readouterr().err
