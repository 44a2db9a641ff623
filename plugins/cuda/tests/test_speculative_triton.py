"""Speculative decoding through the Triton attention backends and kernel ops (interpreter on CPU,
CUDA graphs on a GPU): verification as decode rows (the decode kernel, replayed from the decode
graphs on CUDA) keeps greedy outputs equal to transformers'."""

import pytest
from pagoda import LLM, SamplingParams
from pagoda.testing import hf_greedy_tokens, make_tiny_checkpoint, random_prompts
from test_model_triton import MODELS, triton_ops_here  # noqa: F401  (the fixture)


@pytest.mark.parametrize("model_type", ["qwen3", "deepseek_v3"])
def test_speculative_greedy_matches_transformers_on_triton(tmp_path, device, triton_ops_here, model_type):  # noqa: F811
    path = make_tiny_checkpoint(model_type, tmp_path, seed=1, **MODELS[model_type])
    prompts = random_prompts(2, 320, 5, 20, seed=7)
    want = hf_greedy_tokens(path, prompts, 6)
    backend = {"deepseek_v3": "triton_mla"}.get(model_type, "triton")
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 2}
    # decode rows (the form graphs replay); a verification as a chunk is the prefill kernel against a cached
    # context, as chunked prefill runs it (test_model_triton), and is checked on the CPU backends in tests/
    for as_decodes in (True,):
        llm = LLM(model=str(path), device=device.type, dtype="float32", attention_backend=backend, num_kv_blocks=48,
                  block_size=8, max_num_batched_tokens=24, max_model_len=64, max_num_seqs=4,
                  enforce_eager=device.type == "cpu", speculative_config=spec)
        decoder = llm.engine.speculative
        decoder.verify_as_decodes = None if device.type == "cuda" and as_decodes else as_decodes
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == want
        assert llm.get_stats()["speculative"]["accepted_tokens"] > 0
        assert (decoder.verified_as_decodes > 0) is as_decodes
        if device.type == "cuda" and as_decodes:
            assert llm.engine.runner.graphs is not None
