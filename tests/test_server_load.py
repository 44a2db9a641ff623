"""`pagoda serve` under load: concurrent requests are batched, a client that goes away aborts
its request and frees its blocks, /metrics reports it all, the Ollama API works, and
`pagoda bench serve` measures the server."""

import asyncio
import json
import time

import httpx
import openai
import pytest
import torch
from pagoda.cli.main import main as pagoda_main
from pagoda.config import EngineConfig
from pagoda.engine.expert_stats import expert_load_summary
from pagoda.server import ServerConfig, ServerThread, build_app
from pagoda.server.metrics import ServerMetrics
from pagoda.testing import make_tiny_checkpoint
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server_checks import check_blocks

TINY = dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("load"), seed=4, tokenizer=True, **TINY)
    engine = EngineConfig(model=str(path), device="cpu", dtype="float32", num_kv_blocks=512, block_size=8,
                          max_num_seqs=32, served_model_name="tiny")
    app = build_app(engine, ServerConfig())
    with ServerThread(app) as srv:
        yield srv


def stats(server) -> dict:
    return server.app.state.async_engine.call_sync(lambda e: e.get_stats())


def wait_idle(server, timeout=10.0) -> dict:
    engine = server.app.state.async_engine
    deadline = time.monotonic() + timeout
    while True:
        s = stats(server)
        idle = s["num_running"] == s["num_waiting"] == s["kv_blocks_used"] == 0 and engine.num_unfinished() == 0
        if idle or time.monotonic() > deadline:
            assert idle, s
            engine.call_sync(check_blocks)
            return s
        time.sleep(0.02)


@pytest.fixture(autouse=True)
def engine_left_clean(server):
    yield
    wait_idle(server)


def metrics(server) -> dict:
    """{(sample name, frozenset(labels)): value}"""
    text = httpx.get(server.url + "/metrics").text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(m: dict, name: str, **labels) -> float:
    return m.get((name, frozenset(labels.items())), 0.0)


