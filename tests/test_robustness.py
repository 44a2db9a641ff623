"""No request can take the engine down (issue 24).

Request fields are bounded where they enter (SamplingParams, the engine's limits, the server's
models): values that once overflowed the sampler on the engine thread are now 400s naming the
field, and the server answers the next request. A failure pinned to one row of a step fails that
request only; the others of the same step get exactly the tokens they would have got anyway.
"""

import httpx
import pytest
from pagoda import LLM, SamplingParams
from pagoda import logits_processors as logits_module
from pagoda.config import EngineConfig
from pagoda.engine import sampler as sampler_module
from pagoda.errors import RequestError
from pagoda.server import ServerConfig, ServerThread, build_app
from pagoda.testing import make_tiny_checkpoint

VOCAB = 260
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
CHAT = [{"role": "user", "content": "Hi"}]
INT64_MAX = 2**63 - 1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("robust"), seed=3, tokenizer=True, **TINY)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(model=str(checkpoint), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8, max_n=4)


@pytest.fixture(scope="module")
def server(checkpoint):
    engine = EngineConfig(model=str(checkpoint), device="cpu", dtype="float32", num_kv_blocks=128, block_size=8,
                          max_num_seqs=4, served_model_name="tiny", max_n=4)
    # (the engine in the server's process: tests below patch its code)
    with ServerThread(build_app(engine, ServerConfig(engine_process=False))) as srv:
        yield srv


# ---------------------------------------------------------------------------- bounds, offline
@pytest.mark.parametrize("kwargs,field", [
    ({"seed": 1180591620717411303424}, "seed"), ({"seed": -(2**63) - 1}, "seed"), ({"seed": True}, "seed"),
    ({"seed": INT64_MAX, "n": 2}, "seed"), ({"top_k": 2**70}, "top_k"), ({"top_k": -2}, "top_k"),
    ({"max_tokens": True}, "max_tokens"), ({"temperature": float("inf")}, "temperature"),
    ({"stop": ["x"] * 65}, "stop"), ({"stop": 5}, "stop"), ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": [1] * 2000}, "stop_token_ids"), ({"n": True}, "n"),
])
def test_sampling_params_refuse_values_that_would_overflow(kwargs, field):
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field


def test_the_engine_checks_its_own_limits(llm):
    for params, field in [(SamplingParams(top_k=VOCAB + 1), "top_k"), (SamplingParams(n=5), "n"),
                          (SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids")]:
        with pytest.raises(RequestError) as info:
            llm.generate([[1, 2, 3]], params)
        assert info.value.field == field
    with pytest.raises(RequestError, match="prompt token ids"):
        llm.generate([[1, True]], SamplingParams(max_tokens=2))
    seed_edge = SamplingParams(n=2, seed=INT64_MAX - 1, max_tokens=2)  # seed + 1 is the largest int64
    assert len(llm.generate([[1, 2, 3]], seed_edge)[0].outputs) == 2
    assert llm.generate([[1, 2, 3]], SamplingParams(top_k=VOCAB, max_tokens=2))[0].finished
    assert llm.get_stats()["num_running"] == 0


# ---------------------------------------------------------------------------- fault isolation
def _requests():
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=11, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=13, seed=5, max_tokens=6, ignore_eos=True, logprobs=2)]
    return prompts, params


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("where", ["penalties", "batched selection", "logprobs"])
def test_a_row_that_fails_to_sample_fails_only_its_request(llm, monkeypatch, where):
    prompts, params = _requests()
    clean = _tokens(llm.generate(prompts, params))
    victim = {"penalties": 2, "batched selection": 3, "logprobs": 3}[where]
    if where == "penalties":
        real = logits_module.apply_penalties

        def penalties(row, seq):
            if seq.params.repetition_penalty == 1.3 and seq.num_output_tokens == 2:
                raise RuntimeError("injected: penalties")
            return real(row, seq)

        monkeypatch.setattr(logits_module, "apply_penalties", penalties)
    elif where == "batched selection":  # the batch fails; row by row only the top_k=13 row does
        real = sampler_module._filtered_probs

        def filtered(logits, rows):
            if any(p.top_k == 13 for p in rows):
                raise RuntimeError("injected: selection")
            return real(logits, rows)

        monkeypatch.setattr(sampler_module, "_filtered_probs", filtered)
    else:
        monkeypatch.setattr(sampler_module, "_logprobs", lambda *a: (_ for _ in ()).throw(RuntimeError("injected")))
    outs = llm.generate(prompts, params)
    for i, out in enumerate(outs):
        assert out.finished
        if i == victim:
            assert out.outputs[0].finish_reason == "error" and "injected" in out.error
        else:
            assert out.error is None and out.outputs[0].token_ids == clean[i], i
    stats = llm.get_stats()
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_blocks_used"] == 0
    llm.engine.block_manager.check_invariants()
    monkeypatch.undo()
    assert _tokens(llm.generate(prompts, params)) == clean  # and the engine goes on as before


