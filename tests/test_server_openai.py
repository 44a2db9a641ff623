"""The OpenAI API of `pagoda serve`, through the real `openai` client on loopback: models,
completions and chat (streamed and not), n, seed, stop, logprobs, penalties, usage, prefix
cache, API keys. One server (tiny random Llama with a byte tokenizer) for the module."""

import httpx
import openai
import pytest
from pagoda.config import EngineConfig
from pagoda.server import ServerConfig, ServerThread, build_app
from pagoda.testing import make_tiny_checkpoint
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server_checks import check_blocks

KEY = "sk-test-key"
TINY = dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
CHAT = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("openai"), seed=1, tokenizer=True, **TINY)
    engine = EngineConfig(model=str(path), device="cpu", dtype="float32", num_kv_blocks=256, block_size=8,
                          max_num_seqs=16)
    app = build_app(engine, ServerConfig(api_keys=[KEY], served_model_name="tiny"))
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=30)


@pytest.fixture(autouse=True)
def engine_left_clean(server):
    yield
    stats = wait_idle(server)
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0


def wait_idle(server, timeout=10.0):
    import time

    engine = server.app.state.async_engine
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.call_sync(lambda e: e.get_stats())
        if (stats["num_running"] == stats["num_waiting"] == stats["kv_blocks_used"] == 0
                and engine.num_unfinished() == 0) or time.monotonic() > deadline:
            engine.call_sync(check_blocks)
            return stats


