"""KV cache groups: window layers keep only their windows' blocks. The layout (which layers share
which cache tensor), the block manager's per-group tables, releases and prefix cache, and the
blocks a Gemma-style model (window and global layers mixed) holds per sequence in the engine."""

import pytest
from pagoda import LLM, SamplingParams
from pagoda.engine.block_manager import NULL_BLOCK, BlockManager
from pagoda.engine.kv_groups import blocks_for_one_sequence, plan_kv_layout
from pagoda.engine.sequence import Sequence
from pagoda.sampling_params import SamplingParams as Params
from pagoda.testing import hf_greedy_tokens, make_tiny_checkpoint, random_prompts

PAGE = ("mha", (2, 1, 8, 4, 64))


def test_layout_of_gemma3_1b_and_gpt_oss_20b():
    # Gemma 3 1B: 26 layers, every 6th global, window 512
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    layout = plan_kv_layout(windows, [PAGE] * 26)
    assert layout.windows == (None,) + (512,) * 6 and layout.num_slots == 4
    assert [layout.layer_group[i] for i in (5, 11, 17, 23)] == [0] * 4  # the global layers, slots 0-3
    assert sorted(layout.layer_slot[i] for i in (5, 11, 17, 23)) == [0, 1, 2, 3]
    assert layout.layer_group[0] == 1 and layout.layer_group[25] == 6  # the last window group: 2 layers
    # gpt-oss-20b: 24 layers alternating window 128 and global
    layout = plan_kv_layout([128 if i % 2 == 0 else None for i in range(24)], [PAGE] * 24)
    assert layout.windows == (None, 128) and layout.num_slots == 12
    # one window everywhere (Mistral) or none: one group, one tensor per layer, as before
    for same in ([None] * 4, [4096] * 4):
        layout = plan_kv_layout(same, [PAGE] * 4)
        assert layout.windows == (same[0],) and layout.layer_slot == (0, 1, 2, 3) and layout.num_slots == 4
    # pages of different shapes cannot share a tensor: windows are not freed, and the runner says why
    layout = plan_kv_layout([None, 64], [PAGE, ("mha", (2, 1, 8, 2, 64))])
    assert layout.windows == (None,) and "differ" in layout.note


def seq(n, base=0):
    return Sequence("r", 0, [base + i for i in range(n)], Params(max_tokens=64))


def grow(bm, s, upto, chunk=1):
    """Allocate and 'compute' ``s`` chunk by chunk until it holds ``upto`` tokens."""
    while s.num_computed_tokens < upto:
        step = min(chunk, upto - s.num_computed_tokens)
        if s.num_computed_tokens + step > s.num_tokens:
            s.token_ids += list(range(1000 + s.num_tokens, 1000 + s.num_computed_tokens + step))
        assert bm.allocate_slots(s, step)
        s.num_computed_tokens += step
        bm.cache_computed_blocks(s)


def test_window_groups_release_blocks_that_left_the_window():
    bm = BlockManager(64, 4, windows=(None, 8))
    s = seq(10)
    grow(bm, s, 60, chunk=3)
    table, window_table = bm.tables(s)
    assert len(table) == len(window_table) == 15
    assert NULL_BLOCK not in table  # the global group keeps everything
    live = [b for b in window_table if b != NULL_BLOCK]
    # the next query (position 60) sees keys 53..60: blocks 13 and 14 (and block 12, released on
    # the sequence's next allocation: releases happen when it takes a block)
    assert window_table[:12] == [NULL_BLOCK] * 12 and len(live) == 3
    assert bm.held_blocks(s) == 18 and bm.num_used_blocks == 18
    bm.free(s)
    assert bm.num_used_blocks == 0 and not s.group_block_tables
    bm.check_invariants()


def test_prefix_cache_with_a_window_group():
    """A cached prefix is usable as far as the global group holds it and the window group holds the
    window before its end; window blocks before that come back as NULL entries."""
    bm = BlockManager(64, 4, enable_prefix_caching=True, windows=(None, 6))
    first = seq(30)
    grow(bm, first, 30, chunk=4)
    bm.free(first)  # everything cached, evictable
    again = seq(30)
    assert bm.allocate_slots(again, 30)
    assert again.num_computed_tokens == 28  # 7 full blocks (the last token is always computed)
    table, window_table = bm.tables(again)
    assert NULL_BLOCK not in table[:7]
    assert window_table[:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in window_table[5:]  # keys 23..27 visible
    bm.free(again)
    # evict the window group's block 6 (positions 24..27): the hit falls back to where the window is whole
    cached_window_block = bm.cached[bm.key_of[window_table[6]]]
    bm.evictable.pop(cached_window_block)
    del bm.cached[bm.key_of.pop(cached_window_block)]
    bm.block_hash[cached_window_block] = None
    bm.free_ids.append(cached_window_block)
    third = seq(30)
    assert bm.allocate_slots(third, 30)
    assert third.num_computed_tokens == 24  # 6 blocks: the window before position 24 is cached
    bm.free(third)
    bm.check_invariants()


def test_blocks_for_one_sequence():
    assert blocks_for_one_sequence((None,), 100, 16, 8192) == 7
    # a global group holds all 7; each window group the window before a 64-token chunk plus the chunk
    assert blocks_for_one_sequence((None, 32, 32), 4096, 16, 64) == 256 + 2 * 7


def test_gemma_style_model_does_not_pay_full_context_for_its_window_layers(tmp_path):
    """Blocks per sequence, measured in the engine while a long sequence decodes: the window
    layers' groups stay at the window's size while the global group grows with the context,
    and the output is still transformers'."""
    layers = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    path = make_tiny_checkpoint("gemma3_text", tmp_path, seed=3, vocab_size=320, hidden_size=64,
                                intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=32, max_position_embeddings=256, sliding_window=16,
                                query_pre_attn_scalar=32, layer_types=layers)
    llm = LLM(model=str(path), device="cpu", dtype="float32", block_size=8, num_kv_blocks=40, max_model_len=256,
              max_num_batched_tokens=32)
    engine = llm.engine
    assert engine.runner.kv_layout.windows == (None, 16, 16, 16) and engine.runner.kv_layout.num_slots == 1
    prompt = random_prompts(1, 320, 40, 40, seed=4)[0]
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=160, ignore_eos=True))
    held, out = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        for s in engine.scheduler.running:
            held.append((s.num_computed_tokens, engine.block_manager.held_blocks(s)))
    context, blocks = held[-1]
    assert context == 198  # the step before the last (the sequence then finishes)
    full_context = 4 * -(-context // 8)  # every layer keeping every block (one layer per block id here)
    assert blocks <= 25 + 3 * 4  # 25 global blocks; at most 4 per window group (16 keys + the current block)
    assert blocks < 0.5 * full_context
    assert max(b for _, b in held) <= 25 + 3 * 6  # also while prefilling 32-token chunks
    bytes_held = blocks * engine.runner.bytes_per_block()
    assert bytes_held < 0.5 * engine.runner.kv_bytes_per_token() * context
    assert out.outputs[0].token_ids == hf_greedy_tokens(path, [prompt], 160)[0]
    assert engine.get_stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("windows", [(None,), (4096,)])
def test_one_group_allocates_as_before(windows):
    bm = BlockManager(8, 4, windows=windows)
    s = seq(12)
    assert bm.allocate_slots(s, 12) and len(s.block_table) == 3 and not s.group_block_tables
    assert bm.new_blocks_needed(s, 20) == 2
