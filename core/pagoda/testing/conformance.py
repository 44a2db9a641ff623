"""The conformance checks of a pagoda model against transformers, as functions that return a
``CheckResult`` (``pagoda check-model`` prints them) and as pytest helpers (``assert_*``) that
raise ``AssertionError`` with the same message.

- prompt logits: every prompt position, float32, ``torch.testing.assert_close`` tolerances;
- greedy tokens: a batch of prompts of different lengths through continuous batching with
  chunked prefill and preemption (a small KV cache and step budget), identical tokens;
- weights: every checkpoint tensor read by the model's ``load_weights`` and every parameter
  filled;
- KV cache: bytes per token as the architecture implies (K and V per KV head, or MLA's latent).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagoda.testing.reference import hf_greedy_tokens, hf_prompt_logits
from pagoda.testing.tiny import expected_kv_bytes_per_token

BLOCK_SIZE = 8
STEP_TOKENS = 24  # token budget of one step: longer prompts are prefilled in chunks


@dataclass
class CheckResult:
    check: str  # prompt_logits, greedy, weights, kv_cache
    passed: bool
    detail: str
    metrics: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"check": self.check, "passed": self.passed, "detail": self.detail, "metrics": self.metrics}

    def assert_passed(self) -> CheckResult:
        if not self.passed:
            raise AssertionError(f"{self.check}: {self.detail}")
        return self


# ---------------------------------------------------------------------------- prompt logits
def check_prompt_logits(llm, directory: str | Path, prompts: list[list[int]], hf_model=None,
                        atol: float = 1e-4, rtol: float = 1e-4) -> CheckResult:
    """pagoda's logits of every position of each prompt (one paged prefill) against
    transformers', with ``torch.testing.assert_close(atol, rtol)``."""
    worst_abs, failures = 0.0, []
    for i, prompt in enumerate(prompts):
        ours = llm.prompt_logits(prompt)
        ref = hf_prompt_logits(directory, prompt, model=hf_model)
        if ours.shape != ref.shape:
            return CheckResult("prompt_logits", False, f"prompt {i}: logits shape {tuple(ours.shape)}, "
                                                       f"transformers {tuple(ref.shape)}")
        worst_abs = max(worst_abs, float((ours - ref).abs().max()))
        try:
            torch.testing.assert_close(ours, ref, atol=atol, rtol=rtol)
        except AssertionError as exc:
            failures.append(f"prompt {i} ({len(prompt)} tokens): {_first_lines(str(exc))}")
    lengths = ", ".join(str(len(p)) for p in prompts)
    metrics = {"max_abs_diff": worst_abs, "atol": atol, "rtol": rtol, "prompt_lengths": [len(p) for p in prompts]}
    if failures:
        return CheckResult("prompt_logits", False, "; ".join(failures), metrics)
    return CheckResult("prompt_logits", True, f"max |diff| {worst_abs:.2e} over prompts of {lengths} tokens "
                                              f"(atol {atol:g}, rtol {rtol:g})", metrics)


def assert_prompt_logits_match(llm, directory: str | Path, prompts: list[list[int]], hf_model=None,
                               atol: float = 1e-4, rtol: float = 1e-4) -> CheckResult:
    return check_prompt_logits(llm, directory, prompts, hf_model, atol, rtol).assert_passed()


def _first_lines(text: str, n: int = 3) -> str:
    return " ".join(line.strip() for line in text.strip().splitlines()[:n])


