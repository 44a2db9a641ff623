"""Reasoning models through the engine and the server: the thinking goes to `reasoning_content` (and
its streaming deltas), the answer to `content`, and a structured-output grammar starts where the
reasoning ends. A tiny random model cannot think, so a logits processor registered for this test
scripts its output token by token (every other token -inf), the way a real model's would come."""

import json

import httpx
import openai
import pytest
import torch
from pagoda import LLM, SamplingParams
from pagoda.config import EngineConfig
from pagoda.interfaces import LogitsProcessor
from pagoda.plugins import get_registry
from pagoda.server import ServerConfig, ServerThread, build_app
from pagoda.structured_outputs.params import StructuredOutputsParams
from pagoda.testing import make_tiny_checkpoint

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["city", "n"], "additionalProperties": False}
ANSWER = '{"city":"Oslo","n":7}'


class ScriptProcessor(LogitsProcessor):
    """Forces the text in ``SCRIPT`` (then EOS): the next token is the script's token at the
    request's output length."""

    SCRIPT = ""

    def __call__(self, output_token_ids, logits):
        ids = self.tokenizer.encode(self.SCRIPT, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        forced = ids[min(len(output_token_ids), len(ids) - 1)]
        keep = logits[forced].clone()
        logits.fill_(float("-inf"))
        logits[forced] = keep if torch.isfinite(keep) else 0.0  # a mask that forbids it leaves the row empty
        return logits


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    reg = get_registry()
    if "test_script" not in reg.logits_processors:
        reg.logits_processors.add("test_script", ScriptProcessor, "tests")
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("think"), seed=3, tokenizer=True, **TINY)


def engine_config(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=128, block_size=8,
                        max_num_seqs=4, max_model_len=512, served_model_name="thinker",
                        reasoning_parser="deepseek_r1", logits_processors=["test_script"])


@pytest.fixture(scope="module")
def server(model_dir):
    # (the engine in the server's process: the processor above is registered in this one only)
    with ServerThread(build_app(engine_config(model_dir), ServerConfig(engine_process=False))) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def script(text: str) -> None:
    ScriptProcessor.SCRIPT = text


EXTRA = {"logits_processors": ["test_script"]}
ASK = [{"role": "user", "content": "Where?"}]


def test_thinking_and_answer_are_split(client):
    script("The user asks where.</think>Oslo, I think.")
    out = client.chat.completions.create(model="thinker", messages=ASK, max_tokens=80, extra_body=EXTRA)
    message = out.choices[0].message
    assert message.reasoning_content == "The user asks where." and message.content == "Oslo, I think."
    assert out.choices[0].finish_reason == "stop"


def test_streamed_deltas_join_to_the_same_split(client):
    script("Let me see.</think>It is Oslo.")
    reasoning, content = [], []
    for chunk in client.chat.completions.create(model="thinker", messages=ASK, max_tokens=80, stream=True,
                                                extra_body=EXTRA):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            reasoning.append(delta.get("reasoning_content") or "")
            content.append(delta.get("content") or "")
    assert "".join(reasoning) == "Let me see." and "".join(content) == "It is Oslo."


def test_a_schema_constrains_only_the_answer(client):
    # the grammar would forbid the thinking's first letter: the request would fail if it started early
    script("No JSON here.</think>" + ANSWER)
    out = client.chat.completions.create(
        model="thinker", messages=ASK, max_tokens=120, extra_body=EXTRA,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}})
    message = out.choices[0].message
    assert message.reasoning_content == "No JSON here." and json.loads(message.content) == {"city": "Oslo", "n": 7}


def test_a_schema_refuses_an_answer_outside_it(server):
    # the same script with an answer the schema forbids: the grammar (active after </think>) empties the
    # row, so the request fails alone (500 request_failed) and the server goes on
    script("Hmm.</think>Oslo")
    body = {"model": "thinker", "messages": ASK, "max_tokens": 60, **EXTRA,
            "response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed"
    script("Fine.</think>ok")
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "response_format": None}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"


def test_offline_structured_outputs_wait_for_the_reasoning_end(model_dir):
    llm = LLM(config=engine_config(model_dir))
    try:
        script("Think first.</think>" + ANSWER)
        params = SamplingParams(max_tokens=120, temperature=0, logits_processors=["test_script"],
                                structured_outputs=StructuredOutputsParams(json=SCHEMA))
        text = llm.generate(["Where?"], params)[0].outputs[0].text
        assert text == "Think first.</think>" + ANSWER
    finally:
        llm.shutdown()
