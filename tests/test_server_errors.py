"""Bad input against `pagoda serve`: every error has the right status, OpenAI's error format
(Ollama's on /api/) and names the field; a bad request never disturbs the others; a full
queue answers 429; a request past its timeout answers 504 and frees its blocks."""

import asyncio
import time

import httpx
import openai
import pytest
from pagoda.config import EngineConfig
from pagoda.server import ServerConfig, ServerThread, build_app
from pagoda.testing import make_tiny_checkpoint

from tests.support.server_checks import check_blocks

TINY = dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("errors"), seed=2, tokenizer=True, **TINY)
    engine = EngineConfig(model=str(path), device="cpu", dtype="float32", num_kv_blocks=128, block_size=8,
                          max_num_seqs=2, served_model_name="tiny")
    app = build_app(engine, ServerConfig(max_queued_requests=2, max_request_bytes=20_000,
                                         cors_allow_origins=["http://app.example"]))
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(autouse=True)
def engine_left_clean(server):
    yield
    engine = server.app.state.async_engine
    deadline = time.monotonic() + 10
    while True:
        stats = engine.call_sync(lambda e: e.get_stats())
        idle = stats["num_running"] == stats["num_waiting"] == stats["kv_blocks_used"] == 0
        if (idle and engine.num_unfinished() == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert idle and engine.num_unfinished() == 0, stats
    engine.call_sync(check_blocks)


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=30, **kw)


def error_of(response, status):
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


CHAT_CASES = [  # (changes to a valid chat request, the field the error must name)
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -5}, "max_completion_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -9}, "frequency_penalty"),
    ({"stop": [""]}, "stop[0]"),
    ({"seed": "abc"}, "seed"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logit_bias": {"5": "ten"}}, "logit_bias.5"),
    ({"logit_bias": {"5": 1, "99999": 1}}, "logit_bias"),  # a token id over the vocabulary
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),  # a text-only model: it takes no images (docs/multimodal.md)
    ({"messages": [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}]}, "messages[0].content[0].type"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize("change,param", CHAT_CASES, ids=[p for _, p in CHAT_CASES])
def test_invalid_chat_fields_are_400_naming_the_field(server, change, param):
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 4, **change}
    err = error_of(post(server, "/v1/chat/completions", body), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_invalid_completion_requests(server):
    for body, param in [({"model": "tiny"}, "prompt"), ({"prompt": [], "model": "tiny"}, "prompt"),
                        ({"prompt": [5, 999], "model": "tiny"}, "prompt[1]"),  # token id outside the vocabulary
                        ({"prompt": [3, -1]}, "prompt[1]"), ({"prompt": "a", "best_of": 3}, "best_of"),
                        ({"prompt": "a", "suffix": "z"}, "suffix"),
                        ({"prompt": "a", "logprobs": 21}, "logprobs")]:
        assert error_of(post(server, "/v1/completions", body), 400)["param"] == param, body
    bad_json = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=10,
                          headers={"Content-Type": "application/json"})
    assert error_of(bad_json, 400)["param"] == "body"


def test_unknown_model_route_and_method(server):
    err = error_of(post(server, "/v1/chat/completions", {"model": "gpt-9", "messages": CHAT}), 404)
    assert err["param"] == "model" and err["code"] == "model_not_found" and "tiny" in err["message"]
    ollama = post(server, "/api/generate", {"model": "gpt-9", "prompt": "x"})
    assert ollama.status_code == 404 and "gpt-9" in ollama.json()["error"]  # Ollama's format
    assert post(server, "/api/generate", {"model": "tiny:latest", "prompt": "", "stream": False}).status_code == 200
    error_of(httpx.get(server.url + "/v1/nothing"), 404)
    error_of(httpx.get(server.url + "/v1/chat/completions"), 405)
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).completions.create(
            model="nope", prompt="a")


