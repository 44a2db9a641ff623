"""LoRA adapters on `pagoda serve`: `lora_modules` names them, /v1/models lists them with the base as
parent, the request's model selects one (same tokens as transformers+peft), unknown names get 404,
and the runtime load/unload routes sit behind the API key. One server for the module."""

import argparse

import httpx
import pytest
from pagoda.config import EngineConfig
from pagoda.server import ServerConfig, ServerThread, build_app
from pagoda.testing import make_tiny_checkpoint
from pagoda.testing.lora import make_peft_adapter, peft_greedy_tokens

pytest.importorskip("peft")

KEY = "sk-lora"
AUTH = {"Authorization": f"Bearer {KEY}"}
TINY = dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
PROMPT = [5, 77, 120, 33, 9, 201, 45]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("server-lora")
    # no tokenizer: prompts are token ids and logprobs name tokens as token_id:N (exact comparisons)
    base = make_tiny_checkpoint("llama", root / "base", seed=1, **TINY)
    return base, make_peft_adapter(base, root / "sql", r=4, seed=1), make_peft_adapter(base, root / "chat", r=8,
                                                                                       seed=2)


@pytest.fixture(scope="module")
def server(files):
    base, sql, _ = files
    engine = EngineConfig(model=str(base), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8,
                          max_num_seqs=8, enable_lora=True, max_loras=2, max_lora_rank=8)
    config = ServerConfig(api_keys=[KEY], served_model_name="tiny", lora_modules=[f"sql={sql}"],
                          enable_lora_runtime_updates=True)
    with ServerThread(build_app(engine, config)) as srv:
        yield srv


def complete(server, model: str, headers=AUTH) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", headers=headers, timeout=30,
                      json={"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                            "logprobs": 0})


def tokens_of(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return [int(t.removeprefix("token_id:")) for t in response.json()["choices"][0]["logprobs"]["tokens"]]


def test_models_lists_adapters_with_their_parent(server, files):
    assert hasattr(server.app.state.async_engine.engine, "replicas")  # the default: the engine in its own process
    data = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"]
    assert [(m["id"], m.get("parent")) for m in data] == [("tiny", None), ("sql", "tiny")]
    assert httpx.get(server.url + "/v1/models/sql", headers=AUTH).json()["root"] == str(files[1])


def test_model_field_selects_the_adapter(server, files):
    base, sql, _ = files
    want_sql, want_base = (peft_greedy_tokens(base, a, [PROMPT], 6)[0] for a in (sql, None))
    assert want_sql != want_base
    sql_reply = complete(server, "sql")
    assert sql_reply.json()["model"] == "sql"  # as vLLM: the reply names the adapter
    got_sql, got_base = tokens_of(sql_reply), tokens_of(complete(server, "tiny"))
    assert got_sql == want_sql
    assert got_base == want_base


def test_unknown_model_is_404(server):
    r = complete(server, "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_runtime_load_and_unload_behind_the_api_key(server, files):
    base, _, chat = files
    url = server.url + "/v1/load_lora_adapter"
    assert httpx.post(url, json={"lora_name": "chat", "lora_path": str(chat)}).status_code == 401
    bad = httpx.post(url, headers=AUTH, json={"lora_name": "x", "lora_path": str(base)})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    r = httpx.post(url, headers=AUTH, json={"lora_name": "chat", "lora_path": str(chat)})
    assert r.status_code == 200 and r.json()["status"] == "loaded"
    assert tokens_of(complete(server, "chat")) == peft_greedy_tokens(base, chat, [PROMPT], 6)[0]
    assert httpx.post(url, headers=AUTH, json={"lora_name": "chat", "lora_path": str(chat)}).status_code == 400
    unload = server.url + "/v1/unload_lora_adapter"
    assert httpx.post(unload, headers=AUTH, json={"lora_name": "chat"}).json()["status"] == "unloaded"
    assert complete(server, "chat").status_code == 404
    assert httpx.post(unload, headers=AUTH, json={"lora_name": "chat"}).status_code == 404


def test_lora_keys_need_enable_lora(files):
    from pagoda.errors import ConfigError

    engine = EngineConfig(model=str(files[0]), device="cpu", dtype="float32", num_kv_blocks=32, block_size=8)
    for server_config in (ServerConfig(lora_modules=[f"sql={files[1]}"]),
                          ServerConfig(enable_lora_runtime_updates=True)):
        with pytest.raises(ConfigError, match="needs the engine key enable_lora"):
            build_app(engine, server_config)


def test_lora_modules_flag_and_yaml_forms(tmp_path):
    from pagoda.cli.serve import add_server_args, server_config_from_args

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    args = parser.parse_args(["--lora-modules", "a=/x", "b=/y", "--lora-modules", "c=/z"])
    assert server_config_from_args(args).lora_modules == ["a=/x", "b=/y", "c=/z"]
    assert ServerConfig(lora_modules={"a": "/x"}).lora_modules == ["a=/x"]
    with pytest.raises(ValueError, match="NAME=PATH"):
        ServerConfig(lora_modules=["just-a-path"])
