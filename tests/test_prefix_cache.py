"""Automatic prefix caching through the engine: a repeated system prompt is not recomputed,
outputs are the same with and without the cache, and the cache can be reset safely."""

import subprocess
import sys

import pytest
from pagoda import LLM, SamplingParams
from pagoda.engine.block_manager import BlockManager, chain_hash
from pagoda.engine.sequence import Sequence
from pagoda.testing import make_tiny_checkpoint, random_prompts

VOCAB = 260
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
BLOCK = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("pc"), seed=3, **TINY)


def llm(path, cache: bool, **kw) -> LLM:
    return LLM(model=str(path), device="cpu", dtype="float32", block_size=BLOCK, enable_prefix_caching=cache,
               **{"num_kv_blocks": 128, **kw})


def test_repeated_system_prompt_is_not_recomputed(checkpoint):
    system = random_prompts(1, VOCAB, 40, 40, seed=1)[0]  # 5 full blocks
    questions = random_prompts(3, VOCAB, 5, 12, seed=2)
    engine = llm(checkpoint, cache=True)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    first = engine.generate([system + questions[0]], greedy)[0]
    before = engine.get_stats()
    assert before["prefill_tokens_computed"] == len(system) + len(questions[0])
    assert first.num_cached_tokens == 0

    outs = engine.generate([system + q for q in questions[1:]], greedy)
    after = engine.get_stats()
    # only the questions were computed; the 40 system tokens came from the cache, for each request
    assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] == sum(map(len, questions[1:]))
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == 2 * len(system)
    assert [o.num_cached_tokens for o in outs] == [len(system)] * 2
    assert after["kv_blocks_used"] == 0  # cached blocks are free (evictable) once requests end
    engine.engine.block_manager.check_invariants()


def test_siblings_of_a_request_compute_the_prompt_once(checkpoint):
    """n > 1: the first sample computes the prompt; its siblings wait one step and read the prompt's full
    blocks from the cache (only the partial last block is computed again); outputs do not change."""
    prompt = random_prompts(1, VOCAB, 35, 35, seed=9)[0]  # 4 full blocks of 8 and 3 tokens
    other = random_prompts(1, VOCAB, 12, 12, seed=10)[0]
    params = [SamplingParams(temperature=0.9, seed=4, n=4, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)]
    with_cache, without = llm(checkpoint, True), llm(checkpoint, False)
    got, want = with_cache.generate([prompt, other], params), without.generate([prompt, other], params)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert with_cache.get_stats()["prefill_tokens_computed"] == 35 + 3 * 3 + 12
    assert without.get_stats()["prefill_tokens_computed"] == 4 * 35 + 12
    assert [o.num_cached_tokens for o in got] == [0, 0]  # the first sibling's; the others read 32
    with_cache.engine.block_manager.check_invariants()


def _run_mixed(engine: LLM, prompts: list[list[int]]):
    """Sequential waves (later ones hit the cache), then everything at once with sampling."""
    results = []
    for i in range(0, len(prompts), 3):
        outs = engine.generate(prompts[i:i + 3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                                logprobs=2))
        results += [(o.outputs[0].token_ids, [e[t].logprob for e, t in zip(o.outputs[0].logprobs,
                                                                             o.outputs[0].token_ids)])
                    for o in outs]
    params = [SamplingParams(temperature=0.9, seed=i, n=2, max_tokens=12, ignore_eos=True, frequency_penalty=0.5,
                             presence_penalty=0.3) for i in range(len(prompts))]
    outs = engine.generate(prompts, params)
    results += [([c.token_ids for c in o.outputs], None) for o in outs]
    return results


@pytest.mark.parametrize("pressure", [False, True], ids=["roomy", "preempting"])
def test_outputs_equal_with_and_without_prefix_cache(checkpoint, pressure):
    system = random_prompts(1, VOCAB, 29, 29, seed=5)[0]
    prompts = [system + q for q in random_prompts(9, VOCAB, 1, 14, seed=6)]
    prompts += [p[: len(p) // 2] for p in prompts[:3]]  # prefixes of earlier prompts, some mid-block
    # pressure: few blocks and a small token budget, so prefills are chunked and sequences preempted
    kw = dict(num_kv_blocks=24, max_num_batched_tokens=16, max_model_len=64) if pressure else {}
    with_cache, without = llm(checkpoint, True, **kw), llm(checkpoint, False, **kw)
    a, b = _run_mixed(with_cache, prompts), _run_mixed(without, prompts)
    assert [x[0] for x in a] == [y[0] for y in b]
    for (_, la), (_, lb) in zip(a, b):
        if la is not None:
            assert la == pytest.approx(lb, abs=1e-4)
    sa, sb = with_cache.get_stats(), without.get_stats()
    assert sa["prefix_cache_hit_tokens"] > 0 and sb["prefix_cache_hit_tokens"] == 0
    assert sa["prefill_tokens_computed"] < sb["prefill_tokens_computed"]
    if pressure:
        assert sb["num_preemptions"] > 0
    for e in (with_cache, without):
        assert e.get_stats()["kv_blocks_used"] == 0
        e.engine.block_manager.check_invariants()


def _seq(tokens):
    return Sequence("r", 0, list(tokens), SamplingParams(max_tokens=4))


def test_reset_prefix_cache_forgets_cached_and_used_blocks():
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    done, live = _seq([1, 2, 3, 4, 5]), _seq([7, 8, 9, 10, 11])
    for s in (done, live):
        assert bm.allocate_slots(s, s.num_tokens)
        s.num_computed_tokens = s.num_tokens
        bm.cache_computed_blocks(s)
    bm.free(done)
    assert len(bm.evictable) == 2 and bm.free_ids  # cached blocks kept while free blocks remain
    bm.reset_prefix_cache()  # used to loop forever when free blocks remained
    bm.check_invariants()
    assert not bm.evictable and not bm.cached
    probe = _seq([1, 2, 3, 4, 5])
    assert bm.allocate_slots(probe, probe.num_tokens) and probe.num_computed_tokens == 0
    bm.free(live)  # its (formerly cached) blocks are plain free blocks now
    bm.free(probe)
    assert bm.num_free_blocks == 8 and not bm.evictable
    bm.check_invariants()


def test_block_hash_is_a_stable_chain_digest():
    a = chain_hash(0, (1, 2, 3))
    assert a == chain_hash(0, (1, 2, 3)) and a != chain_hash(0, (1, 2, 4)) and a != chain_hash(1, (1, 2, 3))
    assert a.bit_length() > 64  # 128-bit digest, not Python's 64-bit hash()
    # the same in another interpreter (whatever its PYTHONHASHSEED)
    code = "from pagoda.engine.block_manager import chain_hash; print(chain_hash(0, (1, 2, 3)))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123", "PATH": ""})
    assert int(other.stdout) == a
