"""The pooling routes of `pagoda serve --runner pooling` (docs/pooling.md), with the clients people run:
openai's embeddings.create (base64 by default) and the ollama package's embed(); /v1/rerank and
/v1/score against transformers' reranker; the document lists the routes; wrong-runner refusals."""

import httpx
import pytest
import torch
from pagoda.config import EngineConfig
from pagoda.server import ServerConfig, ServerThread, build_app
from test_pooling import ENGINE, QWEN3, make_classifier

MODEL = "rerank"
POOLING = {**ENGINE, "max_model_len": 64, "normalize": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / MODEL
    return path, make_classifier(path, 1)


@pytest.fixture(scope="module")
def server(checkpoint):
    engine = EngineConfig(model=str(checkpoint[0]), served_model_name=MODEL, **POOLING)
    with ServerThread(build_app(engine, ServerConfig())) as srv:
        assert hasattr(srv.app.state.async_engine.engine, "replicas")  # the default: the engine in its own process
        yield srv


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint[0])
    model = checkpoint[1]

    @torch.no_grad()
    def embed(ids):
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(hidden, dim=0)

    @torch.no_grad()
    def score(a, b):
        return torch.sigmoid(model(input_ids=torch.tensor([tokenizer(a, b)["input_ids"]])).logits[0, 0]).item()

    return tokenizer, embed, score


def test_openai_client_embeddings(server, reference):
    import openai

    tokenizer, embed, _ = reference
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    texts = ["a pagoda is a tiered tower", "short", "another text of some middling length here"]
    result = client.embeddings.create(model=MODEL, input=texts)  # the client asks for base64 and decodes it
    assert [d.index for d in result.data] == [0, 1, 2]
    for text, item in zip(texts, result.data):
        want = embed(tokenizer(text)["input_ids"])
        assert torch.nn.functional.cosine_similarity(torch.tensor(item.embedding), want, dim=0) > 0.99999
    assert result.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in texts)
    floats = client.embeddings.create(model=MODEL, input=[[5, 6, 7], [8, 9]], encoding_format="float", dimensions=8)
    assert len(floats.data[0].embedding) == 8
    assert abs(torch.tensor(floats.data[0].embedding).norm().item() - 1) < 1e-5
    with pytest.raises(openai.BadRequestError) as err:  # over the context, naming the input
        client.embeddings.create(model=MODEL, input=["ok", "x" * 100])
    assert err.value.body["param"] == "input[1]" and err.value.body["code"] == "context_length_exceeded"
    cut = client.embeddings.create(model=MODEL, input=["x" * 100], extra_body={"truncate_prompt_tokens": 10})
    assert cut.usage.prompt_tokens == 10


def test_ollama_client_embed(server, reference):
    import ollama

    tokenizer, embed, _ = reference
    client = ollama.Client(host=server.url)
    result = client.embed(model=MODEL, input=["hello there", "a second one"])
    for text, vector in zip(["hello there", "a second one"], result.embeddings):
        assert torch.nn.functional.cosine_similarity(torch.tensor(vector), embed(tokenizer(text)["input_ids"]),
                                                     dim=0) > 0.99999
    legacy = client.embeddings(model=MODEL, prompt="hello there")
    torch.testing.assert_close(torch.tensor(legacy.embedding), torch.tensor(result.embeddings[0]))