def test_32_concurrent_requests_are_batched(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    prompts = [f"request number {i}" for i in range(32)]

    async def run():
        return await asyncio.gather(*(client.completions.create(
            model="tiny", prompt=p, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}) for p in prompts))

    before = stats(server)["num_steps"]
    outs = asyncio.run(run())
    steps = stats(server)["num_steps"] - before
    assert all(o.usage.completion_tokens == 16 and o.choices[0].finish_reason == "length" for o in outs)
    # one at a time would take 32 x 16 = 512 steps; batched it is about 16 plus a few prefill steps
    assert steps <= 3 * 16, steps
    solo = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).completions.create(
        model="tiny", prompt=prompts[5], max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    assert solo.choices[0].text == outs[5].choices[0].text  # batching does not change greedy results


def test_streaming_client_that_disconnects_is_aborted(server):
    aborted = value(metrics(server), "pagoda_requests_finished_total", finish_reason="abort")
    body = {"prompt": "long story", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert stats(server)["kv_blocks_used"] > 0
    s = wait_idle(server, timeout=5)  # far less than the ~3 s the 900 tokens would take, plus margin
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
    assert value(metrics(server), "pagoda_requests_finished_total", finish_reason="abort") == aborted + 1
    for _ in range(3):  # gone right after the headers, before any event was read
        with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30,
                          json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 900,
                                "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
    started = time.monotonic()
    wait_idle(server, timeout=5)
    assert time.monotonic() - started < 2.5
    assert value(metrics(server), "pagoda_requests_finished_total", finish_reason="abort") == aborted + 4


def test_non_streaming_client_that_disconnects_is_aborted(server):
    aborted = value(metrics(server), "pagoda_requests_finished_total", finish_reason="abort")
    body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    started = time.monotonic()
    wait_idle(server, timeout=5)
    assert time.monotonic() - started < 2.5  # aborted, not run to its end
    assert value(metrics(server), "pagoda_requests_finished_total", finish_reason="abort") == aborted + 1


def test_metrics_report_requests_tokens_latency_and_kv_cache(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    before = metrics(server)
    client.completions.create(model="tiny", prompt="metrics please", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    httpx.post(server.url + "/v1/completions", json={"prompt": "x", "temperature": -3})
    m = metrics(server)
    diff = lambda name, **kw: value(m, name, **kw) - value(before, name, **kw)  # noqa: E731
    assert diff("pagoda_http_requests_total", method="POST", route="/v1/completions", status="200") == 1
    assert diff("pagoda_http_requests_total", method="POST", route="/v1/completions", status="400") == 1
    assert diff("pagoda_requests_finished_total", finish_reason="length") == 1
    assert diff("pagoda_prompt_tokens_total") == len("metrics please")
    assert diff("pagoda_generation_tokens_total") == 5
    assert diff("pagoda_time_to_first_token_seconds_count") == 1
    assert diff("pagoda_time_per_output_token_seconds_count") == 1
    assert diff("pagoda_e2e_request_latency_seconds_count") == 1
    assert diff("pagoda_engine_steps_total") >= 5
    assert diff("pagoda_prefill_tokens_computed_total") == len("metrics please")
    assert value(m, "pagoda_kv_blocks_total") == 512
    assert value(m, "pagoda_kv_blocks_used") == 0 and value(m, "pagoda_kv_blocks_free") == 512
    for name in ("pagoda_num_seqs_running", "pagoda_num_seqs_waiting", "pagoda_preemptions_total",
                 "pagoda_prefix_cache_hit_tokens_total", "pagoda_prefix_cache_query_tokens_total",
                 "pagoda_kv_cache_usage_ratio"):
        assert (name, frozenset()) in m, name


def test_expert_load_of_moe_models_is_exported():
    counts = {"model.layers.0.mlp": torch.tensor([5, 0, 3, 0]), "model.layers.1.mlp": torch.tensor([2, 2, 2, 2])}
    text = ServerMetrics().render({"kv_blocks_total": 4, "expert_load": expert_load_summary(counts)}).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("pagoda_expert_tokens_total", (("expert", "2"), ("layer", "model.layers.0.mlp")))] == 3
    assert samples[("pagoda_expert_active_share", ())] == pytest.approx(6 / 8)
    assert samples[("pagoda_expert_load_max_over_mean", ())] == pytest.approx((5 / 2 + 1) / 2)


def test_ollama_generate_chat_tags_and_version(server):
    def post(path, body):
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == 200, r.text
        return [json.loads(line) for line in r.text.splitlines() if line]

    opts = {"temperature": 0, "num_predict": 12}
    (whole,) = post("/api/generate", {"model": "tiny", "prompt": "why", "stream": False, "options": opts})
    parts = post("/api/generate", {"model": "tiny", "prompt": "why", "options": opts})
    assert whole["done"] and whole["done_reason"] in ("stop", "length") and 0 < whole["eval_count"] <= 12
    assert "".join(p["response"] for p in parts) == whole["response"] and parts[-1]["done"]
    assert parts[-1]["context"] == whole["context"]
    assert len(whole["context"]) == whole["prompt_eval_count"] + whole["eval_count"]
    # "context" continues the conversation: the next prompt is appended to it
    (more,) = post("/api/generate", {"model": "tiny", "prompt": "and?", "context": whole["context"], "stream": False,
                                     "options": opts})
    assert more["prompt_eval_count"] > len(whole["context"])

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    (reply,) = post("/api/chat", {"model": "tiny", "messages": messages, "stream": False, "options": opts})
    chunks = post("/api/chat", {"model": "tiny:latest", "messages": messages, "options": opts})
    assert reply["message"]["role"] == "assistant" and reply["done"]
    assert "".join(c["message"]["content"] for c in chunks) == reply["message"]["content"]
    openai_text = openai.OpenAI(base_url=server.url + "/v1", api_key="x").chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0).choices[0].message.content
    assert openai_text == reply["message"]["content"]  # same template, same greedy tokens

    tags = httpx.get(server.url + "/api/tags").json()["models"]
    assert [t["name"] for t in tags] == ["tiny"] and tags[0]["details"]["family"] == "llama"
    assert httpx.get(server.url + "/api/version").json()["version"]


def test_bench_serve_reports_latency_and_throughput(server, capsys):
    rc = pagoda_main(["bench", "serve", "--url", server.url, "--num-requests", "12", "--concurrency", "4",
                      "--max-tokens", "8", "--prompt-len", "6", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["completed"] == 12 and rep["errors"] == {} and rep["model"] == "tiny"
    assert rep["output_tokens"] == 96 and rep["output_tokens_per_s"] > 0
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert 0 < rep[key]["p50"] <= rep[key]["p90"] <= rep[key]["p99"]
    rc = pagoda_main(["bench", "serve", "--url", server.url, "--endpoint", "chat", "--request-rate", "40",
                      "--num-requests", "6", "--max-tokens", "4", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["completed"] == 6 and rep["mode"].startswith("rate")
    assert pagoda_main(["bench", "serve", "--url", "http://192.0.2.1:8000"]) == 1
    assert "loopback" in capsys.readouterr().err


def test_bench_serve_drives_the_load_from_several_processes(server, capsys):
    rc = pagoda_main(["bench", "serve", "--url", server.url, "--num-requests", "7", "--concurrency", "3",
                      "--max-tokens", "5", "--prompt-len", "4", "--client-processes", "2", "--json"])
    rep = json.loads(capsys.readouterr().out)
    # every request sent once (split 4 + 3 between the processes), the token counts summed
    assert rc == 0 and rep["requests"] == rep["completed"] == 7 and rep["output_tokens"] == 35
    assert rep["client_processes"] == 2 and 0 < rep["client_cpu_share"] < 1.5
    assert rep["output_tokens_per_s"] == pytest.approx(35 / rep["duration_s"], rel=0.01)
    assert pagoda_main(["bench", "serve", "--url", server.url, "--client-processes", "0"]) == 1
    assert "--client-processes" in capsys.readouterr().err


def test_bench_serve_structured_outputs_mode_reports_the_mask_cost(server, capsys):
    rc = pagoda_main(["bench", "serve", "--url", server.url, "--num-requests", "6", "--concurrency", "3",
                      "--max-tokens", "12", "--prompt-len", "4", "--structured-outputs", "json",
                      "--compare-unconstrained", "--repeats", "2", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["completed"] == 6 and rep["structured_outputs"] == "json"
    assert len(rep["pair_ratios"]) == 2 and min(rep["pair_ratios"]) <= rep["ratio_to_unconstrained"] <= \
        max(rep["pair_ratios"])  # the median of the interleaved pairs
    assert rep["unconstrained"]["completed"] == 6 and rep["unconstrained"]["output_tokens"] == 72
    # every pair's rates, the last pair's as the report's own
    assert len(rep["pair_rates"]) == 2 and rep["pair_rates"][-1] == [rep["unconstrained"]["output_tokens_per_s"],
                                                                     rep["output_tokens_per_s"]]
    assert [round(c / u, 4) for u, c in rep["pair_rates"]] == rep["pair_ratios"]
    assert rep["ratio_to_unconstrained"] > 0
    mask = rep["grammar_mask"]  # every constrained token had its row masked
    assert mask["rows"] == rep["output_tokens"] and mask["seconds"] > 0 and mask["ms_per_step"] > 0
    # the waits the server reports: for fills ahead (part of the mask step), for the device (0: the CPU's steps are
    # not pipelined)
    assert 0 <= mask["fill_wait_ms_per_step"] <= mask["ms_per_step"]
    for run in (rep, rep["unconstrained"]):
        assert run["engine"]["steps"] > 0 and run["engine"]["device_wait_ms_per_step"] == 0
    assert stats(server)["structured_outputs"]["mask_rows"] >= mask["rows"]
    rc = pagoda_main(["bench", "serve", "--url", server.url, "--endpoint", "chat", "--num-requests", "2",
                      "--max-tokens", "4", "--structured-outputs", "choice", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["grammar_mask"]["rows"] > 0
    assert pagoda_main(["bench", "serve", "--url", server.url, "--compare-unconstrained"]) == 1
    assert "--structured-outputs" in capsys.readouterr().err
    assert pagoda_main(["bench", "serve", "--url", server.url, "--num-warmups", "-1"]) == 1
    assert "--num-warmups" in capsys.readouterr().err


def test_bench_serve_warm_up_requests_run_before_and_outside_the_timed_runs(server, capsys):
    rows_before = stats(server)["structured_outputs"]["mask_rows"]
    rc = pagoda_main(["bench", "serve", "--url", server.url, "--num-requests", "4", "--concurrency", "2",
                      "--max-tokens", "6", "--prompt-len", "4", "--structured-outputs", "json",
                      "--compare-unconstrained", "--num-warmups", "3", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["warmups"] == {"requests_per_mode": 3, "completed": 6}  # 3 unconstrained, 3 constrained
    assert rep["requests"] == rep["unconstrained"]["requests"] == 4
    # the timed constrained run's mask rows are its own tokens; the warm-up's 3 x 6 were masked before it
    assert rep["grammar_mask"]["rows"] == rep["output_tokens"] == 24
    assert stats(server)["structured_outputs"]["mask_rows"] - rows_before == 3 * 6 + 24
    assert pagoda_main(["bench", "serve", "--url", server.url, "--repeats", "2"]) == 1
    assert "--repeats" in capsys.readouterr().err
