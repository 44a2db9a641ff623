"""``check_model``: the whole conformance run of one model plugin (``pagoda check-model``).

A target is an architecture name (tiny random variants from its transformers config class),
a ``config.json`` or a directory holding only one (its settings at tiny sizes), or a
checkpoint directory (checked as it is). For each variant: the weights check, prompt logits,
KV cache bytes per token and greedy decoding through chunked prefill and preemption.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagoda.errors import ConfigError
from pagoda.testing.conformance import CheckResult, check_greedy, check_kv_cache, check_prompt_logits, check_weights
from pagoda.testing.reference import load_reference_model, random_prompts
from pagoda.testing.tiny import TinyVariant, variant_from_config, variants_for_architecture, write_variant

CHECKS = ("weights", "prompt_logits", "kv_cache", "greedy")


@dataclass
class VariantReport:
    name: str
    checkpoint: str
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def as_dict(self) -> dict:
        return {"variant": self.name, "checkpoint": self.checkpoint, "passed": self.passed,
                "checks": [c.as_dict() for c in self.checks]}


@dataclass
class ConformanceReport:
    target: str
    architecture: str
    reference: str  # the transformers model type compared against
    variants: list[VariantReport] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.variants) and all(v.passed for v in self.variants)

    def as_dict(self) -> dict:
        return {"target": self.target, "architecture": self.architecture, "reference": self.reference,
                "passed": self.passed, "variants": [v.as_dict() for v in self.variants]}

    def table(self) -> str:
        rows = [(v.name, c.check, "PASS" if c.passed else "FAIL", c.detail) for v in self.variants for c in v.checks]
        head = ("variant", "check", "result", "detail")
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
        lines = [f"{self.architecture} against transformers {self.reference!r} ({self.target})"]
        for r in [head, *rows]:
            lines.append("  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3])
        failed = sum(not c.passed for v in self.variants for c in v.checks)
        lines.append(f"{'all checks passed' if not failed else f'{failed} checks FAILED'} "
                     f"({len(rows)} checks, {len(self.variants)} variants)")
        return "\n".join(lines)


@dataclass
class Target:
    architecture: str
    model_class: Any
    reference: str | None  # transformers model type for the reference, None: the checkpoint's own
    variants: list[TinyVariant] = field(default_factory=list)
    checkpoint: Path | None = None  # an existing checkpoint, checked as it is


def _model_class(architecture: str, where: str, model_impl: str = "auto"):
    """The class that runs ``architecture``: its native class, else (or with ``model_impl:
    transformers``) the transformers fallback."""
    from pagoda.errors import ModelLoadError
    from pagoda.selection import resolve_model_class

    try:
        return resolve_model_class([architecture], where, model_impl=model_impl)
    except ModelLoadError as exc:
        raise ConfigError(f"{exc}; install the plugin that provides it") from None


def resolve_target(target: str, model_impl: str = "auto") -> Target:
    import json

    from pagoda.testing.tiny import reference_model_type

    path = Path(target).expanduser()
    config_file = path / "config.json" if path.is_dir() else path
    if path.is_dir() and not config_file.is_file():
        raise ConfigError(f"{path}: a directory to check needs a config.json")
    if path.is_file() and path.suffix != ".json":
        raise ConfigError(f"{path}: check-model takes an architecture name, a config.json or an HF checkpoint "
                          f"directory (safetensors), not a {path.suffix or 'plain'} file")
    if config_file.is_file():
        try:
            raw = json.loads(config_file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{config_file}: not a readable JSON config: {exc}") from exc
        architecture = (raw.get("architectures") or [""])[0]
        if not architecture:
            raise ConfigError(f"{config_file}: no 'architectures' list names the model class")
        cls = _model_class(architecture, str(config_file), model_impl)
        if path.is_dir() and (any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file()):
            from pagoda.testing.tiny import known_model_type

            own = raw.get("model_type")
            declared = getattr(cls, "TRANSFORMERS_REFERENCE", None)
            reference = None if (own and known_model_type(own) and not declared) else \
                reference_model_type(architecture, cls)
            return Target(architecture, cls, reference, checkpoint=path)
        variant = variant_from_config(config_file, cls)
        return Target(architecture, cls, variant.model_type, [variant])
    if path.suffix == ".json" or "/" in target:
        raise ConfigError(f"{target}: no such file or directory (check-model takes an architecture name, a "
                          f"checkpoint directory, or a config.json)")
    cls = _model_class(target, "check-model", model_impl)
    variants = variants_for_architecture(target, cls)
    return Target(target, cls, variants[0].model_type, variants)


def check_model(target: str, variants: list[str] | None = None, checks: tuple[str, ...] = CHECKS,
                workdir: str | Path | None = None, atol: float = 1e-4, rtol: float = 1e-4,
                max_tokens: int = 32, seed: int = 0, model_impl: str = "auto") -> ConformanceReport:
    """Run the conformance checks of ``target`` and return the report (it never raises for a
    failing check; a target that cannot be resolved raises ConfigError). ``model_impl``: which
    implementation pagoda runs (``transformers`` checks the fallback on a native architecture)."""
    bad = [c for c in checks if c not in CHECKS]
    if bad:
        raise ConfigError(f"--checks: unknown check {', '.join(bad)} (choose from {', '.join(CHECKS)})")
    resolved = resolve_target(target, model_impl)
    chosen = resolved.variants
    if variants:
        names = [v.name for v in chosen]
        unknown = [v for v in variants if v not in names]
        if unknown:
            raise ConfigError(f"--variant {', '.join(unknown)}: {resolved.architecture} has variants "
                              f"{', '.join(names) or '(none: a checkpoint is checked as it is)'}")
        chosen = [v for v in chosen if v.name in variants]
    report = ConformanceReport(target, resolved.architecture, resolved.reference or "(the checkpoint's own)")
    with tempfile.TemporaryDirectory(prefix="pagoda-check-") as tmp:
        root = Path(workdir) if workdir is not None else Path(tmp)
        if resolved.checkpoint is not None:
            report.variants.append(_run(resolved.checkpoint, "checkpoint", resolved.reference, checks, atol, rtol,
                                        max_tokens, seed, model_impl))
        for variant in chosen:
            directory = root / variant.name
            try:
                write_variant(variant, directory, seed=seed)
            except Exception as exc:  # transformers rejects the tiny config: report it, go on
                failed = VariantReport(variant.name, str(directory))
                failed.checks.append(CheckResult("setup", False, f"transformers could not build this variant: "
                                                                 f"{type(exc).__name__}: {exc}"))
                report.variants.append(failed)
                continue
            report.variants.append(_run(directory, variant.name, variant.model_type, checks, atol, rtol,
                                        max_tokens, seed, model_impl))
    return report


def _guard(name: str, fn) -> CheckResult:
    try:
        return fn()
    except Exception as exc:  # a model that raises fails its check with the error, the run goes on
        return CheckResult(name, False, f"error: {type(exc).__name__}: {exc}")


def _run(directory: Path, name: str, reference: str | None, checks: tuple[str, ...], atol: float, rtol: float,
         max_tokens: int, seed: int, model_impl: str = "auto") -> VariantReport:
    import torch

    from pagoda import LLM

    report = VariantReport(name, str(directory))
    if "weights" in checks:
        report.checks.append(_guard("weights", lambda: check_weights(directory, model_impl)))
    if not {"prompt_logits", "kv_cache", "greedy"} & set(checks):
        return report
    try:
        hf = load_reference_model(directory, reference)
    except Exception as exc:
        report.checks.append(CheckResult("reference", False, f"transformers could not load the checkpoint: "
                                                             f"{type(exc).__name__}: {exc}"))
        return report
    vocab = hf.config.vocab_size
    torch.manual_seed(seed)
    if {"prompt_logits", "kv_cache"} & set(checks):
        # one prompt within a rope scaling's original length (64 in the tiny variants), one beyond
        prompts = random_prompts(1, vocab, 9, 40, seed=seed + 3) + random_prompts(1, vocab, 90, 90, seed=seed + 4)
        try:
            llm = LLM(model=str(directory), device="cpu", dtype="float32", block_size=8, num_kv_blocks=16,
                      max_model_len=128, enable_prefix_caching=False, model_impl=model_impl)
        except Exception as exc:
            for check in ("prompt_logits", "kv_cache"):
                if check in checks:
                    report.checks.append(CheckResult(check, False, f"the engine failed to start: "
                                                                   f"{type(exc).__name__}: {exc}"))
        else:
            if "prompt_logits" in checks:
                report.checks.append(_guard("prompt_logits",
                                            lambda: check_prompt_logits(llm, directory, prompts, hf, atol, rtol)))
            if "kv_cache" in checks:
                report.checks.append(_guard("kv_cache", lambda: check_kv_cache(llm)))
            del llm
    if "greedy" in checks:
        prompts = random_prompts(6, vocab, 5, 45, seed=seed + 7)
        report.checks.append(_guard("greedy", lambda: check_greedy(directory, prompts, max_tokens, hf,
                                                                    stepwise=True,
                                                                    engine={"model_impl": model_impl})[0]))
    return report