def test_rerank_and_score_match_transformers(server, reference):
    _, _, score = reference
    query, docs = "what is a pagoda", ["a tiered tower", "noodle soup", "a temple in Asia"]
    body = httpx.post(server.url + "/v1/rerank", json={"model": MODEL, "query": query, "documents": docs,
                                                       "top_n": 2}, timeout=60).json()
    want = [score(query, d) for d in docs]
    best = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in body["results"]] == best
    for r in body["results"]:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-5)
        assert r["document"]["text"] == docs[r["index"]]
    cohere = httpx.post(server.url + "/v1/rerank", json={"query": query, "documents": [{"text": d} for d in docs],
                                                         "return_documents": False}, timeout=60).json()
    assert [r["index"] for r in cohere["results"]] == sorted(range(3), key=lambda i: -want[i])
    assert all(r["document"] is None for r in cohere["results"])
    show = httpx.post(server.url + "/api/show", json={"model": MODEL}, timeout=30).json()
    assert show["capabilities"] == ["embedding"]
    scored = httpx.post(server.url + "/v1/score", json={"text_1": query, "text_2": docs}, timeout=60).json()
    assert [d["score"] for d in scored["data"]] == pytest.approx(want, abs=1e-5)
    bad = httpx.post(server.url + "/v1/score", json={"text_1": ["a", "b"], "text_2": docs}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_combination"


def test_routes_in_the_document_and_generation_refused(server):
    paths = httpx.get(server.url + "/openapi.json", timeout=30).json()["paths"]
    for route in ("/v1/embeddings", "/v1/score", "/v1/rerank", "/api/embed", "/api/embeddings"):
        assert "400" in paths[route]["post"]["responses"]
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_task"
    assert "/v1/embeddings" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/api/generate", json={"model": MODEL, "prompt": "hi", "stream": False}, timeout=30)
    assert r.status_code == 400 and r.json()["code"] == "unsupported_task"


def test_a_generating_server_answers_the_pooling_routes(checkpoint, tmp_path):
    from fastapi.testclient import TestClient
    from pagoda.testing import make_tiny_checkpoint

    decoder = make_tiny_checkpoint("qwen3", tmp_path / "gen", seed=1, tokenizer=True, **QWEN3)
    engine = EngineConfig(model=str(decoder), **{**POOLING, "runner": "generate", "normalize": None})
    app = build_app(engine, ServerConfig())
    client = TestClient(app)  # (refused before the engine loop is needed)
    try:
        for route, body in (("/v1/embeddings", {"input": "hi"}), ("/v1/rerank", {"query": "q", "documents": ["d"]}),
                            ("/api/embed", {"model": "gen", "input": "hi"})):
            r = client.post(route, json=body)
            assert r.status_code == 400, (route, r.text)
            assert "--runner pooling" in r.text and "unsupported_task" in r.text
    finally:
        app.state.async_engine.engine.shutdown()


def test_pooling_requests_are_counted_in_the_request_metrics(server):
    """Each pooled input is a finished request on /metrics: its prompt tokens and end-to-end time, no
    generated tokens."""
    from prometheus_client.parser import text_string_to_metric_families

    def sample(name: str, **labels) -> float:
        text = httpx.get(server.url + "/metrics", timeout=30).text
        return next((s.value for f in text_string_to_metric_families(text) for s in f.samples
                     if s.name == name and s.labels == labels), 0.0)

    before = (sample("pagoda_requests_finished_total", finish_reason="stop"), sample("pagoda_prompt_tokens_total"),
              sample("pagoda_e2e_request_latency_seconds_count"), sample("pagoda_generation_tokens_total"))
    body = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": [[1, 2, 3], [4, 5, 6, 7]]},
                      timeout=60).json()
    assert body["usage"]["prompt_tokens"] == 7
    after = (sample("pagoda_requests_finished_total", finish_reason="stop"), sample("pagoda_prompt_tokens_total"),
             sample("pagoda_e2e_request_latency_seconds_count"), sample("pagoda_generation_tokens_total"))
    assert [b - a for a, b in zip(before, after)] == [2, 7, 2, 0]


def test_pooling_over_two_data_parallel_replicas_gives_the_same_numbers(checkpoint):
    """The front of engines in other processes carries pooling: LLM.embed and LLM.score over two replicas equal
    one engine's (the pooled tensors cross processes as arrays)."""
    from pagoda import LLM

    docs = ["the cat sat", "a dog ran far away", "tea", "some other words here"]
    results = []
    for size in (1, 2):
        llm = LLM(model=str(checkpoint[0]), data_parallel_size=size, **{**POOLING, "runner": "pooling"})
        try:
            results.append(([o.outputs.embedding for o in llm.embed(docs)],
                            [o.outputs.score for o in llm.score("which animal?", docs)]))
        finally:
            llm.shutdown()
    (embed_1, score_1), (embed_2, score_2) = results
    assert torch.allclose(torch.tensor(embed_1), torch.tensor(embed_2), atol=1e-5)
    assert torch.allclose(torch.tensor(score_1), torch.tensor(score_2), atol=1e-5)
