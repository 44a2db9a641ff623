"""Images in (docs/multimodal.md): a tiny Qwen2.5-VL made with transformers gives transformers' greedy
tokens for one image, two images and text only, batched with chunked prefill through an image and
preemption; prefix caching hits for a repeated image and misses for another; LLM.chat with image
parts; the limits and errors of bad image inputs."""

import io

import pytest
from pagoda import LLM, SamplingParams
from pagoda.errors import RequestError
from pagoda.testing.vision import hf_greedy, make_tiny_qwen2_5_vl, random_image

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", enforce_eager=True, seed=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2_5_vl")
    hf = make_tiny_qwen2_5_vl(directory)
    hf.generation_config.eos_token_id = None
    images = {"a": random_image(120, 90, 1), "b": random_image(200, 150, 2), "c": random_image(120, 90, 3)}
    return directory, hf, images


@pytest.fixture(scope="module")
def cases(tiny):
    """(prompt text, image names) -> transformers' greedy tokens."""
    directory, hf, images = tiny
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    prompts = {
        "one": (f"a {IMAGE} describe it", ["a"]),
        "two": (f"first {IMAGE} then {IMAGE} compare", ["a", "b"]),
        "text": ("just some text, no picture at all", []),
        "other": (f"a {IMAGE} describe it", ["c"]),
    }
    return {name: (text, names, hf_greedy(hf, directory, tok.encode(text), [images[n] for n in names], MAX_TOKENS))
            for name, (text, names) in prompts.items()}


def request(text, names, images):
    data = {"image": [images[n] for n in names]} if names else None
    return {"prompt": text, "multi_modal_data": data} if data else {"prompt": text}


def test_batched_chunked_preempted_matches_transformers(tiny, cases):
    directory, _, images = tiny
    # 4-token blocks, 16-token steps (chunks cut through every image), a cache too small for the batch
    llm = LLM(str(directory), block_size=4, max_num_batched_tokens=16, num_kv_blocks=24, max_model_len=96,
              max_num_seqs=4, enable_prefix_caching=False, **ENGINE)
    names = list(cases)
    assert cases["one"][2] != cases["other"][2]  # the image changes the answer (the test can fail)
    outs = llm.generate([request(*cases[n][:2], images) for n in names], GREEDY)
    for name, out in zip(names, outs):
        assert out.outputs[0].token_ids == cases[name][2], name
    assert llm.get_stats()["num_preemptions"] > 0
    assert llm.engine.runner.multimodal.cache.num_encoded == 3  # a, b, c once each, preemption included
    single = LLM(str(directory), **ENGINE).generate(request(*cases["one"][:2], images), GREEDY)
    assert single[0].outputs[0].token_ids == cases["one"][2]


def test_two_replicas_take_images_through_their_front(tiny, cases):
    """data_parallel_size=2: the front processes the images (a model built on the meta device answers for the
    placeholders and positions), each replica encodes its requests' images: transformers' tokens, in order."""
    directory, _, images = tiny
    llm = LLM(str(directory), data_parallel_size=2, **ENGINE)
    try:
        names = list(cases)
        outs = llm.generate([request(*cases[n][:2], images) for n in names], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == [cases[n][2] for n in names]
        assert all(r["generated_tokens"] > 0 for r in llm.get_stats()["data_parallel"])  # both served some
        with pytest.raises(RequestError, match="placeholders") as err:  # the front's check, before any replica
            llm.engine.add_request(None, "no placeholder", multi_modal_data={"image": images["a"]})
        assert err.value.field == "prompt"
    finally:
        llm.shutdown()


def test_prefix_cache_hits_for_same_image_only(tiny, cases):
    directory, _, images = tiny
    llm = LLM(str(directory), block_size=4, enable_prefix_caching=True, **ENGINE)
    text, names, expected = cases["one"]
    first = llm.generate(request(text, names, images), GREEDY)[0]
    again = llm.generate(request(text, names, images), GREEDY)[0]
    other_text, other_names, other_expected = cases["other"]
    other = llm.generate(request(other_text, other_names, images), GREEDY)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == expected
    image_end = len(llm.get_tokenizer().encode("a <|vision_start|>")) + 12  # 120x90 -> 12 image tokens
    assert again.num_cached_tokens >= image_end
    assert other.num_cached_tokens < image_end - 12  # only the blocks before the image
    assert other.outputs[0].token_ids == other_expected


def test_chat_with_image_parts(tiny, cases):
    directory, hf, images = tiny
    llm = LLM(str(directory), **ENGINE)
    buf = io.BytesIO()
    images["a"].save(buf, format="PNG")
    import base64

    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is "},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    out = llm.chat(messages, GREEDY)[0]
    ids = llm.get_tokenizer().encode(f"<s>user: what is {IMAGE}\n<s>assistant: ", add_special_tokens=False)
    assert out.outputs[0].token_ids == hf_greedy(hf, directory, ids, [images["a"]], MAX_TOKENS)


def test_bad_image_inputs_are_request_errors(tiny):
    directory, _, images = tiny
    llm = LLM(str(directory), limit_mm_per_prompt={"image": 2}, **ENGINE)
    with pytest.raises(RequestError, match="limit_mm_per_prompt") as err:
        llm.generate({"prompt": IMAGE * 3, "multi_modal_data": {"image": [images["a"]] * 3}})
    assert err.value.field == "prompts[0].multi_modal_data.image[2]"
    with pytest.raises(RequestError, match="2 image placeholders .* for 1 images"):
        llm.generate({"prompt": IMAGE * 2, "multi_modal_data": {"image": images["a"]}})
    with pytest.raises(RequestError, match="not a readable image") as err:
        llm.generate({"prompt": IMAGE, "multi_modal_data": {"image": b"not a png"}})
    assert err.value.field == "prompts[0].multi_modal_data.image"
    with pytest.raises(RequestError, match="scheme 'ftp'") as err:
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}]}])
    assert err.value.field == "messages[0].content[0].image_url.url"
    assert not llm.engine.has_unfinished_requests()


