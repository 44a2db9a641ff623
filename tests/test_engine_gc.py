"""Processes that keep one engine for their whole life freeze what start-up made (gc.freeze), so that
the cyclic collector no longer scans the engine during serving; a frozen engine is released before
it is dropped."""

import gc
import json

from pagoda import LLM, SamplingParams
from pagoda.cli.main import main
from pagoda.engine.gc_freeze import freeze_startup_objects, release_startup_objects
from pagoda.testing import make_tiny_checkpoint

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64)


def _tracked(obj) -> bool:
    return any(o is obj for o in gc.get_objects())  # frozen objects are in no generation


def test_frozen_engine_is_out_of_the_collectors_view_until_released(tmp_path):
    path = make_tiny_checkpoint("llama", tmp_path, seed=0, **TINY)
    llm = LLM(model=str(path), device="cpu", dtype="float32", num_kv_blocks=16, block_size=8)
    model = llm.engine.runner.model
    assert _tracked(model)  # the Python API does not freeze
    freeze_startup_objects()
    try:
        assert not _tracked(model)
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
        assert _tracked(out)  # what serving allocates is collected as usual
    finally:
        release_startup_objects()
    assert _tracked(model) and gc.get_freeze_count() == 0


def test_bench_freezes_its_engine_and_releases_it(tmp_path, monkeypatch):
    from pagoda.engine import gc_freeze

    calls = []
    monkeypatch.setattr(gc_freeze, "freeze_startup_objects", lambda: (calls.append(1), freeze_startup_objects()))
    path = make_tiny_checkpoint("llama", tmp_path / "m", seed=0, **TINY)
    out = tmp_path / "r.json"
    assert main(["bench", "throughput", "--model", str(path), "--device", "cpu", "--dtype", "float32",
                 "--num-prompts", "2", "--input-len", "4", "--output-len", "3", "--repeats", "1",
                 "--num-kv-blocks", "16", "--bandwidth-gbs", "10", "--matmul-tflops", "0.1", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["best"]["output_tokens"] == 6
    assert calls == [1]
    assert gc.get_freeze_count() == 0  # the engine can be collected after the command