def test_a_row_that_fails_to_decode_fails_only_its_request(llm, monkeypatch):
    prompts, params = _requests()
    clean = _tokens(llm.generate(prompts, params))
    detok = llm.engine.detokenizer
    real = detok.step

    def step(seqs):
        if any(s.prompt_token_ids[0] == 9 and s.num_output_tokens == 3 for s in seqs):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(seqs)

    monkeypatch.setattr(detok, "step", step)
    outs = llm.generate(prompts, params)
    assert outs[1].outputs[0].finish_reason == "error" and "injected" in outs[1].error
    assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 1] == [c for i, c in enumerate(clean) if i != 1]


# ---------------------------------------------------------------------------- the server
def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def assert_serving(server):
    assert httpx.get(server.url + "/health").status_code == 200
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")


CHAT_CASES = [  # each once took the engine down or slipped through; each must be a 400 naming its field
    ({"seed": 1180591620717411303424}, "seed"), ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 2**64 - 1, "n": 2}, "seed"), ({"seed": INT64_MAX, "n": 2}, "seed"),
    ({"top_k": 2**70}, "top_k"), ({"top_k": VOCAB + 1}, "top_k"), ({"n": 5}, "n"), ({"n": 1000}, "n"),
    ({"max_tokens": True}, "max_tokens"), ({"temperature": True}, "temperature"),
    ({"stop": ["s"] * 65}, "stop"), ({"stop": "x" * 2000}, "stop"), ({"stop_token_ids": [1] * 1025}, "stop_token_ids"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids[0]"), ({"stop_token_ids": [False]}, "stop_token_ids[0]"),
    ({"model": "m" * 2000}, "model"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
]


@pytest.mark.parametrize("change,field", CHAT_CASES, ids=[f"{f}-{i}" for i, (_, f) in enumerate(CHAT_CASES)])
def test_chat_fields_are_bounded_where_they_enter(server, change, field):
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, **change})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert_serving(server)


