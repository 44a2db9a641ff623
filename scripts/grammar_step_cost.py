"""What the grammars add to the engine thread's step, with xgrammar's matchers in the engine's process and in a
grammar process (the engine key ``structured_outputs_process``): per step, 64 matchers of ``pagoda bench serve``'s
JSON schema accept one token each (inside a JSON string, as a random model's outputs mostly are), their next
masks are filled ahead (``MaskAhead.start``) while the engine thread runs BUSY_MS of Python (the rest of its host
work), and the sampler takes the rows. Prints the step's time beyond BUSY_MS per mode (medians), the modes
interleaved ROUNDS times. SmolLM2's tokenizer from .whl/smollm2-tokenizer, Qwen3's 151,936-id vocabulary.
No GPU needed: it measures host work and the GIL; timings compare within one run only.

    OMP_NUM_THREADS=1 python scripts/grammar_step_cost.py [BUSY_MS]      (default 3)
"""

import statistics
import sys
import time

from mask_ahead_bench import Running, busy  # (this folder is on the path when run as a script)
from pagoda.bench.serve_client import BENCH_SCHEMA
from pagoda.structured_outputs.manager import StructuredOutputManager
from pagoda.structured_outputs.mask_ahead import MaskAhead
from pagoda.structured_outputs.params import StructuredOutputsParams
from transformers import AutoTokenizer

ROWS, MODEL_VOCAB, STEPS, ROUNDS = 64, 151_936, 300, 2


def measure(tok, process: bool, busy_ms: float) -> float:
    manager = StructuredOutputManager("xgrammar", tok, MODEL_VOCAB, [tok.eos_token_id], process=process)
    grammar = manager.compile(StructuredOutputsParams(json=BENCH_SCHEMA))
    matchers = [grammar.matcher() for _ in range(ROWS)]
    for m in matchers:
        for t in tok.encode('{"name": "', add_special_tokens=False):
            assert m.accept(t)
    text = tok.encode(" the quick brown fox jumps over a lazy dog" * (STEPS // 8 + 2), add_special_tokens=False)
    ahead, width = MaskAhead(), MODEL_VOCAB // 32
    ahead.width = width
    seqs = [Running(m) for m in matchers]
    steps = []
    for i in range(STEPS):
        start = time.perf_counter()
        for m in matchers:
            m.accept(text[i])
        ahead.start(seqs)
        busy(busy_ms)
        ready = ahead.take(matchers, width)
        steps.append(time.perf_counter() - start - busy_ms / 1e3)
        assert ready is not None and -1 not in ready.where and not any(ready.none_left)
    ahead.close()
    manager.shutdown()
    return 1e3 * statistics.median(steps[STEPS // 10:])


def main() -> None:
    tok = AutoTokenizer.from_pretrained(".whl/smollm2-tokenizer")
    busy_ms = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
    for round_ in range(ROUNDS):
        for process in (False, True):
            cost = measure(tok, process, busy_ms)
            where = "grammar process" if process else "engine process"
            print(f"round {round_ + 1}, matchers in the {where}: {cost:.3f} ms a step beyond {busy_ms:g} ms of "
                  f"host work ({ROWS} rows, median of {STEPS - STEPS // 10} steps)")


if __name__ == "__main__":
    main()
