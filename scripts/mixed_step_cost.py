"""What a request joining a running batch costs the batch: ``step()`` calls of an engine decoding 64
sequences, timed with a new prompt (PROMPT_LEN tokens, 64 by default; max_tokens 1: it leaves after its
prefill) every 4th call and
without; (with - without) / arrivals = the extra wall time of a step that holds a prefill chunk. Run once per
``cudagraph_mode`` (FULL: such steps replayed from graphs, pagoda.engine.mixed_graphs; FULL_DECODE_ONLY: eager).

    python scripts/mixed_step_cost.py MODEL FULL|FULL_DECODE_ONLY
"""

import os
import statistics
import sys
import time

from pagoda import SamplingParams
from pagoda.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine

model, mode = sys.argv[1], sys.argv[2]
prompt_len = int(os.environ.get("PROMPT_LEN", "64"))  # the joining request's prompt
engine = LLMEngine(EngineConfig(model=model, load_format="dummy", max_num_seqs=128,
                                max_model_len=max(4096, prompt_len + 64), cudagraph_mode=mode, seed=0))
long = SamplingParams(temperature=0, max_tokens=3500, ignore_eos=True)
short = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
for i in range(64):
    engine.add_request(f"run-{i}", list(range(100 + i, 164 + i)), long)
for _ in range(40):  # every prompt prefilled, graphs warm
    engine.step()
arrivals = 0


def timed(calls: int, every: int | None) -> float:
    global arrivals
    start = time.perf_counter()
    for c in range(calls):
        if every and c % every == 0:
            arrivals += 1
            engine.add_request(f"new-{arrivals}", list(range(1000 + arrivals, 1000 + prompt_len + arrivals)), short)
        engine.step()
    return time.perf_counter() - start


rows = []
for _ in range(5):  # interleaved
    base = timed(200, None)
    mixed = timed(200, 4)
    rows.append(((mixed - base) / 50 * 1e3, base / 200 * 1e3))
extra = statistics.median(r[0] for r in rows)
step = statistics.median(r[1] for r in rows)
stats = engine.get_stats()
print(f"cudagraph_mode {mode}: decode step {step:.3f} ms; a step with a {prompt_len}-token prompt joining costs "
      f"{extra:.3f} ms "
      f"more (median of 5 x 50 arrivals; runs {', '.join(f'{r[0]:.2f}' for r in rows)}); mixed steps replayed "
      f"{stats.get('mixed_steps_replayed', 0)} of {stats['num_steps']}; buckets "
      f"{engine.runner.mixed_graphs.buckets if engine.runner.mixed_graphs else None}")
