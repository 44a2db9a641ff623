"""Where an engine step's host time goes: wall time per step spent in the engine's main functions (each
call timed with perf_counter, nested ones counted in their callers too), over `pagoda bench throughput`
with the structured-output benchmark's requests (256 prompts x 64 in x 256 out, 64 at once), its warm-up run
(the same grammar) left out. The timers themselves slow the engine (the rate printed is below the untimed
one): compare parts, not rates.

    python scripts/step_breakdown.py MODEL_DIR [json|regex|choice|none] [dummy]

(`dummy`: --load-format dummy, as the GPU scripts' shapes have no weights; scripts/structured_model.py
writes the qwen3-0.6b shape with SmolLM2's tokenizer.)
"""

import functools
import sys
import time
from collections import defaultdict

from pagoda import kernels
from pagoda.bench import throughput
from pagoda.cli.main import main as pagoda_main
from pagoda.engine import pipeline as pipeline_module
from pagoda.engine import sampler as sampler_module
from pagoda.engine.model_runner import ModelRunner
from pagoda.engine.pipeline import StepPipeline
from pagoda.engine.request_controls import RequestControls
from pagoda.engine.sampler import Sampler
from pagoda.engine.scheduler import Scheduler
from pagoda.engine.step_completion import StepCompletion
from pagoda.structured_outputs import masking
from pagoda.structured_outputs.mask_ahead import MaskAhead

TIMED = {Sampler: ["select_on_device", "_special", "_processed", "_noise"],
         StepPipeline: ["step", "_how", "_feed_index", "_sampled", "_schedule_ahead"],
         ModelRunner: ["launch", "choose_on_device", "collect", "_send_tokens", "stage_launch"],
         StepCompletion: ["complete", "_detokenize", "mark_scheduled", "_outputs"],
         MaskAhead: ["start", "take", "wait"],
         Scheduler: ["schedule", "advance", "commit"],
         RequestControls: ["advance"]}
seconds: dict[str, float] = defaultdict(float)
calls: dict[str, int] = defaultdict(int)


def timed(fn, label: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[label] += time.perf_counter() - t
            calls[label] += 1
    return wrapper


def main() -> None:
    for cls, names in TIMED.items():
        for name in names:
            raw = cls.__dict__[name]
            fn = timed(raw.__func__ if isinstance(raw, staticmethod) else raw, f"{cls.__name__}.{name}")
            setattr(cls, name, staticmethod(fn) if isinstance(raw, staticmethod) else fn)
    masking.apply_grammar_masks = timed(masking.apply_grammar_masks, "apply_grammar_masks")
    # inside it and around it (module functions, timed where they are called from)
    for module, names in ((masking, ["upload", "_on", "_rows_on"]), (sampler_module, ["_select"]),
                          (pipeline_module, ["sampling_rows"])):
        for name in names:
            setattr(module, name, timed(getattr(module, name), f"{module.__name__.rsplit('.', 1)[1]}.{name}"))
    run = throughput._one_run  # the bench's warm-up (the same grammar: its one-time costs) is not counted

    def counted_run(*args, **kwargs):
        seconds.clear()
        calls.clear()
        return run(*args, **kwargs)

    throughput._one_run = counted_run
    get_op = kernels.get_op
    kernels.get_op = lambda name: timed(get_op(name), f"kernel op {name}") if name == "apply_token_bitmask" \
        else get_op(name)
    model = sys.argv[1]
    kind = sys.argv[2] if len(sys.argv) > 2 else "json"
    pagoda_main(["bench", "throughput", "--model", model, "--num-prompts", "256", "--input-len", "64",
                 "--output-len", "256", "--ignore-eos", "--repeats", "1", "--max-num-seqs", "64"]
                + (["--load-format", "dummy"] if "dummy" in sys.argv[3:] else [])
                + (["--structured-outputs", kind] if kind != "none" else []))
    steps = calls["StepPipeline.step"] or calls["StepCompletion.complete"] or 1
    print(f"--- {kind}: host time per engine step ({steps} steps), ms (calls per step)")
    for label in sorted(seconds, key=lambda k: -seconds[k]):
        print(f"{label:36s} {1e3 * seconds[label] / steps:8.3f}  ({calls[label] / steps:.2f})")


if __name__ == "__main__":
    main()
