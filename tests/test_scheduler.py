"""Scheduler and BlockManager: plain Python, no model. Budgets, order, preemption, leaks,
prefix cache and LRU eviction."""

import random
import subprocess
import sys

from pagoda.engine.block_manager import BlockManager
from pagoda.engine.scheduler import Scheduler
from pagoda.engine.sequence import Sequence, SequenceStatus
from pagoda.sampling_params import SamplingParams


def make(num_blocks=16, block_size=4, max_seqs=8, budget=32, max_len=64, prefix=True):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return bm, Scheduler(bm, max_seqs, budget, max_len)


def seq(n_prompt, max_tokens=8, base=0):
    return Sequence("r", 0, list(range(base, base + n_prompt)), SamplingParams(max_tokens=max_tokens))


def run_step(sched, next_token=7):
    out = sched.schedule()
    sampled = {it.seq.seq_id: next_token for it in out.scheduled if it.sample}
    sched.update(out, sampled, eos_token_ids=set())
    return out


def test_scheduler_and_block_manager_import_no_torch():
    code = "import sys, pagoda.engine.scheduler, pagoda.engine.block_manager; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_budget_is_respected_and_long_prompts_are_chunked():
    bm, sched = make(budget=10)
    a, b = seq(23), seq(5, base=100)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.num_batched_tokens == 10
    assert [(it.seq, it.num_new_tokens, it.sample) for it in out.scheduled] == [(a, 10, False)]
    sched.update(out, {}, set())
    out = sched.schedule()
    assert [(it.seq, it.num_new_tokens) for it in out.scheduled] == [(a, 10)]
    sched.update(out, {}, set())
    out = sched.schedule()  # a's last 3 tokens, then b's prompt in the remaining 7
    assert [(it.seq, it.num_new_tokens, it.sample) for it in out.scheduled] == [(a, 3, True), (b, 5, True)]


def test_decodes_come_before_prefills_and_fcfs_admission():
    bm, sched = make(budget=6)
    first, second, third = seq(4), seq(4, base=10), seq(4, base=20)
    for s in (first, second, third):
        sched.add(s)
    out = run_step(sched)  # first (4) and 2 tokens of second
    assert [it.seq for it in out.scheduled] == [first, second]
    out = sched.schedule()
    assert out.scheduled[0].seq is first and out.scheduled[0].num_new_tokens == 1
    assert out.num_decodes == 1
    assert [it.seq for it in out.scheduled[1:]] == [second, third]


