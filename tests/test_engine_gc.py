"""The engine keeps Python's cyclic garbage collector off the serving path (gc.freeze after start-up)."""

import gc

from pagoda import LLM, SamplingParams
from pagoda.testing import make_tiny_checkpoint

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64)


def test_startup_objects_are_out_of_the_collectors_view(tmp_path):
    """After start-up the engine's objects are frozen: collections during serving no longer scan the model;
    what serving allocates is still tracked."""
    path = make_tiny_checkpoint("llama", tmp_path, seed=0, **TINY)
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=16, block_size=8)
    model = llm.engine.runner.model
    assert gc.get_freeze_count() > 0
    assert not any(o is model for o in gc.get_objects())  # frozen objects are in no generation
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert any(o is out for o in gc.get_objects())  # made while serving: tracked as usual