@pytest.mark.parametrize("body,field", [
    ({"prompt": [[False]]}, "prompt[0][0]"), ({"prompt": [1, True]}, "prompt[1]"),
    ({"prompt": [[1, VOCAB]]}, "prompt[0][1]"), ({"prompt": "a", "max_tokens": True}, "max_tokens"),
    ({"prompt": "a", "seed": 2**70}, "seed"), ({"prompt": ["a"] * 300}, "prompt"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"), ({"prompt": "a", "min_tokens": 9, "max_tokens": 3}, "min_tokens"),
])
def test_completion_fields_are_bounded_where_they_enter(server, body, field):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert_serving(server)


@pytest.mark.parametrize("options,field", [
    ({"seed": 1180591620717411303424}, "options.seed"), ({"top_k": 2**70}, "options.top_k"),
    ({"top_k": VOCAB + 1}, "options.top_k"), ({"num_predict": True}, "options.num_predict"),
    ({"num_predict": 0}, "options.num_predict"),
])
def test_ollama_options_are_bounded_where_they_enter(server, options, field):
    r = post(server, "/api/generate", {"model": "tiny", "prompt": "hi", "stream": False, "options": options})
    assert r.status_code == 400 and field in r.json()["error"], r.text
    assert_serving(server)


def test_a_failed_request_answers_500_and_the_others_finish(server, monkeypatch):
    real = logits_module.apply_penalties

    def penalties(row, seq):
        if seq.params.repetition_penalty == 1.7:
            raise RuntimeError("injected")
        return real(row, seq)

    monkeypatch.setattr(logits_module, "apply_penalties", penalties)
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    expected = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    with httpx.Client(base_url=server.url, timeout=60) as client:
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            bad = pool.submit(client.post, "/v1/completions", json={**body, "repetition_penalty": 1.7})
            bad_stream = pool.submit(client.post, "/v1/completions",
                                     json={**body, "repetition_penalty": 1.7, "stream": True})
            good = [pool.submit(client.post, "/v1/completions", json=body) for _ in range(2)]
            bad, bad_stream, good = bad.result(), bad_stream.result(), [g.result() for g in good]
    assert bad.status_code == 500 and bad.json()["error"]["code"] == "request_failed"
    assert bad_stream.status_code == 200 and '"request_failed"' in bad_stream.text and "[DONE]" in bad_stream.text
    assert [g.json()["choices"][0]["text"] for g in good] == [expected, expected]
    assert_serving(server)


def test_the_document_states_the_served_limits(server):
    doc = httpx.get(server.url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["n"]["maximum"] == 4 and chat["top_k"]["anyOf"][0]["maximum"] == VOCAB
    assert chat["model"]["anyOf"][0]["enum"] == ["tiny", "tiny:latest"]
    assert chat["max_tokens"]["anyOf"][0]["maximum"] == 255  # max_model_len - 1
    token_ids = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"][2]
    assert token_ids["maxItems"] == 255 and token_ids["items"]["maximum"] == VOCAB - 1
    assert "HTTPValidationError" not in schemas
    post_chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "404", "413", "429", "500", "503", "504"} <= set(post_chat) and "422" not in post_chat
    assert "401" not in post_chat  # no API keys on this server
    assert set(post_chat["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(doc["paths"]["/api/chat"]["post"]["responses"]["200"]["content"]) == {"application/json",
                                                                                      "application/x-ndjson"}
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    err = post_chat["400"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    assert set(schemas[err]["properties"]) == {"error"}


# ---------------------------------------------------------------------------- engine death
DYING_SERVER = """
import sys
from pagoda.cli.main import main
from pagoda.engine.model_runner import ModelRunner

real = ModelRunner.launch

def launch(self, plan, *args, **kwargs):  # a failure no request can be blamed for: the model itself breaks
    if any(row.num_computed_tokens == 0 and row.tokens[:2] == [7, 7] for row in plan.rows):
        raise RuntimeError("injected device failure")
    return real(self, plan, *args, **kwargs)

ModelRunner.launch = launch
sys.exit(main(sys.argv[1:]))
"""


def test_a_dead_engine_says_so_and_the_process_exits_non_zero(checkpoint):
    import os
    import re
    import subprocess
    import sys
    import time

    cmd = [sys.executable, "-c", DYING_SERVER, "serve", "--model", str(checkpoint), "--device", "cpu",
           "--dtype", "float32", "--num-kv-blocks", "64", "--port", "0", "--shutdown-timeout", "5",
           "--no-engine-process"]  # (the patch above applies to this process)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = None
        for line in proc.stderr:
            if match := re.search(r"on (http://127\.0\.0\.1:\d+)", line):
                url = match.group(1)
                break
        assert url, "the server did not start"
        deadline = time.monotonic() + 60
        while True:  # (the port is bound before the server listens)
            try:
                assert httpx.get(url + "/health", timeout=10).status_code == 200
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        r = httpx.post(url + "/v1/completions", json={"prompt": [7, 7, 1], "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed", r.text
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "error"
        assert "injected device failure" in health.json()["error"]
        try:  # (the server may already be closing its port: it keeps answering for about a second)
            refused = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=10)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_failed"
        except httpx.TransportError:
            pass
        start = time.monotonic()
        assert proc.wait(timeout=30) == 1
        assert time.monotonic() - start < 15
        assert "the engine failed" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
