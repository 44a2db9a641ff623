"""The first thing to run on a machine with a Cambricon MLU (MLU370, MLU590, ...).

    python -m pagoda_mlu.check                 # or: pagoda-mlu-check
    python -m pagoda_mlu.check --sweep-tiles   # also time mlu_chunked per tile size
    python -m pagoda_mlu.check --device cpu    # the same checks on the CPU (what CI runs)

Each check prints PASS, FAIL, SKIP or INFO with what it saw; the exit status is 1 if any check
failed. In order: torch_mlu and the devices it reports; mlu_chunked attention on the device
against pagoda's CPU reference; torch_mlu_ops kernels and the mlu_fused backend (when
torch_mlu_ops imports) against the same references; the KV pool sized from the device's
memory; a tiny random Llama generating greedily on the device against transformers on the CPU.
Nothing in pagoda-mlu has been run on an MLU before this script (docs/mlu.md): please send
its output with any report.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import torch


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL, SKIP, INFO
    detail: str
    seconds: float


class Skip(Exception):
    pass


def _max_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float().cpu() - expected.float().cpu()).abs().max())


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}[dtype]


class Checks:
    def __init__(self, device: str, dtype: torch.dtype):
        from pagoda import kernels

        self.device_name, self.dtype = device, dtype
        kernels.activate(device)
        self.results: list[Result] = []

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_name)  # "mlu" parses only once torch_mlu is imported

    def run(self, name: str, fn, *args) -> Result:
        t0 = time.perf_counter()
        try:
            status, detail = fn(*args)
        except Skip as skip:
            status, detail = "SKIP", str(skip)
        except Exception as exc:  # report and go on: one broken kernel must not hide the others
            last = traceback.extract_tb(exc.__traceback__)[-1]
            status, detail = "FAIL", f"{type(exc).__name__}: {exc} (at {last.filename}:{last.lineno})"
        result = Result(name, status, detail, time.perf_counter() - t0)
        self.results.append(result)
        print(f"{result.status:<5} {name:<28} {result.detail}  [{result.seconds:.1f}s]", flush=True)
        return result

    # ------------------------------------------------------------------ the device
    def torch_mlu(self):
        if self.device_name == "cpu":
            raise Skip("--device cpu")
        from pagoda_mlu.platform import MluPlatform
        from pagoda_mlu.runtime import torch_mlu_ops_importable

        platform = MluPlatform()
        reason = platform.unavailable_reason()
        if reason is not None:
            return "FAIL", reason
        mlu = platform.mlu
        free, total = platform.memory_info()
        names = [getattr(mlu, "get_device_name", lambda i: "?")(i) for i in range(platform.device_count())]
        bf16 = getattr(mlu, "is_bf16_supported", lambda: "unknown")()
        return "PASS", (f"{platform.describe()}: {', '.join(names)}; free {free / 2**30:.1f} of "
                        f"{total / 2**30:.1f} GiB; bf16 {bf16}; graphs {platform.supports_graphs}; "
                        f"torch_mlu_ops importable {torch_mlu_ops_importable()}")

    # ------------------------------------------------------------------ attention
    def _attention(self, backend_cls, options: dict, block_size: int):
        from pagoda.attention.torch_paged import TorchPagedAttention
        from pagoda.forward_context import ForwardContext, set_forward_context
        from pagoda.interfaces import AttentionSpec
        from pagoda.kernels import reference

        from pagoda_mlu.synthetic import context_slots, metadata_on, mixed_batch

        worst = 0.0
        for window in (None, 37):
            spec = AttentionSpec("mha", num_heads=8, num_kv_heads=2, head_size=128, scale=128 ** -0.5,
                                 sliding_window=window)
            batch = mixed_batch([70, 1, 300], [(45, 30), (0, 90), (0, 1)], block_size, 256, seed=7)
            gen = torch.Generator().manual_seed(1)
            slots = context_slots(batch)
            ctx = [torch.randn(len(slots), 2, 128, generator=gen) for _ in range(2)]
            t = batch.meta.num_tokens
            q, k, v = (torch.randn(t, n * 128, generator=gen) for n in (8, 2, 2))
            layer = SimpleNamespace(spec=spec)
            ref = TorchPagedAttention()
            ref_cache = torch.zeros(ref.kv_cache_shape(spec, 256, block_size))
            reference.store_kv_cache(ctx[0], ctx[1], ref_cache, slots)
            with set_forward_context(ForwardContext(attn_metadata=batch.meta, backends={})):
                expected = ref.forward(layer, q, k, v, ref_cache, batch.meta)
            ours = backend_cls().configure(options)
            cache = torch.zeros(ours.kv_cache_shape(spec, 256, block_size), dtype=self.dtype, device=self.device)
            ours.store(ctx[0].to(self.device, self.dtype), ctx[1].to(self.device, self.dtype), cache,
                       slots.to(self.device))
            meta = metadata_on(batch.meta, self.device)
            with set_forward_context(ForwardContext(attn_metadata=meta, backends={})):
                got = ours.forward(layer, *(x.to(self.device, self.dtype) for x in (q, k, v)), cache, meta)
            worst = max(worst, _max_err(got, expected))
        status = "PASS" if worst <= _tolerance(self.dtype) else "FAIL"
        return status, f"max |error| {worst:.2e} vs the CPU float32 reference ({self.dtype}, block {block_size})"

    def chunked_attention(self, tile_size: int):
        from pagoda_mlu.chunked_attention import MluChunkedAttention

        return self._attention(MluChunkedAttention, {"tile_size": tile_size}, 16)

    def fused_attention(self):
        from pagoda_mlu.fused_attention import MluFusedAttention
        from pagoda_mlu.runtime import torch_mlu_ops_importable

        if self.device_name == "cpu" or not torch_mlu_ops_importable():
            raise Skip("needs torch_mlu_ops on an MLU")
        return self._attention(MluFusedAttention, {}, 16)

    # ------------------------------------------------------------------ torch_mlu_ops kernels
    def tmo_kernels(self):
        from pagoda.kernels import reference

        from pagoda_mlu import paged_cache, tmo_kernels
        from pagoda_mlu.runtime import torch_mlu_ops_importable

        if self.device_name == "cpu" or not torch_mlu_ops_importable():
            raise Skip("needs torch_mlu_ops on an MLU")
        gen = torch.Generator().manual_seed(2)
        dev, dt = self.device, self.dtype
        x, res, w = (torch.randn(33, 256, generator=gen) for _ in range(3))
        errs = {"rms_norm": _max_err(tmo_kernels.rms_norm(x.to(dev, dt), w.to(dev, dt), 1e-6),
                                     reference.rms_norm(x, w, 1e-6))}
        got = tmo_kernels.fused_add_rms_norm(x.to(dev, dt), res.to(dev, dt), w.to(dev, dt), 1e-6)
        exp = reference.fused_add_rms_norm(x, res, w, 1e-6)
        errs["fused_add_rms_norm"] = max(_max_err(got[0], exp[0]), _max_err(got[1], exp[1]))
        freqs = torch.arange(512).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64))[None]
        cache, pos = torch.cat((freqs.cos(), freqs.sin()), -1), torch.randint(0, 512, (33,), generator=gen)
        q, k = torch.randn(33, 8 * 128, generator=gen), torch.randn(33, 2 * 128, generator=gen)
        for neox in (True, False):
            got = tmo_kernels.rotary_embedding(pos.to(dev), q.to(dev, dt), k.to(dev, dt), 128, cache.to(dev), neox)
            exp = reference.rotary_embedding(pos, q, k, 128, cache, neox)
            errs[f"rotary (neox={neox})"] = max(_max_err(got[0], exp[0]), _max_err(got[1], exp[1]))
        kk, vv = torch.randn(33, 2, 128, generator=gen), torch.randn(33, 2, 128, generator=gen)
        slots = torch.randperm(64 * 16, generator=gen)[:33]
        slots[5] = -1
        mine, want = torch.zeros(2, 64, 2, 16, 128, dtype=dt, device=dev), torch.zeros(2, 64, 2, 16, 128)
        tmo_kernels.store_kv_cache_head_major(kk.to(dev, dt), vv.to(dev, dt), mine, slots.to(dev))
        paged_cache.store_kv_cache_head_major(kk, vv, want, slots)
        errs["store_kv_cache_head_major"] = _max_err(mine, want)
        hidden = torch.randn(33, 256, generator=gen)
        w13, w2 = torch.randn(8, 2 * 64, 256, generator=gen) / 16, torch.randn(8, 256, 64, generator=gen) / 8
        ids, wts = torch.randint(0, 8, (33, 2), generator=gen), torch.rand(33, 2, generator=gen)
        got = tmo_kernels.fused_moe(*(t.to(dev, dt) for t in (hidden, w13, w2)), wts.to(dev), ids.to(dev))
        errs["fused_moe"] = _max_err(got, reference.fused_moe(hidden, w13, w2, wts, ids))
        bad = {name: err for name, err in errs.items() if not err <= _tolerance(dt) * 4}
        detail = ", ".join(f"{name} {err:.1e}" for name, err in errs.items())
        return ("FAIL" if bad else "PASS"), f"max |error| vs torch references: {detail}"

    # ------------------------------------------------------------------ KV pool
    def kv_pool(self):
        from pagoda_mlu.allocator import MluKVAllocator, plan_kv_pool
        from pagoda_mlu.platform import MluPlatform

        allocator = MluKVAllocator()
        shapes = [(2, 64, 8, 16, 128)] * 4
        caches = allocator.allocate(shapes, self.dtype, self.device)
        one_pool = len({c.untyped_storage().data_ptr() for c in caches}) == 1
        if not one_pool:
            return "FAIL", "the layer caches are not views of one allocation"
        if self.device_name == "cpu":
            return "PASS", "4 layer views of one allocation (sizing needs an MLU)"
        block = 2 * 32 * 8 * 128 * 16 * 2  # a Llama-3-8B-shaped model, 16-token blocks, float16
        platform = MluPlatform()
        plan = allocator.plan(platform, block, SimpleNamespace(num_kv_blocks=None, kv_cache_memory_gb=None,
                                                               memory_utilization=0.9))
        free, total = platform.memory_info()
        check = plan_kv_pool(free, total, block, SimpleNamespace(num_kv_blocks=None, kv_cache_memory_gb=None,
                                                                  memory_utilization=0.9))
        return "PASS", (f"one allocation; at memory_utilization 0.9 a Llama-3-8B-shaped cache gets "
                        f"{plan.num_blocks} blocks ({plan.pool_bytes / 2**30:.1f} GiB; {check.num_blocks} "
                        f"when measured again)")

    # ------------------------------------------------------------------ end to end
    def end_to_end(self, backend: str, model_dir: str, prompts, expected):
        from pagoda import LLM, SamplingParams

        from pagoda_mlu.runtime import torch_mlu_ops_importable

        if backend == "mlu_fused" and (self.device_name == "cpu" or not torch_mlu_ops_importable()):
            raise Skip("needs torch_mlu_ops on an MLU")
        llm = LLM(model=model_dir, device=self.device_name, dtype="float32", attention_backend=backend,
                  attention_options={"tile_size": 37} if backend == "mlu_chunked" else {},
                  num_kv_blocks=64, block_size=16, max_model_len=128, max_num_batched_tokens=32)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        got = [o.outputs[0].token_ids for o in outs]
        same = sum(a == b for a, b in zip(got, expected))
        status = "PASS" if same == len(expected) else "FAIL"
        return status, f"float32 greedy tokens equal transformers (CPU) for {same}/{len(expected)} prompts"

    # ------------------------------------------------------------------ tile sweep
    def sweep_tiles(self, sizes):
        from pagoda_mlu.chunked_attention import MluChunkedAttention

        timings = []
        for tile in sizes:
            self._attention(MluChunkedAttention, {"tile_size": tile}, 16)  # warm-up
            t0 = time.perf_counter()
            for _ in range(3):
                self._attention(MluChunkedAttention, {"tile_size": tile}, 16)
            timings.append(f"{tile}: {(time.perf_counter() - t0) / 3 * 1e3:.0f} ms")
        return "INFO", "mlu_chunked check batch per tile size (incl. host work): " + ", ".join(timings)


def run_checks(device: str, sweep_tiles: bool = False) -> list[Result]:
    from pagoda.testing import hf_greedy_tokens, make_tiny_checkpoint, random_prompts

    checks = Checks(device, torch.float32 if device == "cpu" else torch.float16)
    if checks.run("torch_mlu and devices", checks.torch_mlu).status == "FAIL":
        return checks.results
    checks.run("mlu_chunked attention", checks.chunked_attention, 64)
    checks.run("mlu_fused attention", checks.fused_attention)
    checks.run("torch_mlu_ops kernels", checks.tmo_kernels)
    checks.run("KV pool", checks.kv_pool)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_checkpoint("llama", tmp, seed=0, vocab_size=512, hidden_size=128, intermediate_size=256,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=256)
        prompts = random_prompts(4, 512, 5, 60, seed=1)
        expected = hf_greedy_tokens(model, prompts, 16)
        for backend in ("mlu_chunked", "mlu_fused"):
            checks.run(f"tiny Llama, {backend}", checks.end_to_end, backend, str(model), prompts, expected)
    if sweep_tiles:
        checks.run("tile sweep", checks.sweep_tiles, (32, 64, 128, 256, 512, 1024))
    return checks.results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda-mlu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="mlu", choices=("mlu", "cpu"))
    parser.add_argument("--sweep-tiles", action="store_true", help="time mlu_chunked for several tile sizes")
    parser.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    args = parser.parse_args(argv)
    print(f"pagoda-mlu check on {args.device} (torch {torch.__version__})", flush=True)
    results = run_checks(args.device, args.sweep_tiles)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    failed = [r.name for r in results if r.status == "FAIL"]
    print(f"{len(failed)} failed: {', '.join(failed)}" if failed else "all checks passed or were skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
