"""``pagoda attention-map``: the probabilities captured through the reference backend equal
transformers' attention weights, the statistics mean what they say, and the PNG / HTML
outputs are valid files of the documented size."""

import json
import math
import struct

import pytest
import torch
from pagoda import LLM
from pagoda.cli.attention_map import figure_pixels
from pagoda.cli.main import main
from pagoda.testing import load_reference_model, make_tiny_checkpoint, random_prompts
from pagoda.testing.attention import capture_attention, head_statistics

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("attn"), seed=5, tokenizer=True, **TINY)


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_captured_maps_equal_transformers_attention_weights(model_dir):
    prompt = random_prompts(1, 320, 19, 19, seed=2)[0]
    llm = LLM(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=4, block_size=8, max_model_len=32)
    capture = capture_attention(llm, prompt)
    assert (capture.num_layers, capture.num_heads) == (2, 4)
    hf = load_reference_model(model_dir)
    hf.config._attn_implementation = "eager"  # eager attention returns its probabilities
    with torch.no_grad():
        weights = hf(torch.tensor([prompt]), output_attentions=True).attentions
    for layer, ref in enumerate(weights):
        torch.testing.assert_close(capture.maps[layer], ref[0].float(), atol=1e-5, rtol=1e-4)
    assert llm.engine.block_manager.num_used_blocks == 0  # the capture frees its blocks


def test_statistics_of_known_patterns():
    n = 6
    own = head_statistics(torch.eye(n))  # each query on itself
    assert own["entropy"] == 0 and own["mean_distance"] == 0 and own["local_share"] == 1
    assert own["first_token"] == 0
    first = torch.zeros(n, n)
    first[:, 0] = 1  # every query on the first token
    stats = head_statistics(first)
    assert stats["first_token"] == 1 and stats["mean_distance"] == pytest.approx(sum(range(n)) / n)
    uniform = torch.tril(torch.ones(n, n))
    uniform = uniform / uniform.sum(-1, keepdim=True)  # every query spread over all it may see
    stats = head_statistics(uniform)
    assert stats["normalized_entropy"] == pytest.approx(1.0)
    assert stats["entropy"] == pytest.approx(sum(math.log(q + 1) for q in range(n)) / n)


def test_png_grid_of_every_layer_and_head(model_dir, tmp_path, capsys):
    out = tmp_path / "map.png"
    assert main(["attention-map", "--model", str(model_dir), "--prompt", "the river and the bridge",
                 "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(h["layer"], h["head"]) for h in report["heads"]] == [(layer, h) for layer in range(2) for h in range(4)]
    assert all(0 <= h["first_token"] <= 1 and 0 <= h["local_share"] <= 1 and h["entropy"] >= 0
               for h in report["heads"])
    assert png_size(out) == figure_pixels(2, 4)
    from matplotlib.image import imread

    assert imread(str(out)).shape[:2] == tuple(reversed(figure_pixels(2, 4)))


def test_html_of_selected_heads(model_dir, tmp_path, capsys):
    out = tmp_path / "map.html"
    assert main(["attention-map", "--model", str(model_dir), "--prompt", "hello world", "--layer", "1",
                 "--head", "0,3", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    page = out.read_text()
    assert page.count("<img alt='layer 1' src='data:image/png;base64,") == 1
    assert page.count("<tr><td>1</td><td>") == 2  # heads 0 and 3 of layer 1


def test_bad_flags_are_explained(model_dir, tmp_path, capsys):
    assert main(["attention-map", "--model", str(model_dir), "--prompt", "x", "--layer", "7",
                 "--out", str(tmp_path / "m.png")]) == 1
    assert "--layer 7: out of range, the model has 2 (0..1)" in capsys.readouterr().err
    assert main(["attention-map", "--model", str(model_dir), "--prompt", "x", "--out", str(tmp_path / "m.jpg")]) == 1
    assert "must end in .png or .html" in capsys.readouterr().err
