"""``pagoda quant-sim``: what a quantization method or policy costs, before serving with it.

Builds the model twice — full precision and quantized with ``--method`` — and reports, per
layer and overall, the weight error of the quantized layers, the logit error on a prompt set
(relative error, KL divergence, top-1 agreement), greedy-token agreement of generations, and
the weight memory saved.

    pagoda quant-sim --model DIR --method int4
    pagoda quant-sim --model DIR --method '{method: int4, group_size: 64}'
    pagoda quant-sim --model DIR --method policy.yaml --kv-cache-dtype fp8 --json report.json

Quantized layers report their error through their method's ``dequantize(layer)`` (linear)
or ``dequantize_all(layer, "w13" | "w2")`` (MoE experts); methods without them are listed
with their memory only.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import yaml

from pagoda.cli.engine_args import add_engine_args, engine_config_from_args
from pagoda.errors import ConfigError

DEFAULT_PROMPTS = [
    "The capital of France is",
    "Explain in one paragraph why the sky is blue.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Translate to German: The weather is nice today and we are going for a walk.",
    "List three uses of a paperclip:\n1.",
    "Once upon a time, in a village at the foot of a mountain,",
    "Q: What is 17 multiplied by 23?\nA:",
    "The most important property of a good hash function is",
]


def add_parser(sub) -> None:
    p = sub.add_parser("quant-sim", help="compare a quantization method or policy with full precision "
                       "(weight, logit and greedy-token error, memory saved)")
    p.add_argument("--method", required=True, help="fp8, int4, a YAML mapping ('{method: int4, group_size: 64}') "
                   "or a YAML policy file (default/rules/keep, or a file with a 'quantization:' key)")
    p.add_argument("--prompts-file", help="text prompts, one per line (default: a built-in set, or random token "
                   "ids when the model has no tokenizer)")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts used (default 8)")
    p.add_argument("--prompt-len", type=int, default=48, help="length of random token-id prompts (default 48)")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts keep their last tokens")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens generated per prompt (default 32)")
    p.add_argument("--layers", type=int, default=20, help="layers shown in the table, worst first (0: all)")
    p.add_argument("--json", dest="json_path", metavar="FILE", help="also write the full report as JSON")
    add_engine_args(p, skip=("quantization",))
    p.set_defaults(func=run)


def parse_method(text: str) -> Any:
    """A method name, a YAML mapping, or a YAML file holding a policy."""
    path = Path(text)
    if path.suffix in (".yaml", ".yml", ".json") or path.is_file():
        if not path.is_file():
            raise ConfigError(f"--method {text}: policy file does not exist")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"--method {text}: not valid YAML: {exc}") from None
        if isinstance(data, dict) and "quantization" in data:
            data = data["quantization"]
        elif isinstance(data, dict) and isinstance(data.get("engine"), dict):
            data = data["engine"].get("quantization")
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"--method {text!r} is neither a method name nor valid YAML: {exc}") from None
    if not isinstance(data, (str, dict)) or not data:
        raise ConfigError(f"--method {text!r}: expected a method name or a mapping, got {data!r}")
    return data


def _prompts(args, tokenizer, vocab_size: int) -> list[list[int]]:
    if args.prompts_file:
        lines = [ln.rstrip("\n") for ln in Path(args.prompts_file).read_text().splitlines() if ln.strip()]
        if tokenizer is None:
            raise ConfigError("--prompts-file needs a tokenizer, and this model has none")
        texts = lines[: args.num_prompts]
    elif tokenizer is not None:
        texts = (DEFAULT_PROMPTS * (1 + args.num_prompts // len(DEFAULT_PROMPTS)))[: args.num_prompts]
    else:
        from pagoda.testing import random_prompts

        return random_prompts(args.num_prompts, vocab_size, args.prompt_len, args.prompt_len, seed=0)
    return [tokenizer.encode(t)[-args.max_prompt_tokens:] for t in texts]


def _layer_weights(model) -> dict[str, Any]:
    """name -> module, for every layer that has a quant method (linear layers and MoE experts)."""
    out = {}
    for name, module in model.named_modules():
        if getattr(module, "quant_method", None) is not None:
            out[name] = module
    return out


def _compare_layer(fp_module, q_module) -> dict:
    method = q_module.quant_method
    name = getattr(method, "method_name", "") or ("none" if type(method).__name__.startswith("Unquantized")
                                                  else type(method).__name__)
    pairs = []
    if name != "none":
        if hasattr(method, "dequantize"):
            pairs.append((fp_module.weight, lambda: method.dequantize(q_module)))
        elif hasattr(method, "dequantize_all"):
            for part in ("w13", "w2"):
                pairs.append((getattr(fp_module, f"{part}_weight"),
                              lambda part=part: method.dequantize_all(q_module, part)))
    err2 = ref2 = 0.0
    max_abs = 0.0
    for ref, deq in pairs:
        ref = ref.float()
        diff = deq().float().to(ref.device) - ref
        err2 += float(diff.pow(2).sum())
        ref2 += float(ref.pow(2).sum())
        max_abs = max(max_abs, float(diff.abs().max()))
    fp_bytes = sum(p.numel() * p.element_size() for n, p in fp_module.named_parameters(recurse=False)
                   if n != "bias")
    q_bytes = sum(p.numel() * p.element_size() for n, p in q_module.named_parameters(recurse=False)
                  if n != "bias") + sum(b.numel() * b.element_size() for b in q_module.buffers(recurse=False))
    return {"method": name, "weight_rel_error": math.sqrt(err2 / ref2) if ref2 else (0.0 if not pairs else None),
            "weight_max_abs_error": max_abs, "bytes_full": fp_bytes, "bytes_quantized": q_bytes,
            "_err2": err2, "_ref2": ref2}


def _logit_metrics(fp_logits, q_logits) -> dict:
    import torch

    rel, kl, top1, max_abs, n = [], [], 0, 0.0, 0
    for a, b in zip(fp_logits, q_logits):
        rel.append(float((b - a).norm() / a.norm().clamp(min=1e-12)))
        max_abs = max(max_abs, float((b - a).abs().max()))
        p_log, q_log = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        kl.append(float((p_log.exp() * (p_log - q_log)).sum(-1).mean()))
        top1 += int((a.argmax(-1) == b.argmax(-1)).sum())
        n += a.shape[0]
    return {"logit_rel_error": sum(rel) / len(rel), "logit_max_abs_error": max_abs,
            "kl_divergence": sum(kl) / len(kl), "top1_agreement": top1 / max(n, 1)}


def _greedy_metrics(fp_tokens: list[list[int]], q_tokens: list[list[int]]) -> dict:
    same = match = prefix = total = 0
    for a, b in zip(fp_tokens, q_tokens):
        same += int(a == b)
        match += sum(int(x == y) for x, y in zip(a, b))
        run = 0
        while run < min(len(a), len(b)) and a[run] == b[run]:
            run += 1
        prefix += run
        total += len(a)
    return {"greedy_identical_sequences": same / max(len(fp_tokens), 1),
            "greedy_token_agreement": match / max(total, 1),
            "greedy_prefix_agreement": prefix / max(total, 1)}


def _model_bytes(model) -> int:
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def simulate(config, method: Any, args) -> dict:
    """Run both models and return the report (a JSON-able dict)."""
    from pagoda import LLM, SamplingParams
    from pagoda.loader.model_loader import load_config, resolve_quant_config
    from pagoda.loader.source import resolve_source

    q_config = config.model_copy(update={"quantization": method})
    hf_config = load_config(resolve_source(config.model, config.revision, config.download_dir))
    if getattr(hf_config, "quantization_config", None):
        raise ConfigError(f"{config.model} is already quantized (config.json quantization_config); quant-sim "
                          f"needs a full-precision checkpoint")
    policy = resolve_quant_config(hf_config, q_config)  # validates the method before loading anything
    if config.num_kv_blocks is None and config.kv_cache_memory_gb is None:
        # two engines side by side: a cache just large enough for the prompt set
        limit = int(getattr(hf_config, "max_position_embeddings", 2048) or 2048)
        max_len = config.max_model_len or min(limit, max(args.prompt_len, args.max_prompt_tokens) + args.max_tokens)
        per_seq = -(-max_len // config.block_size)
        sized = {"num_kv_blocks": per_seq * args.num_prompts + 4, "max_model_len": max_len}
        config, q_config = config.model_copy(update=sized), q_config.model_copy(update=sized)
    # "none", not unset: a .gguf model on the CPU would otherwise keep its blocks (docs/cpu.md)
    fp_config = config.model_copy(update={"quantization": "none", "kv_cache_dtype": "auto"})
    fp = LLM(config=fp_config)
    prompts = _prompts(args, fp.tokenizer, int(hf_config.vocab_size))
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    fp_logits = [fp.prompt_logits(p) for p in prompts]
    fp_tokens = [o.outputs[0].token_ids for o in fp.generate(prompts, greedy)]
    q = LLM(config=q_config)
    q_logits = [q.prompt_logits(p) for p in prompts]
    q_tokens = [o.outputs[0].token_ids for o in q.generate(prompts, greedy)]

    fp_layers, q_layers = _layer_weights(fp.engine.runner.model), _layer_weights(q.engine.runner.model)
    layers = {name: _compare_layer(fp_layers[name], module) for name, module in q_layers.items() if name in fp_layers}
    err2 = sum(v.pop("_err2") for v in layers.values())
    ref2 = sum(v.pop("_ref2") for v in layers.values() if v["method"] != "none")
    fp_bytes, q_bytes = _model_bytes(fp.engine.runner.model), _model_bytes(q.engine.runner.model)
    return {
        "model": str(config.model or fp.engine.model_name), "method": method,
        "policy": getattr(policy, "describe", lambda: str(method))(),
        "kv_cache_dtype": config.kv_cache_dtype, "num_prompts": len(prompts), "max_tokens": args.max_tokens,
        "overall": {"weight_rel_error": math.sqrt(err2 / ref2) if ref2 else 0.0,
                    **_logit_metrics(fp_logits, q_logits), **_greedy_metrics(fp_tokens, q_tokens),
                    "quantized_layers": sum(v["method"] != "none" for v in layers.values()),
                    "full_precision_layers": sum(v["method"] == "none" for v in layers.values())},
        "memory": {"weights_full_bytes": fp_bytes, "weights_quantized_bytes": q_bytes,
                   "saved_bytes": fp_bytes - q_bytes, "ratio": q_bytes / fp_bytes if fp_bytes else 1.0,
                   "kv_bytes_per_token_full": fp.engine.runner.kv_bytes_per_token(),
                   "kv_bytes_per_token_quantized": q.engine.runner.kv_bytes_per_token()},
        "layers": layers,
    }


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def print_report(report: dict, shown: int, out=None) -> None:
    out = out or sys.stdout
    o, m = report["overall"], report["memory"]
    print(f"quant-sim: {report['model']}", file=out)
    print(f"  policy: {report['policy']}; kv cache: {report['kv_cache_dtype']}; {report['num_prompts']} prompts, "
          f"{report['max_tokens']} greedy tokens each", file=out)
    rows = sorted(report["layers"].items(), key=lambda kv: -(kv[1]["weight_rel_error"] or 0.0))
    if shown:
        rows = rows[:shown]
    width = max([len(n) for n, _ in rows] + [5])
    header = f"{'layer':<{width}}  {'method':<10} {'rel err':>9} {'max err':>9} {'full':>12} {'quantized':>12}"
    print(f"\n  {header}", file=out)
    for name, r in rows:
        rel = "-" if r["weight_rel_error"] is None else f"{r['weight_rel_error']:.4f}"
        print(f"  {name:<{width}}  {r['method']:<10} {rel:>9} {r['weight_max_abs_error']:>9.4f} "
              f"{_size(r['bytes_full']):>12} {_size(r['bytes_quantized']):>12}", file=out)
    if shown and len(report["layers"]) > shown:
        print(f"  ... {len(report['layers']) - shown} more (--layers 0 shows all)", file=out)
    print(f"\n  quantized layers {o['quantized_layers']}, kept in full precision {o['full_precision_layers']}",
          file=out)
    print(f"  weight error (relative, all quantized layers)  {o['weight_rel_error']:.4f}", file=out)
    print(f"  logits: relative error {o['logit_rel_error']:.4f}, max abs {o['logit_max_abs_error']:.4f}, "
          f"KL {o['kl_divergence']:.5f}, top-1 agreement {o['top1_agreement']:.1%}", file=out)
    print(f"  greedy: identical sequences {o['greedy_identical_sequences']:.1%}, tokens agreeing "
          f"{o['greedy_token_agreement']:.1%}, agreeing prefix {o['greedy_prefix_agreement']:.1%}", file=out)
    print(f"  weights: {_size(m['weights_full_bytes'])} -> {_size(m['weights_quantized_bytes'])} "
          f"(saves {_size(m['saved_bytes'])}, {1 - m['ratio']:.1%}); KV cache per token "
          f"{m['kv_bytes_per_token_full']:,.0f} -> {m['kv_bytes_per_token_quantized']:,.0f} bytes", file=out)


def run(args) -> int:
    method = parse_method(args.method)
    config = engine_config_from_args(args)
    report = simulate(config, method, args)
    print_report(report, args.layers)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2, default=str))
    return 0
