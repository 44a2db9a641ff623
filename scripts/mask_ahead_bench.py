"""How much of a grammar fill started ahead (pagoda.structured_outputs.mask_ahead) is still to wait for
when the sampler takes it, against filling the same rows in the step: 64 xgrammar matchers inside a JSON
string of `pagoda bench serve`'s schema (SmolLM2's tokenizer from .whl/smollm2-tokenizer, the model's
vocabulary padded to Qwen3's 151,936 ids), the engine thread busy in Python for BUSY_MS between the start
and the take. No GPU needed: it measures the hand-over between the engine thread and the fill's worker.

    python scripts/mask_ahead_bench.py [BUSY_MS ...]      (default 0 1 3)
"""

import json
import statistics
import sys
import time

import torch
import xgrammar as xgr
from pagoda.bench.serve_client import BENCH_SCHEMA
from pagoda.structured_outputs.backends import _XGrammarMatcher, fill_bitmasks
from pagoda.structured_outputs.mask_ahead import MaskAhead
from transformers import AutoTokenizer

ROWS, MODEL_VOCAB, REPS = 64, 151_936, 200


class Running:  # what MaskAhead.start reads of a sequence
    def __init__(self, matcher):
        self.grammar, self.is_finished, self.request_id = matcher, False, "r"


def busy(ms: float) -> None:
    end, x = time.perf_counter() + ms / 1e3, 0
    while time.perf_counter() < end:
        x += 1


def main() -> None:
    tok = AutoTokenizer.from_pretrained(".whl/smollm2-tokenizer")
    info = xgr.TokenizerInfo.from_huggingface(tok)
    grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(BENCH_SCHEMA))
    words = (info.vocab_size + 31) // 32
    matchers = []
    for _ in range(ROWS):
        m = _XGrammarMatcher(xgr.GrammarMatcher(grammar), set(), words)
        for t in tok.encode('{"name": "Ann', add_special_tokens=False):
            assert m.accept(t)
        matchers.append(m)
    rows = [(m, j) for j, m in enumerate(matchers)]
    ahead = MaskAhead()  # (plain host buffers: the engine's are page-locked on a GPU)
    ahead.width = MODEL_VOCAB // 32
    t = time.perf_counter()
    for _ in range(REPS // 4):
        fill_bitmasks(rows, torch.empty((ROWS, words), dtype=torch.int32))
    inline = (time.perf_counter() - t) / (REPS // 4)
    print(f"{ROWS} rows filled in the step: {1e3 * inline:.3f} ms")
    for busy_ms in [float(a) for a in sys.argv[1:]] or [0.0, 1.0, 3.0]:
        waits, takes = [], []
        for _ in range(REPS):
            ahead.start([Running(m) for m in matchers])
            busy(busy_ms)
            t = time.perf_counter()
            ahead.wait()
            waits.append(time.perf_counter() - t)
            assert -1 not in ahead.take(matchers, ahead.width).where
            takes.append(time.perf_counter() - t)
        print(f"filled ahead, {busy_ms:g} ms of host work between: wait {1e3 * statistics.median(waits):.3f} ms, "
              f"wait + take {1e3 * statistics.median(takes):.3f} ms (medians of {REPS})")
    ahead.close()


if __name__ == "__main__":
    main()