def test_max_num_seqs_caps_the_running_set():
    bm, sched = make(max_seqs=2, budget=100)
    seqs = [seq(3, base=10 * i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.running) == 2 and len(sched.waiting) == 2


def test_preemption_by_recompute_when_blocks_run_out():
    bm, sched = make(num_blocks=4, block_size=4, budget=64)
    a, b = seq(8, max_tokens=20), seq(8, max_tokens=20, base=50)
    sched.add(a)
    sched.add(b)
    run_step(sched)  # both prefilled: 2 blocks each, cache full
    assert bm.num_free_blocks == 0
    out = run_step(sched)  # both now need a third block: the later one is preempted
    assert out.preempted == [b] and b.status is SequenceStatus.WAITING
    assert b.num_computed_tokens == 0 and b.block_table == [] and b.num_output_tokens == 1
    assert sched.waiting[0] is b and sched.stats.num_preemptions == 1
    bm.check_invariants()


def test_no_block_leaks_after_finish_and_abort_under_random_load():
    rng = random.Random(0)
    bm, sched = make(num_blocks=12, block_size=4, max_seqs=5, budget=16, max_len=40, prefix=True)
    live = []
    for _ in range(400):
        if rng.random() < 0.3:
            s = seq(rng.randint(1, 20), max_tokens=rng.randint(1, 12), base=rng.choice([0, 100]))
            sched.add(s)
            live.append(s)
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            sched.finish(victim, SequenceStatus.FINISHED_ABORTED)
        if sched.has_unfinished():
            run_step(sched, next_token=rng.randint(0, 50))
        bm.check_invariants()
        live = [s for s in live if not s.is_finished]
    while sched.has_unfinished():
        run_step(sched)
    assert bm.num_free_blocks == bm.num_blocks
    assert all(rc == 0 for rc in bm.ref_counts)


def test_prefix_cache_reuses_full_blocks_and_leaves_one_token_to_compute():
    bm, sched = make(num_blocks=16, block_size=4, budget=64)
    first = seq(10)
    sched.add(first)
    run_step(sched)
    sched.finish(first, SequenceStatus.FINISHED_STOPPED)
    again = seq(10)  # same 10 prompt tokens: blocks 0-1 (8 tokens) are cached
    sched.add(again)
    out = sched.schedule()
    assert again.num_computed_tokens == 8 and out.scheduled[0].num_new_tokens == 2
    exact = seq(8)  # a prompt of exactly two blocks keeps its last token to compute
    bm2, sched2 = make(num_blocks=16, block_size=4)
    sched2.add(exact)
    run_step(sched2)
    sched2.finish(exact, SequenceStatus.FINISHED_STOPPED)
    twin = seq(8)
    sched2.add(twin)
    out = sched2.schedule()
    assert twin.num_computed_tokens == 4 and out.scheduled[0].num_new_tokens == 4


def test_prefix_cache_evicts_least_recently_used_first():
    bm = BlockManager(6, 2, enable_prefix_caching=True)
    old, new = seq(4, base=0), seq(4, base=50)
    for s in (old, new):
        assert bm.allocate_slots(s, 4)
        s.num_computed_tokens = 4
        bm.cache_computed_blocks(s)
    old_blocks = list(old.block_table)
    bm.free(old)  # freed first: least recently used
    bm.free(new)
    assert bm.num_free_blocks == 6 and len(bm.cached) == 4
    fresh = seq(8, base=200)  # 4 blocks: the 2 never-used ones, then old's cached ones
    assert bm.allocate_slots(fresh, 8)
    assert set(old_blocks) <= set(fresh.block_table)
    bm.free(fresh)  # never computed, so not cached: plain free blocks
    probe_new, probe_old = seq(5, base=50), seq(5, base=0)
    assert bm.allocate_slots(probe_new, 5) and bm.allocate_slots(probe_old, 5)
    assert probe_new.num_computed_tokens == 4  # new's prefix survived
    assert probe_old.num_computed_tokens == 0  # old's was evicted
    bm.check_invariants()


def test_disabled_prefix_cache_never_hits():
    bm, sched = make(prefix=False)
    a = seq(10)
    sched.add(a)
    run_step(sched)
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)
    b = seq(10)
    sched.add(b)
    sched.schedule()
    assert b.num_computed_tokens == 0 and bm.prefix_hits == 0


def test_stops_on_eos_stop_ids_and_max_tokens():
    bm, sched = make()
    s1 = Sequence("a", 0, [1, 2], SamplingParams(max_tokens=5, stop_token_ids=[9]))
    s2 = Sequence("b", 0, [1, 2], SamplingParams(max_tokens=2, ignore_eos=True))
    s3 = Sequence("c", 0, [1, 2], SamplingParams(max_tokens=5, min_tokens=2))
    for s in (s1, s2, s3):
        sched.add(s)
    out = sched.schedule()
    sched.update(out, {s1.seq_id: 9, s2.seq_id: 0, s3.seq_id: 0}, eos_token_ids={0})
    assert s1.status is SequenceStatus.FINISHED_STOPPED and s1.stop_reason == 9
    assert not s2.is_finished and not s3.is_finished  # ignore_eos; min_tokens not reached
    out = sched.schedule()
    sched.update(out, {s2.seq_id: 0, s3.seq_id: 0}, eos_token_ids={0})
    assert s2.status is SequenceStatus.FINISHED_LENGTH and s3.status is SequenceStatus.FINISHED_STOPPED
    assert bm.num_free_blocks == bm.num_blocks


def test_prefill_token_count_includes_a_last_single_token_chunk():
    bm, sched = make(budget=5)
    s = seq(6, base=300)
    sched.add(s)
    run_step(sched)  # 5 prompt tokens
    out = run_step(sched)  # the prompt's last token, alone: scheduled like a decode
    assert out.num_decodes == 1 and sched.stats.num_prefill_tokens == 6
    run_step(sched)  # a real decode adds nothing
    assert sched.stats.num_prefill_tokens == 6
