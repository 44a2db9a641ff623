"""Where one decode step's time goes: host time per engine phase, GPU time per kernel
category, and the gap between them (launches, synchronisation, idle GPU).

The engine is driven by hand: the prompts are admitted and stepped until every sequence is
decoding, then a few decode steps are timed as they normally run (graphs when captured), a
few more under ``torch.profiler``, and one more eagerly under the profiler (the kernels of
a graph replay are not always visible to the profiler). The requests are aborted afterwards.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import torch

# kernel-name fragments -> category (first match wins)
CATEGORIES = [
    ("attention", ("_decode_kernel", "_merge_kernel", "_prefill_kernel", "_mla_", "flash", "attn")),
    ("kv store", ("_store_kv", "store_mla", "index_copy")),
    ("moe", ("_gate_up_kernel", "_down_kernel", "_combine_kernel", "moe", "scatter_add", "radix", "sort",
             "searchsorted", "cumsum")),
    ("norm", ("rms_norm",)),
    ("rotary", ("rotary",)),
    ("activation", ("_gated_kernel", "silu", "gelu")),
    ("gemm", ("gemm", "cutlass", "nvjet", "sm90", "xmma", "cublas", "matmul", "splitk", "kernel2", "addmm", "mm")),
    ("sampling", ("argmax", "argmin", "max_", "softmax")),
    ("copy", ("memcpy", "memset", "copy", "fill")),
]


def categorize(name: str) -> str:
    low = name.lower()
    for category, fragments in CATEGORIES:
        if any(f in low for f in fragments):
            return category
    return "other"


def _decoding_only(engine) -> bool:
    sched = engine.scheduler
    return not sched.waiting and bool(sched.running) and all(
        s.num_tokens - s.num_computed_tokens == 1 for s in sched.running)


def _kernel_table(prof, steps: int, on_gpu: bool) -> dict:
    per_category: dict[str, float] = defaultdict(float)
    kernels: dict[str, float] = {}
    calls: dict[str, float] = {}
    for evt in prof.key_averages():
        if on_gpu:
            seconds = getattr(evt, "self_device_time_total", getattr(evt, "self_cuda_time_total", 0)) / 1e6
            if seconds <= 0 or getattr(evt, "device_type", None) != torch.autograd.DeviceType.CUDA:
                continue
        else:
            seconds = evt.self_cpu_time_total / 1e6
            if seconds <= 0 or not evt.key.startswith("aten::"):
                continue
        per_step = seconds / steps
        kernels[evt.key] = kernels.get(evt.key, 0.0) + per_step
        calls[evt.key] = calls.get(evt.key, 0.0) + evt.count / steps
        per_category[categorize(evt.key)] += per_step
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return {"per_category_seconds": dict(sorted(per_category.items(), key=lambda kv: -kv[1])),
            "busy_seconds": sum(per_category.values()), "top_kernels_seconds": dict(top),
            "launches_per_step": sum(calls.values()), "top_kernels_calls": {k: calls[k] for k, _ in top}}


def _timed_steps(engine, steps: int, on_gpu: bool, pipelined: bool = True) -> list[dict]:
    """Steps as ``LLM.generate`` runs them (``pipelined``: the step pipeline on, so a step's
    wall time is the device time of one step plus whatever host time is not hidden)."""
    out = []
    for _ in range(steps):
        if not _decoding_only(engine):
            break
        before = dict(vars(engine.times))
        t0 = time.perf_counter()
        engine.step(finished_only=pipelined)
        wall = time.perf_counter() - t0
        after = vars(engine.times)
        out.append({"wall": wall, **{k: after[k] - before[k] for k in ("schedule", "decode", "postprocess")}})
    return out


def profile_timeline(llm, prompts: list[list[int]], params, lora_requests=None) -> dict | None:
    """One whole ``generate`` of the workload with every pipelined launch marked
    (``pagoda.engine.timeline``): the device's busy time per step kind and its idle time
    between steps. None when the engine does not pipeline steps."""
    from pagoda.engine.timeline import StepTimeline

    engine = llm.engine
    if engine.pipeline is None:
        return None
    timeline = StepTimeline(engine.platform)
    engine.pipeline.timeline = timeline
    try:
        engine.platform.synchronize()
        timeline.start()
        llm.generate(prompts, params, lora_request=lora_requests)
        timeline.stop()
    finally:
        engine.pipeline.timeline = None
    return timeline.summary()


def profile_decode(llm, prompts: list[list[int]], params, timed_steps: int = 8, profiled_steps: int = 3,
                   lora_requests=None) -> dict:
    """``lora_requests``: one per prompt (or None), as the measured workload gives them (``--lora N``)."""
    engine = llm.engine
    on_gpu = engine.platform.device_type == "cuda"
    loras = lora_requests or [None] * len(prompts)
    ids = [engine.add_request(f"profile-{i}", p, params, lora_request=loras[i]) for i, p in enumerate(prompts)]
    try:
        prefill = _profile_prefill_step(engine, on_gpu)
        host = _host_profile_step(engine)
        while engine.has_unfinished_requests() and not _decoding_only(engine):
            engine.step()
        for _ in range(3):  # let the first decode steps settle
            if _decoding_only(engine):
                engine.step()
        batch = len(engine.scheduler.running)
        context = sum(s.num_tokens for s in engine.scheduler.running) / max(1, batch)
        timed = _timed_steps(engine, timed_steps, on_gpu)
        activities = _activities(on_gpu)
        with torch.profiler.profile(activities=activities) as prof:
            done = len(_timed_steps(engine, profiled_steps, on_gpu))
        graph_table = _kernel_table(prof, max(1, done), on_gpu)
        eager_table = None
        runner = engine.runner
        engine.step()  # collect a step launched ahead, so the next one runs alone
        if runner.graphs is not None and _decoding_only(engine):
            graphs, runner.graphs = runner.graphs, None
            try:
                with torch.profiler.profile(activities=activities) as prof:
                    eager_steps = _timed_steps(engine, 1, on_gpu, pipelined=False)
                eager_table = _kernel_table(prof, 1, on_gpu)
                eager_table["wall_seconds"] = eager_steps[0]["wall"] if eager_steps else None
            finally:
                runner.graphs = graphs
    finally:
        engine.abort_request(ids)
    n = max(1, len(timed))
    mean = {k: sum(t[k] for t in timed) / n for k in ("wall", "schedule", "decode", "postprocess")} if timed else {}
    kernels = graph_table if graph_table["busy_seconds"] > 0 else (eager_table or graph_table)
    gap = mean.get("decode", 0.0) - kernels["busy_seconds"] if mean else None
    return {
        "batch": batch, "mean_context": context, "graphs": runner.graphs is not None,
        "step_seconds": mean, "kernels_per_step": kernels,
        "kernels_source": "graph replay" if kernels is graph_table else "eager step",
        "eager_step": eager_table,
        "model_gap_seconds": gap,  # host time of the model call not covered by kernels
        "prefill_step": prefill,
        "host_step": host,
    }


def _activities(on_gpu: bool) -> list:
    cpu, cuda = torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA
    return [cpu, cuda] if on_gpu else [cpu]


def _profile_prefill_step(engine, on_gpu: bool) -> dict:
    """The first step of the admitted prompts (a full prefill chunk), eager, under the profiler."""
    sched = engine.scheduler
    before = sum(s.num_computed_tokens for s in sched.running)
    with torch.profiler.profile(activities=_activities(on_gpu)) as prof:
        t0 = time.perf_counter()
        engine.step()
        engine.platform.synchronize()
        wall = time.perf_counter() - t0
    tokens = sum(s.num_computed_tokens for s in sched.running) - before
    return {"tokens": tokens, "wall_seconds": wall, "kernels": _kernel_table(prof, 1, on_gpu),
            "runtime_calls": _runtime_calls(prof) if on_gpu else {}}


def _host_profile_step(engine, top: int = 10) -> dict:
    """The step after the profiled prefill step (with long prompts, another prefill step) under
    cProfile: the Python functions that take the host's time, by own time. cProfile slows
    Python-heavy code, so read it for proportions."""
    import cProfile
    import pstats

    sched = engine.scheduler
    before = sum(s.num_computed_tokens for s in sched.running)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    engine.step()
    prof.disable()
    wall = time.perf_counter() - t0
    tokens = sum(s.num_computed_tokens for s in sched.running) - before
    entries = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:top]
    own = [[f"{name} ({Path(file).name}:{line})", calls, seconds]
           for (file, line, name), (_, calls, seconds, _, _) in entries]
    return {"tokens": tokens, "wall_seconds": wall, "top_own_seconds": own}


# CUDA runtime/driver calls that make the host wait for the device (or may: allocation)
WAITING_CALLS = ("Synchronize", "cudaMemcpy", "cudaMalloc", "cudaFree", "cudaHostAlloc", "cuMemAlloc", "cuMemFree")


def _runtime_calls(prof) -> dict:
    """Host time in CUDA runtime calls by name: {name: [count, seconds]}, the waiting ones
    (synchronisation, blocking copies, allocation) and the kernel launches. A prefill step
    that leaves the GPU idle shows here where the host waited."""
    calls = {}
    for evt in prof.key_averages():
        key = evt.key
        if not key.startswith("cu") or not (any(w in key for w in WAITING_CALLS) or "Launch" in key):
            continue
        calls[key] = [evt.count, evt.cpu_time_total / 1e6]
    return dict(sorted(calls.items(), key=lambda kv: -kv[1][1]))


def format_profile(profile: dict) -> list[str]:
    step = profile["step_seconds"]
    lines = [f"decode step profile: batch {profile['batch']}, mean context {profile['mean_context']:.0f} tokens, "
             f"{'CUDA graphs' if profile['graphs'] else 'eager'}"]
    if step:
        lines.append(f"  step wall {step['wall'] * 1e3:.3f} ms = schedule {step['schedule'] * 1e3:.3f} + model+sample "
                     f"{step['decode'] * 1e3:.3f} + postprocess {step['postprocess'] * 1e3:.3f} ms")
    kernels = profile["kernels_per_step"]
    lines.append(f"  kernels ({profile['kernels_source']}): busy {kernels['busy_seconds'] * 1e3:.3f} ms per step, "
                 f"{kernels.get('launches_per_step', 0):.0f} kernels")
    for category, seconds in kernels["per_category_seconds"].items():
        lines.append(f"    {category:<11} {seconds * 1e3:8.3f} ms")
    if profile.get("model_gap_seconds") is not None:
        lines.append(f"  launch/sync gap in the model call: {profile['model_gap_seconds'] * 1e3:.3f} ms")
    prefill = profile.get("prefill_step")
    if prefill:
        kernels = prefill["kernels"]
        lines.append(f"prefill step profile: {prefill['tokens']} tokens, wall {prefill['wall_seconds'] * 1e3:.3f} ms, "
                     f"kernels busy {kernels['busy_seconds'] * 1e3:.3f} ms")
        for category, seconds in kernels["per_category_seconds"].items():
            lines.append(f"    {category:<11} {seconds * 1e3:8.3f} ms")
        calls = prefill.get("runtime_calls") or {}
        if calls:
            lines.append("  host in CUDA calls: " + ", ".join(f"{name} x{count} {seconds * 1e3:.2f} ms"
                                                           for name, (count, seconds) in list(calls.items())[:6]))
    timeline = profile.get("timeline")
    if timeline:
        busy = ", ".join(f"{kind} {v['ms']:.1f} ms ({v['steps']} steps)" for kind, v in timeline["busy_ms"].items())
        idle = ", ".join(f"{where} {ms:.1f}" for where, ms in timeline["idle_ms"].items())
        lines.append(f"device timeline of one generate: wall {timeline['wall_ms']:.1f} ms; busy: {busy}")
        lines.append(f"  idle (ms): {idle}")
        lines.append("  largest gaps (ms, step, between): " + ", ".join(
            f"{ms} #{i} {where}" for ms, i, where in timeline["largest_gaps_ms"]))
    host = profile.get("host_step")
    if host:
        lines.append(f"host (cProfile) of the next step, {host['tokens']} tokens: wall "
                     f"{host['wall_seconds'] * 1e3:.1f} ms; own time of the top functions:")
        lines += [f"    {seconds * 1e3:8.2f} ms  x{calls:<6} {name}"
                  for name, calls, seconds in host["top_own_seconds"]]
    return lines
