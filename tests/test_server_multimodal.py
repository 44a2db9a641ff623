"""Images through the server (docs/multimodal.md): the openai client sends a data-URL image and gets
transformers' greedy tokens; Ollama's base64 images do the same; a refused URL, a corrupt image or
too many images is a 400 naming the content part. With the engine in its own process and on a thread."""

import base64
import io

import httpx
import pytest
from pagoda.config import EngineConfig
from pagoda.server import ServerConfig, ServerThread, build_app
from pagoda.testing.vision import hf_greedy, make_tiny_qwen2_5_vl, random_image

MAX_TOKENS = 8
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module", params=[True, False], ids=["engine-process", "thread"])
def setup(tmp_path_factory, request):
    """The server with the engine in its own process (the default: the front processes the images, the engine
    process encodes them) and on a thread of the server's."""
    directory = tmp_path_factory.mktemp("qwen2_5_vl")
    hf = make_tiny_qwen2_5_vl(directory)
    hf.generation_config.eos_token_id = None
    engine = EngineConfig(model=str(directory), device="cpu", dtype="float32", max_model_len=256, seed=0,
                          limit_mm_per_prompt={"image": 2})
    server = ServerConfig(served_model_name="tiny-vl", media_fetch=False, engine_process=request.param)
    with ServerThread(build_app(engine, server)) as srv:
        assert hasattr(srv.app.state.async_engine.engine, "replicas") is request.param
        yield srv, directory, hf


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def expected_text(directory, hf, prompt: str, images) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    ids = tok.encode(prompt, add_special_tokens=False)
    return tok.decode(hf_greedy(hf, directory, ids, images, MAX_TOKENS), skip_special_tokens=True)


def test_openai_client_sends_a_data_url_image(setup):
    import openai

    srv, directory, hf = setup
    image = random_image(120, 90, 5)
    url = "data:image/png;base64," + base64.b64encode(png(image)).decode()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model="tiny-vl", max_tokens=MAX_TOKENS, temperature=0, extra_body={
        "ignore_eos": True}, messages=[{"role": "user", "content": [
            {"type": "text", "text": "look: "}, {"type": "image_url", "image_url": {"url": url}}]}])
    want = expected_text(directory, hf, f"<s>user: look: {IMAGE}\n<s>assistant: ", [image])
    assert reply.choices[0].message.content == want
    assert reply.usage.prompt_tokens > 12  # the image's tokens count


def test_ollama_images(setup):
    srv, directory, hf = setup
    image = random_image(90, 120, 6)
    body = {"model": "tiny-vl", "stream": False, "options": {"num_predict": MAX_TOKENS, "temperature": 0},
            "messages": [{"role": "user", "content": "what", "images": [base64.b64encode(png(image)).decode()]}]}
    reply = httpx.post(srv.url + "/api/chat", json=body, timeout=60).json()
    want = expected_text(directory, hf, f"<s>user: {IMAGE}what\n<s>assistant: ", [image])
    got = reply["message"]["content"]
    assert got and want.startswith(got)  # (Ollama has no ignore_eos: the reply may end early at EOS)
    body["messages"][0]["images"].append(base64.b64encode(b"not an image").decode())
    r = httpx.post(srv.url + "/api/chat", json=body, timeout=60)
    assert r.status_code == 400 and "messages[0].images[1]" in r.json()["error"]
    r = httpx.post(srv.url + "/api/generate", timeout=60, json={"model": "tiny-vl", "prompt": "x", "stream": False,
                                                                "images": ["%%%"]})
    assert r.status_code == 400 and r.json()["error"].startswith("images[0]:")


@pytest.mark.parametrize("part, param, needle", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
     "messages[0].content[1].image_url.url", "media_fetch is off"),
    ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
     "messages[0].content[1].image_url.url", "scheme 'file'"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}},
     "messages[0].content[1]", "not a readable image"),
])
def test_bad_image_parts_are_400_naming_the_part(setup, part, param, needle):
    srv, _, _ = setup
    body = {"model": "tiny-vl", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"] and param in error["message"]
    assert error["code"] == "invalid_image"


def test_too_many_images_is_400(setup):
    srv, _, _ = setup
    url = "data:image/png;base64," + base64.b64encode(png(random_image(28, 28))).decode()
    parts = [{"type": "image_url", "image_url": {"url": url}}] * 3
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny-vl", "max_tokens": 2, "messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[2]"
    assert "limit_mm_per_prompt" in r.json()["error"]["message"]
    ok = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny-vl", "max_tokens": 2, "messages": [{"role": "user", "content": parts[:2]}]})
    assert ok.status_code == 200  # the server serves on