def test_prompt_over_the_context_and_body_too_large(server):
    long_prompt = "a" * 300  # 300 tokens > max_model_len 256
    err = error_of(post(server, "/v1/completions", {"prompt": long_prompt, "max_tokens": 1}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt" and "256" in err["message"]
    err = error_of(post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": long_prompt}]}),
                   400)
    assert err["param"] == "messages"
    err = error_of(post(server, "/v1/completions", {"prompt": "a" * 200, "max_tokens": 100}), 400)
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    ollama = post(server, "/api/generate", {"model": "tiny", "prompt": long_prompt})
    assert ollama.status_code == 400 and "context length" in ollama.json()["error"]
    err = error_of(post(server, "/v1/completions", {"prompt": "a" * 30_000}), 413)
    assert "max_request_bytes" in err["message"]

    async def chunked() -> int:  # no Content-Length: the limit applies while the body is read
        async def body():
            for _ in range(30):
                yield b" " * 1000
        async with httpx.AsyncClient() as c:
            r = await c.post(server.url + "/v1/completions", content=body(),
                             headers={"Content-Type": "application/json"})
            return r.status_code

    assert asyncio.run(chunked()) == 413


def test_a_bad_request_does_not_disturb_the_others(server):
    good = {"model": "tiny", "prompt": "steady", "temperature": 0, "max_tokens": 40, "ignore_eos": True}
    alone = post(server, "/v1/completions", good).json()["choices"][0]["text"]
    bad = [{"prompt": "x", "temperature": -1}, {"prompt": [1, 10_000]}, {"prompt": "x", "n": "many"},
           {"messages": "not a list"}, {"prompt": "a" * 400}]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            goods = [asyncio.ensure_future(c.post("/v1/completions", json=good)) for _ in range(2)]
            await asyncio.sleep(0.01)
            statuses = [(await c.post("/v1/chat/completions" if "messages" in b else "/v1/completions",
                                      json=b)).status_code for b in bad * 3]
            return [(await g) for g in goods], statuses

    goods, statuses = asyncio.run(run())
    assert set(statuses) == {400}
    assert [g.json()["choices"][0]["text"] for g in goods] == [alone, alone]


def test_full_queue_answers_429(server):
    long = {"prompt": "q", "temperature": 0, "max_tokens": 240, "ignore_eos": True, "stream": True}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            streams = []
            # two running (max_num_seqs=2) and two waiting (max_queued_requests=2)
            for _ in range(4):
                cm = c.stream("POST", "/v1/completions", json=long)
                response = await cm.__aenter__()
                assert response.status_code == 200
                streams.append(cm)
            refused = await c.post("/v1/completions", json={"prompt": "q", "max_tokens": 2})
            ollama = await c.post("/api/generate", json={"model": "tiny", "prompt": "q"})
            for cm in streams:  # disconnect: the four are aborted
                await cm.__aexit__(None, None, None)
            return refused, ollama

    refused, ollama = asyncio.run(run())
    err = error_of(refused, 429)
    assert err["code"] == "queue_full" and refused.headers["retry-after"] == "1"
    assert ollama.status_code == 429 and "queue is full" in ollama.json()["error"]


def test_request_timeout_answers_504_and_frees_blocks(server, monkeypatch):
    monkeypatch.setattr(server.app.state.frontend.config, "request_timeout", 0.05)
    body = {"prompt": "slow", "max_tokens": 240, "ignore_eos": True}
    err = error_of(post(server, "/v1/completions", body), 504)
    assert err["type"] == "timeout_error"
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert '"timeout_error"' in events[-2] and events[-1] == "data: [DONE]"  # an error event ends the stream


def test_draining_server_refuses_new_requests_and_reports_unhealthy(server):
    engine = server.app.state.async_engine
    engine.stop_accepting()  # what the first moment of a graceful shutdown does
    try:
        assert httpx.get(server.url + "/health").status_code == 503
        err = error_of(post(server, "/v1/completions", {"prompt": "x"}), 503)
        assert "shutting down" in err["message"]
    finally:
        engine.accepting = True
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_cors_allows_the_configured_origin_only(server):
    preflight = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "http://app.example"
    other = httpx.get(server.url + "/v1/models", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers
