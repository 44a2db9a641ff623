"""`server.engine_process`: the engine in its own process behind the server (the data-parallel front with one
replica), so that the HTTP server and the engine do not share one GIL. The same greedy text as the engine in
the server's process, streamed and not; grammars checked by the server and enforced by the replica; what
the front does not serve refused by name. One server (tiny random Llama with a byte tokenizer) for the module."""

import json
import os

import openai
import pytest
from pagoda import LLM, SamplingParams
from pagoda.config import EngineConfig
from pagoda.server import ServerConfig, ServerThread, build_app
from pagoda.testing import make_tiny_checkpoint

TINY = dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=128, block_size=8, max_num_seqs=8)
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("engine-process"), seed=3, tokenizer=True, **TINY)


@pytest.fixture(scope="module")
def server(model):
    app = build_app(EngineConfig(model=str(model), **ENGINE),
                    ServerConfig(served_model_name="tiny", engine_process=True))
    with ServerThread(app) as srv:
        yield srv
    engine = app.state.async_engine.engine  # (`pagoda serve` stops it at exit)
    engine.shutdown()
    assert all(r.proc.poll() is not None for r in engine.replicas)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_the_engine_runs_in_another_process_and_gives_the_in_process_engines_greedy_text(server, client, model):
    engine = server.app.state.async_engine.engine
    (replica,) = engine.replicas
    assert replica.proc.pid != os.getpid() and replica.proc.poll() is None
    kw = dict(model="tiny", temperature=0, max_tokens=16, extra_body={"ignore_eos": True})
    full = client.completions.create(prompt=PROMPT, **kw)
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert full.usage.completion_tokens == 16 and full.choices[0].finish_reason == "length"
    llm = LLM(model=str(model), **ENGINE)  # the engine in this process: the same tokens
    try:
        want = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    finally:
        llm.shutdown()
    assert full.choices[0].text == want.outputs[0].text
    # a stop string cuts the text back after the replica streamed it (sent as deltas): the same both ways
    text = want.outputs[0].text
    word = text[5:7]
    stop = dict(kw, stop=[word], logprobs=2)
    cut = client.completions.create(prompt=PROMPT, **stop)
    pieces = list(client.completions.create(prompt=PROMPT, stream=True, **stop))
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[:text.find(word)]
    assert "".join(c.choices[0].text for c in pieces if c.choices) == cut.choices[0].text
    assert len(cut.choices[0].logprobs.tokens) == cut.usage.completion_tokens


def test_grammars_are_checked_by_the_server_and_enforced_by_the_replica(client):
    for _ in range(2):  # the second from the replica's grammar cache
        out = client.completions.create(model="tiny", prompt="Answer:", max_tokens=8, temperature=0,
                                        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
        assert out.choices[0].text in ("yes", "no") and out.choices[0].finish_reason == "stop"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a number"}], max_tokens=32, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    if chat.choices[0].finish_reason == "stop":  # (a random model may run out of tokens inside the number)
        assert isinstance(json.loads(chat.choices[0].message.content)["n"], int)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "(unclosed"}})
    assert err.value.body["param"] == "structured_outputs.regex"


def test_images_to_a_text_only_model_are_refused_as_by_the_in_process_engine(client):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}])
    assert err.value.body["param"] == "messages[0].content[1]" and "text-only" in err.value.body["message"]
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1


def test_the_queue_limit_counts_the_requests_the_replica_has_no_seat_for(tmp_path):
    import asyncio

    import httpx

    # streams long enough (seconds) that none ends before the fifth request comes, on a loaded machine too
    model = make_tiny_checkpoint("llama", tmp_path, seed=3, tokenizer=True, **{**TINY, "max_position_embeddings": 2048})
    app = build_app(EngineConfig(model=str(model), **{**ENGINE, "max_num_seqs": 2, "num_kv_blocks": 520}),
                    ServerConfig(served_model_name="tiny", max_queued_requests=2))
    long = {"prompt": "q", "temperature": 0, "max_tokens": 2000, "ignore_eos": True, "stream": True}

    async def run(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            streams = []
            for _ in range(4):  # two running (max_num_seqs=2), two waiting (max_queued_requests=2)
                cm = c.stream("POST", "/v1/completions", json=long)
                assert (await cm.__aenter__()).status_code == 200
                streams.append(cm)
            refused = await c.post("/v1/completions", json={"prompt": "q", "max_tokens": 2})
            for cm in streams:  # disconnect: the four are aborted in the replica
                await cm.__aexit__(None, None, None)
            return refused

    with ServerThread(app) as srv:
        assert hasattr(app.state.async_engine.engine, "replicas")  # the default: the engine in its own process
        refused = asyncio.run(run(srv.url))
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
        import time

        deadline = time.monotonic() + 10  # the replica reports itself idle once the aborts reach it
        while True:
            stats = app.state.async_engine.call_sync(lambda e: e.get_stats())
            if stats["num_running"] == stats["kv_blocks_used"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert stats["num_running"] == stats["num_waiting"] == stats["kv_blocks_used"] == 0, stats
    assert all(r.proc.poll() is not None for r in app.state.async_engine.engine.replicas)  # ended with the server


def test_lora_and_pooling_pass_through_the_front():
    from pagoda.server.runner import engines_own_process

    for extra, server in (({"runner": "pooling"}, ServerConfig()),
                          ({"enable_lora": True}, ServerConfig(lora_modules=["a=/nowhere"]))):
        config = EngineConfig(model="/nonexistent/model", **ENGINE, **extra)  # (never loaded)
        assert engines_own_process(config, server) is True


def test_the_flag_and_its_default():
    from pagoda.cli.main import build_parser
    from pagoda.cli.serve import server_config_from_args

    parser = build_parser()
    assert server_config_from_args(parser.parse_args(["serve", "--engine-process"])).engine_process is True
    assert server_config_from_args(parser.parse_args(["serve", "--no-engine-process"])).engine_process is False
    assert ServerConfig().engine_process is True


def test_a_model_that_fails_to_load_in_the_engine_process_is_the_same_error(model, tmp_path):
    """An error the user can fix, raised while the engine process builds its engine, comes back as it is (the
    CLI prints its message, no traceback), not as a failed replica."""
    import shutil

    from pagoda.errors import ModelLoadError

    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="NoSuchForCausalLM has no native pagoda implementation"):
        build_app(EngineConfig(model=str(broken), model_impl="pagoda", **ENGINE), ServerConfig())


def test_a_killed_engine_process_is_named_and_the_server_answers_503(model):
    import signal
    import time

    import httpx

    app = build_app(EngineConfig(model=str(model), **ENGINE), ServerConfig(served_model_name="tiny"))
    with ServerThread(app) as srv:
        (replica,) = app.state.async_engine.engine.replicas
        os.kill(replica.proc.pid, signal.SIGKILL)
        replica.proc.wait(10)
        time.sleep(0.1)
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4},
                       timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed", r.text
        assert f"the engine process (pid {replica.proc.pid}) was killed by SIGKILL" in r.json()["error"]["message"]