def metric(server, name, **labels) -> float:
    text = httpx.get(server.url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_models_and_model_lookup(client):
    (card,) = client.models.list().data
    assert card.id == "tiny" and card.owned_by == "pagoda" and card.max_model_len == 256
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-nothing")


def test_streaming_and_non_streaming_give_the_same_greedy_text(client):
    kw = dict(model="tiny", temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
    full = client.completions.create(prompt="Once upon a time", **kw)
    chunks = list(client.completions.create(prompt="Once upon a time", stream=True,
                                            stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens == len("Once upon a time")  # a token a byte

    chat = client.chat.completions.create(messages=CHAT, **kw)
    stream = list(client.chat.completions.create(messages=CHAT, stream=True, **kw))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == chat.choices[0].finish_reason == "length"
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 24


def test_n_and_seed_are_reproducible(client):
    kw = dict(model="tiny", messages=CHAT, max_completion_tokens=12, temperature=1.0, top_p=0.95, n=3,
              extra_body={"ignore_eos": True})
    a = client.chat.completions.create(seed=7, **kw)
    b = client.chat.completions.create(seed=7, **kw)
    c = client.chat.completions.create(seed=8, **kw)
    texts = [ch.message.content for ch in a.choices]
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert texts == [ch.message.content for ch in b.choices]
    assert len(set(texts)) > 1  # each completion has its own seed (seed + index)
    assert texts != [ch.message.content for ch in c.choices]
    assert a.usage.completion_tokens == 3 * 12  # counted over every completion
    assert all(ch.finish_reason == "length" for ch in a.choices)


def test_stop_string_ends_the_text_in_both_modes(client):
    kw = dict(model="tiny", prompt="xyz", temperature=0, max_tokens=40, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    # a two-character stop string that first appears well inside the text
    k = next(k for k in range(5, len(text) - 2) if text.find(text[k:k + 2]) == k)
    stop, cut = text[k:k + 2], text[:k]
    full = client.completions.create(stop=[stop, "never-there"], **kw).choices[0]
    assert full.text == cut and full.finish_reason == "stop"
    streamed = list(client.completions.create(stop=[stop, "never-there"], stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == cut  # nothing past the stop string leaked


def test_logprobs_in_both_apis(client):
    out = client.completions.create(model="tiny", prompt="xyz", temperature=0, max_tokens=6, logprobs=3,
                                    extra_body={"ignore_eos": True}).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and chosen <= 0  # keyed by text: tokens decoding alike share a key
        assert max(top.values()) == pytest.approx(chosen)  # greedy picks the most likely token
        assert top[tok] == pytest.approx(chosen)
    assert "".join(lp.tokens) == out.text
    chat = client.chat.completions.create(model="tiny", messages=CHAT, temperature=0, max_tokens=5, logprobs=True,
                                          top_logprobs=2, extra_body={"ignore_eos": True}).choices[0]
    content = chat.logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)
    streamed = list(client.chat.completions.create(model="tiny", messages=CHAT, temperature=0, max_tokens=5,
                                                   logprobs=True, top_logprobs=2, stream=True,
                                                   extra_body={"ignore_eos": True}))
    tokens = [t.token for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert tokens == [c.token for c in content]


def test_penalties_change_a_repetitive_greedy_text(client):
    kw = dict(model="tiny", prompt="hello", temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0].text
    penalised = client.completions.create(frequency_penalty=2.0, presence_penalty=2.0, **kw).choices[0].text
    assert len(set(penalised)) > len(set(plain))  # repeated characters are pushed down


def test_several_prompts_token_ids_and_echo(server, client):
    kw = dict(model="tiny", temperature=0, max_tokens=5, extra_body={"ignore_eos": True})
    single = [client.completions.create(prompt=p, **kw).choices[0].text for p in ("ab", "cd")]
    both = client.completions.create(prompt=["ab", "cd"], n=2, **kw)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [single[0]] * 2 + [single[1]] * 2
    streamed = list(client.completions.create(prompt=["ab", "cd"], stream=True, **kw))
    by_index = {}
    for chunk in streamed:
        for ch in chunk.choices:
            by_index[ch.index] = by_index.get(ch.index, "") + ch.text
    assert [by_index[0], by_index[1]] == single
    ids = server.app.state.frontend.tokenizer.encode("ab")  # one token per byte
    assert client.completions.create(prompt="ab", **kw).usage.prompt_tokens == len(ids) == 2
    by_ids = client.completions.create(prompt=ids, **kw)
    assert by_ids.usage.prompt_tokens == 2 and by_ids.choices[0].text == single[0]
    echoed = client.completions.create(prompt="ab", echo=True, **kw).choices[0].text
    assert echoed == "ab" + single[0]


def test_repeated_system_prompt_is_served_from_the_prefix_cache(server, client):
    system = {"role": "system", "content": "You are a terse assistant. " * 4}
    kw = dict(model="tiny", temperature=0, max_tokens=4, extra_body={"ignore_eos": True})
    first = client.chat.completions.create(messages=[system, {"role": "user", "content": "one"}], **kw)
    before = metric(server, "pagoda_prefill_tokens_computed_total")
    second = client.chat.completions.create(messages=[system, {"role": "user", "content": "two"}], **kw)
    computed = metric(server, "pagoda_prefill_tokens_computed_total") - before
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < cached  # the system prompt (whole blocks)
    assert cached >= 100 and computed == second.usage.prompt_tokens - cached
    assert metric(server, "pagoda_prefix_cache_hit_tokens_total") >= cached


def test_api_key_is_required_on_the_api_but_not_on_health(server):
    body = {"model": "tiny", "prompt": "a", "max_tokens": 2}
    missing = httpx.post(server.url + "/v1/completions", json=body)
    wrong = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    for r in (missing, wrong):
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert "missing" in missing.json()["error"]["message"] and "invalid" in wrong.json()["error"]["message"]
    assert httpx.get(server.url + "/api/tags").status_code == 401  # the Ollama API too
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()
    ok = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert metric(server, "pagoda_http_requests_total", route="/v1/completions", status="401") >= 2


def test_truncate_prompt_tokens_keeps_the_prompts_end(server, client):
    """vLLM's ``truncate_prompt_tokens`` on completions and chat: the prompt's last N tokens are what the
    model sees (the same text as sending only them; echo shows them); -1 keeps what the context holds;
    over max_model_len or below -1 is a 400 naming the field."""
    kw = dict(model="tiny", temperature=0, max_tokens=5, extra_body={"ignore_eos": True})
    ids = server.app.state.frontend.tokenizer.encode("the quick brown fox")
    short = client.completions.create(prompt=ids[-6:], **kw)
    cut = client.completions.create(prompt="the quick brown fox", **{
        **kw, "extra_body": {"ignore_eos": True, "truncate_prompt_tokens": 6}})
    assert cut.usage.prompt_tokens == 6 and cut.choices[0].text == short.choices[0].text
    echoed = client.completions.create(prompt="the quick brown fox", echo=True, **{
        **kw, "extra_body": {"ignore_eos": True, "truncate_prompt_tokens": 6}})
    tail = server.app.state.frontend.tokenizer.decode(ids[-6:])
    assert echoed.choices[0].text == tail + short.choices[0].text
    whole = client.completions.create(prompt="the quick brown fox", **{
        **kw, "extra_body": {"ignore_eos": True, "truncate_prompt_tokens": -1}})
    assert whole.usage.prompt_tokens == len(ids)
    chat = client.chat.completions.create(messages=CHAT, **{
        **kw, "extra_body": {"ignore_eos": True, "truncate_prompt_tokens": 5}})
    assert chat.usage.prompt_tokens == 5
    for bad in (257, -5, 0):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(prompt="ab", **{**kw, "extra_body": {"truncate_prompt_tokens": bad}})
        assert info.value.body["param"] == "truncate_prompt_tokens", info.value.body


def test_a_requests_own_chat_template_needs_the_servers_trust(server, client):
    """A request's chat_template is code the server runs (a nested loop held a server for everyone), so it
    is a 400 (`untrusted_chat_template`) unless the server trusts request templates, as vLLM's
    --trust-request-chat-template; trusted, it renders the conversation."""
    template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    kw = dict(model="tiny", messages=CHAT, max_tokens=2, extra_body={"chat_template": template})
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**kw)
    assert info.value.body["param"] == "chat_template" and info.value.body["code"] == "untrusted_chat_template"
    fe = server.app.state.frontend
    fe.config.trust_request_chat_template = True
    try:
        reply = client.chat.completions.create(**kw)
        _, ids = fe.chat_prompt_ids(CHAT, chat_template=template)
    finally:
        fe.config.trust_request_chat_template = False
    assert reply.usage.prompt_tokens == len(ids) == len(fe.tokenizer.encode("<Tell me a story.>",
                                                                              add_special_tokens=False))


def test_prompts_are_tokenized_off_the_event_loop(server, client, monkeypatch):
    """Rendering and tokenizing a prompt (tens of ms for a long one) runs on the frontend's tokenizer
    thread, so it does not stall the event loop that streams every other request."""
    import threading

    fe = server.app.state.frontend
    seen = []
    encode, render = fe.encode, fe.chat_prompt_ids
    monkeypatch.setattr(fe, "encode",
                        lambda *a, **k: (seen.append(threading.current_thread().name), encode(*a, **k))[1])
    monkeypatch.setattr(fe, "chat_prompt_ids",
                        lambda *a, **k: (seen.append(threading.current_thread().name), render(*a, **k))[1])
    client.completions.create(model="tiny", prompt="ab", max_tokens=2)
    client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
    assert len(seen) >= 2 and all(name.startswith("pagoda-tokenize") for name in seen), seen
