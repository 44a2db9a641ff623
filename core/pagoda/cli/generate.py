"""``pagoda generate``: offline generation from prompts on the command line or in a file."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from pagoda.cli.engine_args import add_engine_args, engine_config_from_args, read_prompts


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text offline (default model: SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    p.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", dest="sampling_seed", type=int, default=None, help="sampling seed")
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--image", action="append", metavar="FILE", help="an image file sent with every prompt "
                   "(repeatable; vision-language models, docs/multimodal.md): with --chat it comes before the "
                   "prompt's text, else the prompt holds one placeholder per image")
    p.add_argument("--lora", metavar="PATH", help="generate with this PEFT LoRA adapter (sets enable_lora; "
                   "docs/lora.md)")
    add_engine_args(p, skip=("seed",))
    p.add_argument("--engine-seed", dest="seed", type=int, default=None, help="EngineConfig.seed")
    p.set_defaults(func=run)


def run(args) -> int:
    from pagoda import LLM, SamplingParams

    prompts = read_prompts(args)
    if not prompts:
        prompts = ["The capital of France is"]
    lora, extra = None, {}
    if args.lora:
        from pagoda.lora import LoRARequest
        from pagoda.lora.peft_format import read_adapter_config

        rank = read_adapter_config(Path(args.lora))["r"]
        extra = dict(enable_lora=True, max_lora_rank=max(args.max_lora_rank or 16, rank))
        lora = LoRARequest(Path(args.lora).name or "adapter", 1, args.lora)
    config = engine_config_from_args(args, **extra)
    t0 = time.perf_counter()
    llm = LLM(config=config)
    load_s = time.perf_counter() - t0
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, seed=args.sampling_seed, max_tokens=args.max_tokens,
                            stop=args.stop, logprobs=args.logprobs, ignore_eos=args.ignore_eos)
    t1 = time.perf_counter()
    images = _read_images(args.image or [])
    if args.chat:
        parts = [{"type": "image", "image": data} for data in images]
        outputs = llm.chat([[{"role": "user", "content": [*parts, {"type": "text", "text": p}] if images else p}]
                            for p in prompts], params, lora_request=lora)
    else:
        outputs = llm.generate([{"prompt": p, "multi_modal_data": {"image": images}} if images else p
                                for p in prompts], params, lora_request=lora)
    gen_s = time.perf_counter() - t1
    n_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    for prompt, out in zip(prompts, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "outputs": [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                for c in out.outputs]}))
            continue
        for c in out.outputs:
            print(f"{prompt}{c.text}" if not args.chat else c.text)
    print(f"[{llm.engine.model_name} on {llm.engine.platform.name}/{llm.engine.dtype}: loaded in "
          f"{load_s:.1f}s, {n_tokens} tokens in {gen_s:.2f}s]", file=sys.stderr)
    # the other ranks stopped and the process group freed now, not by finalizers at the interpreter's exit
    # (pagoda.distributed.process_group.destroy_parallel_state says why)
    llm.shutdown()
    return 0


def _read_images(paths: list[str]) -> list[bytes]:
    from pagoda.errors import ConfigError

    found = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                found.append(f.read())
        except OSError as exc:
            raise ConfigError(f"--image {path}: {exc.strerror or exc}") from None
    return found