# ---------------------------------------------------------------------------- greedy batch
def stress_settings(prompts: list[list[int]], max_tokens: int, block_size: int = BLOCK_SIZE,
                    step_tokens: int = STEP_TOKENS) -> dict:
    """Engine settings that chunk the longer prompts (a step budget of ``step_tokens``) and
    preempt: a KV cache that holds the longest sequence and not much more."""
    longest = max(map(len, prompts)) + max_tokens
    max_model_len = -(-longest // block_size) * block_size
    return dict(block_size=block_size, num_kv_blocks=max_model_len // block_size, max_num_batched_tokens=step_tokens,
                max_model_len=max_model_len, enable_prefix_caching=False)


def check_greedy(directory: str | Path, prompts: list[list[int]], max_tokens: int = 32, hf_model=None,
                 expected: list[list[int]] | None = None, stepwise: bool = False, expect_preemption: bool = True,
                 engine: dict | None = None) -> tuple[CheckResult, Any]:
    """Greedy tokens of ``prompts`` generated together by pagoda (float32, CPU, with
    ``stress_settings`` updated by ``engine``) against transformers one prompt at a time
    (``expected`` if given). Also checks that the longest prompt was chunked, that a
    sequence was preempted (``expect_preemption``) and that every KV block was freed.
    Returns (result, the LLM)."""
    from pagoda import LLM, SamplingParams

    settings = dict(stress_settings(prompts, max_tokens), **(engine or {}))
    if expected is None:
        expected = hf_greedy_tokens(directory, prompts, max_tokens, model=hf_model, stepwise=stepwise)
    llm = LLM(model=str(directory), **{"device": "cpu", "dtype": "float32", **settings})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    got = [o.outputs[0].token_ids for o in outs]
    stats = llm.get_stats()
    metrics = {"prompts": len(prompts), "new_tokens": max_tokens, "preemptions": stats["num_preemptions"],
               "steps": stats["num_steps"], "engine": settings}
    problems = []
    for i, (ours, ref) in enumerate(zip(got, expected)):
        if ours != ref:
            at = next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
            problems.append(f"prompt {i} ({len(prompts[i])} tokens) differs at new token {at}: "
                            f"pagoda {ours[at:at + 4]} transformers {ref[at:at + 4]}")
    if len(got) != len(expected):
        problems.append(f"{len(got)} outputs for {len(expected)} prompts")
    if max(map(len, prompts)) <= settings["max_num_batched_tokens"]:
        problems.append(f"no prompt is longer than max_num_batched_tokens={settings['max_num_batched_tokens']}: "
                        f"chunked prefill was not exercised")
    if expect_preemption and stats["num_preemptions"] == 0:
        problems.append(f"no sequence was preempted with {settings['num_kv_blocks']} KV blocks")
    if stats["kv_blocks_used"] != 0:
        problems.append(f"{stats['kv_blocks_used']} KV blocks still in use after every request finished")
    if problems:
        return CheckResult("greedy", False, "; ".join(problems), metrics), llm
    return CheckResult("greedy", True, f"{len(prompts)} prompts x {max_tokens} tokens identical; "
                                       f"{stats['num_preemptions']} preemptions, prefill chunks of "
                                       f"{settings['max_num_batched_tokens']} tokens", metrics), llm


def assert_greedy_matches(directory: str | Path, prompts: list[list[int]], max_tokens: int = 32, hf_model=None,
                          expected: list[list[int]] | None = None, stepwise: bool = False,
                          expect_preemption: bool = True, engine: dict | None = None):
    """``check_greedy`` as a pytest assertion; returns the LLM for further checks."""
    result, llm = check_greedy(directory, prompts, max_tokens, hf_model, expected, stepwise, expect_preemption,
                               engine)
    result.assert_passed()
    return llm


# ---------------------------------------------------------------------------- prefix cache
def check_prefix_cache(directory: str | Path, prefix: list[int], tails: list[list[int]], max_tokens: int = 16,
                       hf_model=None, engine: dict | None = None) -> tuple[CheckResult, Any]:
    """Greedy tokens of ``prefix + tail`` for each tail with prefix caching on: the first prompt
    alone computes the prefix, then the others, generated together in chunks, read its full
    blocks from the cache. Every output must equal transformers' (one prompt at a time), the
    cache must have served each later prompt the prefix's full blocks, and every block must be
    free at the end. Returns (result, the LLM)."""
    from pagoda import LLM, SamplingParams

    prompts = [prefix + tail for tail in tails]
    expected = hf_greedy_tokens(directory, prompts, max_tokens, model=hf_model)
    settings = dict(block_size=BLOCK_SIZE, max_num_batched_tokens=STEP_TOKENS, enable_prefix_caching=True,
                    num_kv_blocks=4 * len(prompts) * (-(-(max(map(len, prompts)) + max_tokens) // BLOCK_SIZE)),
                    **(engine or {}))
    llm = LLM(model=str(directory), **{"device": "cpu", "dtype": "float32", **settings})
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)
    stats = llm.get_stats()
    block = settings["block_size"]
    wanted_hits = (len(prompts) - 1) * (len(prefix) // block * block)
    metrics = {"prefix_cache_hit_tokens": stats["prefix_cache_hit_tokens"], "expected_at_least": wanted_hits,
               "engine": settings}
    problems = [f"prompt {i} differs: pagoda {o.outputs[0].token_ids[:8]} transformers {ref[:8]}"
                for i, (o, ref) in enumerate(zip(outs, expected)) if o.outputs[0].token_ids != ref]
    if stats["prefix_cache_hit_tokens"] < wanted_hits:
        problems.append(f"the prefix cache served {stats['prefix_cache_hit_tokens']} tokens, expected at least "
                        f"{wanted_hits} ({len(prompts) - 1} prompts x the prefix's full blocks)")
    if stats["kv_blocks_used"] != 0:
        problems.append(f"{stats['kv_blocks_used']} KV blocks still in use after every request finished")
    if problems:
        return CheckResult("prefix_cache", False, "; ".join(problems), metrics), llm
    return CheckResult("prefix_cache", True, f"{len(prompts)} prompts identical; {stats['prefix_cache_hit_tokens']} "
                                             f"prompt tokens read from the cache", metrics), llm


def assert_prefix_cache_matches(directory: str | Path, prefix: list[int], tails: list[list[int]],
                                max_tokens: int = 16, hf_model=None, engine: dict | None = None):
    """``check_prefix_cache`` as a pytest assertion; returns the LLM."""
    result, llm = check_prefix_cache(directory, prefix, tails, max_tokens, hf_model, engine)
    result.assert_passed()
    return llm


# ---------------------------------------------------------------------------- weights
def checkpoint_tensor_names(directory: str | Path) -> list[str]:
    from safetensors import safe_open

    from pagoda.loader.hf import safetensors_files

    names: list[str] = []
    for path in safetensors_files(Path(directory)):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            names.extend(handle.keys())
    return names


def check_weights(directory: str | Path, model_impl: str = "auto") -> CheckResult:
    """Build the model of a checkpoint directory (the class ``model_impl`` selects) and run its
    ``load_weights`` over a ``WeightStream``: every checkpoint tensor must be read and every
    parameter filled."""
    from pagoda.config import EngineConfig
    from pagoda.errors import PagodaError
    from pagoda.loader.model_loader import default_dtype, load_config, resolve_quant_config, weight_stream
    from pagoda.loader.source import resolve_source
    from pagoda.selection import resolve_model_class

    source = resolve_source(str(directory))
    hf_config = load_config(source)
    cls = resolve_model_class(list(getattr(hf_config, "architectures", None) or []), str(source.path),
                              model_impl=model_impl, hf_config=hf_config)
    quant_config = resolve_quant_config(hf_config, EngineConfig(model=str(directory)))
    with torch.device("cpu"), default_dtype(torch.float32):
        model = cls(hf_config, quant_config=quant_config, prefix="")
    stream = weight_stream(source)
    try:
        with torch.no_grad():
            loaded = set(model.load_weights(stream) or ())
    except PagodaError as exc:
        return CheckResult("weights", False, f"load_weights failed: {exc}")
    in_checkpoint = checkpoint_tensor_names(directory)
    seen = set(stream.names_seen)
    unread = [n for n in in_checkpoint if n not in seen]
    params = [n for n, _ in model.named_parameters()]
    missing = [n for n in params if n not in loaded]
    metrics = {"checkpoint_tensors": len(in_checkpoint), "read": len(seen), "parameters": len(params),
               "loaded": len(loaded), "unread": unread, "missing": missing}
    problems = []
    if unread:
        problems.append(f"{len(unread)} checkpoint tensors never read by load_weights: {_some(unread)}")
    if missing:
        problems.append(f"{len(missing)} parameters not loaded: {_some(missing)}")
    if problems:
        return CheckResult("weights", False, "; ".join(problems), metrics)
    return CheckResult("weights", True, f"{len(in_checkpoint)} checkpoint tensors read, {len(params)} "
                                        f"parameters loaded", metrics)


def assert_weights_consumed(directory: str | Path, model_impl: str = "auto") -> CheckResult:
    return check_weights(directory, model_impl).assert_passed()


def _some(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


# ---------------------------------------------------------------------------- KV cache
def check_kv_cache(llm, expected: int | None = None) -> CheckResult:
    """``ModelRunner.kv_bytes_per_token()`` against ``expected`` (default: what the config
    implies, ``pagoda.testing.tiny.expected_kv_bytes_per_token``) for the runner's cache dtype."""
    runner = llm.engine.runner
    element = torch.empty((), dtype=runner.kv_cache_dtype()).element_size()
    if expected is None:
        expected = expected_kv_bytes_per_token(llm.engine.hf_config, element)
    got = runner.kv_bytes_per_token()
    metrics = {"bytes_per_token": got, "expected": expected, "element_size": element}
    if got != expected:
        return CheckResult("kv_cache", False, f"{got:g} bytes per token, the architecture implies {expected} "
                                              f"({element}-byte elements)", metrics)
    return CheckResult("kv_cache", True, f"{int(got)} bytes per token ({element}-byte elements)", metrics)


def assert_kv_bytes_per_token(llm, expected: int | None = None) -> CheckResult:
    return check_kv_cache(llm, expected).assert_passed()
