"""Every error a user can cause is clear, names what is wrong, and leaves other requests alone."""

import json
import shutil

import pytest
from pagoda import LLM, SamplingParams
from pagoda.errors import ConfigError, ModelLoadError, PluginError, RequestError
from pagoda.testing import make_tiny_checkpoint
from safetensors.torch import load_file, save_file

TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("good"), tokenizer=True, **TINY)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(model=str(ckpt), device="cpu", dtype="float32", num_kv_blocks=32, block_size=8,
               max_model_len=64)


def variant(ckpt, tmp_path, edit_config=None, edit_weights=None):
    out = tmp_path / "variant"
    shutil.copytree(ckpt, out)
    if edit_config:
        cfg = json.loads((out / "config.json").read_text())
        edit_config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    if edit_weights:
        path = out / "model.safetensors"
        tensors = load_file(path)
        edit_weights(tensors, path)
    return str(out)


def test_unknown_architecture(ckpt, tmp_path):
    path = variant(ckpt, tmp_path, edit_config=lambda c: c.update(architectures=["FrobnicatorForCausalLM"]))
    with pytest.raises(ModelLoadError, match="FrobnicatorForCausalLM is not supported.*LlamaForCausalLM"):
        LLM(model=path, device="cpu", num_kv_blocks=8)


def test_missing_weight(ckpt, tmp_path):
    def drop(tensors, path):
        del tensors["model.layers.0.mlp.down_proj.weight"]
        save_file(tensors, path)

    with pytest.raises(ModelLoadError, match="lacks weights.*down_proj"):
        LLM(model=variant(ckpt, tmp_path, edit_weights=drop), device="cpu", num_kv_blocks=8)


def test_unexpected_weight(ckpt, tmp_path):
    def extra(tensors, path):
        tensors["model.layers.0.mlp.bogus.weight"] = tensors["model.norm.weight"].clone()
        save_file(tensors, path)

    with pytest.raises(ModelLoadError, match="model.safetensors: tensor 'model.layers.0.mlp.bogus.weight'"):
        LLM(model=variant(ckpt, tmp_path, edit_weights=extra), device="cpu", num_kv_blocks=8)


def test_shape_mismatch_names_tensor_and_shapes(ckpt, tmp_path):
    path = variant(ckpt, tmp_path, edit_config=lambda c: c.update(intermediate_size=48))
    pattern = r"tensor .model.layers.0.mlp.[a-z_]+.weight.*has shape \(\d+, \d+\) in the checkpoint but the model"
    with pytest.raises(ModelLoadError, match=pattern):
        LLM(model=path, device="cpu", num_kv_blocks=8)


def test_corrupt_safetensors(ckpt, tmp_path):
    def corrupt(tensors, path):
        path.write_bytes(b"\x00\x01not a safetensors file")

    with pytest.raises(ModelLoadError, match="model.safetensors is not a readable safetensors file"):
        LLM(model=variant(ckpt, tmp_path, edit_weights=corrupt), device="cpu", num_kv_blocks=8)


def test_corrupt_and_truncated_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match=r"bad.gguf is not a readable GGUF file: no GGUF magic"):
        LLM(model=str(bad), device="cpu")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little") + (5).to_bytes(8, "little"))
    with pytest.raises(ModelLoadError, match=r"cut.gguf is not a readable GGUF file"):
        LLM(model=str(cut), device="cpu")


def test_missing_model_path_and_bad_config_values(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"), device="cpu")
    with pytest.raises(ConfigError, match="'block_size'.*greater than 0"):
        LLM(model=str(tmp_path), block_size=0)
    with pytest.raises(ConfigError, match="unknown key 'max_num_seq'; did you mean 'max_num_seqs'"):
        LLM(model=str(tmp_path), max_num_seq=4)
    with pytest.raises(ConfigError, match="'dtype'.*float32, float16, bfloat16"):
        LLM(model=str(tmp_path), dtype="float13")


def test_unavailable_device_is_an_error(ckpt):
    with pytest.raises(PluginError, match="'quantumchip' is not a registered platform"):
        LLM(model=str(ckpt), device="quantumchip")


def test_bad_requests_are_rejected_and_others_unaffected(llm):
    engine = llm.engine
    good = engine.add_request("good", [5, 6, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    with pytest.raises(RequestError) as err:
        engine.add_request("long", list(range(4, 80)), SamplingParams(max_tokens=4))
    assert err.value.field == "prompt" and "max_model_len is 64" in str(err.value)
    for field, value in [("temperature", -1.0), ("top_p", 0.0), ("top_k", -3), ("max_tokens", 0),
                         ("presence_penalty", 5.0), ("logprobs", 1000), ("min_p", 2.0)]:
        with pytest.raises(RequestError) as err:
            engine.add_request(None, [5, 6], SamplingParams(**{field: value}))
        assert err.value.field == field and field in str(err.value)
    with pytest.raises(RequestError, match=r"token ids must be integers in \[0, 300\)"):
        engine.add_request(None, [5, 999], SamplingParams())
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("good", [5], SamplingParams())
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert set(outputs) == {good} and len(outputs[good].outputs[0].token_ids) == 6
    assert engine.get_stats()["kv_blocks_used"] == 0


def test_aborted_request_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request("b", [9, 10], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    assert engine.get_stats()["kv_blocks_used"] > 0
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats()["kv_blocks_used"] == 0 and engine.get_stats()["num_running"] == 0


def test_text_prompt_and_stop_strings(llm):
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    text = out.outputs[0].text
    assert out.prompt_token_ids == llm.tokenizer.encode("hello")
    assert text == llm.tokenizer.decode(out.outputs[0].token_ids)
    if len(text) > 3:
        stop = text[2:4]
        cut = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=12, stop=[stop]))[0].outputs[0]
        assert cut.finish_reason == "stop" and cut.stop_reason == stop and cut.text == text[: text.index(stop)]


def test_dynamic_rope_scaling_extends_max_model_len(tmp_path):
    from pagoda import LLM, SamplingParams

    cfg = dict(TINY, max_position_embeddings=32,
               rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    path = make_tiny_checkpoint("llama", tmp_path / "dyn", **cfg)
    llm = LLM(model=str(path), device="cpu", num_kv_blocks=16, block_size=8, max_model_len=64)
    out = llm.generate([list(range(4, 44))], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 20  # positions up to 59, past the trained 32
    with pytest.raises(ConfigError, match="max_model_len=65 exceeds"):
        LLM(model=str(path), device="cpu", num_kv_blocks=16, block_size=8, max_model_len=65)