def test_text_only_model_says_it_takes_no_images(tmp_path):
    import torch
    from pagoda.testing.reference import save_byte_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=128)).save_pretrained(tmp_path)
    save_byte_tokenizer(tmp_path, 320)
    llm = LLM(str(tmp_path), **ENGINE)
    with pytest.raises(RequestError, match="text-only"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": random_image(28, 28)}})
    with pytest.raises(RequestError, match="text-only") as err:
        llm.chat([{"role": "user", "content": [{"type": "text", "text": "hi"},
                                               {"type": "image_pil", "image_pil": random_image(28, 28)}]}])
    assert err.value.field == "messages[0].content[1]"


def test_bench_throughput_image_workload(tiny, tmp_path, capsys):
    import json

    from pagoda.cli.main import main

    directory = tiny[0]
    out = tmp_path / "bench.json"
    assert main(["bench", "throughput", "--model", str(directory), "--device", "cpu", "--dtype", "float32",
                 "--num-prompts", "3", "--input-len", "8", "--output-len", "4", "--ignore-eos", "--repeats", "1",
                 "--warmup-prompts", "0", "--images-per-prompt", "2", "--image-size", "64x48",
                 "--bandwidth-gbs", "10", "--matmul-tflops", "0.1", "--json", str(out)]) == 0
    assert "images/s" in capsys.readouterr().out
    best = json.loads(out.read_text())["best"]
    assert best["images"] == 6 and best["images_per_s"] > 0 and best["output_tokens"] == 12
    assert best["input_tokens"] > 3 * (8 + 2)  # the images' tokens are input tokens


def test_cli_generate_with_image(tiny, tmp_path, capsys):
    import json

    from pagoda.cli.main import main

    directory, hf, images = tiny
    path = tmp_path / "a.png"
    images["a"].save(path)
    assert main(["generate", "--model", str(directory), "--device", "cpu", "--dtype", "float32", "--chat",
                 "--image", str(path), "--prompt", "what", "--max-tokens", str(MAX_TOKENS), "--ignore-eos",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["outputs"][0]["token_ids"]
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(directory)).encode(f"<s>user: {IMAGE}what\n<s>assistant: ",
                                                              add_special_tokens=False)
    assert got == hf_greedy(hf, directory, ids, [images["a"]], MAX_TOKENS)


def test_fetch_http_image_with_limits(tmp_path):
    import functools
    import http.server
    import threading

    from pagoda.multimodal.fetch import FetchPolicy, fetch_image_bytes

    random_image(40, 30).save(tmp_path / "a.png")
    data = (tmp_path / "a.png").read_bytes()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a, **k: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        assert fetch_image_bytes(url + "/a.png", "f") == data
        with pytest.raises(RequestError, match="larger than media_max_bytes"):
            fetch_image_bytes(url + "/a.png", "f", FetchPolicy(max_bytes=len(data) - 1))
        with pytest.raises(RequestError, match="HTTP 404"):
            fetch_image_bytes(url + "/missing.png", "f")
        with pytest.raises(RequestError, match="media_fetch is off"):
            fetch_image_bytes(url + "/a.png", "f", FetchPolicy(allow_http=False))
    finally:
        httpd.shutdown()
